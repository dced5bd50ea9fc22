"""Secure aggregation: the server sees only sums of the clients' uploads.

Flower's SecAgg+ (:mod:`fedexlora.secagg.protocol`), a quantization exact within float
rounding (:mod:`fedexlora.secagg.encoding`), and one round as both engines run it
(:mod:`fedexlora.secagg.rounds`). What each client's vector holds, and how the server
reads the sums, is pure math in :mod:`fedexlora.core.secure`. Needs flwr (the
``flower`` extra). See docs/PRIVACY.md.
"""
