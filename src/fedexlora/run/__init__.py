"""The run: its directory and life, what both engines build it from, the in-process engine.

For both engines: the checks before a run (``preflight``), its directory and life
(``layout``, ``lifecycle``, ``checkpoint``, ``restore``, ``report``, ``trackers``,
``export``, ``recipes``), what a round is built from (``build``: model, server, data) and
a client's step in it (``client_step``), and the end of a round (``rounds``). The
in-process engine is ``inprocess``; the Flower engine is :mod:`fedexlora.flower`.
"""
