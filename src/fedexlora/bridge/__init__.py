"""The only layer that knows peft and transformers.

Read and set factors, fold or side-branch a residual, load models, the public client
steps. Imports :mod:`fedexlora.core`.
"""
