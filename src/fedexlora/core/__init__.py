"""Pure math on tensors.

Aggregation rules, residuals, heterogeneous ranks, side branches and the method
registry. Imports torch and the standard library only.
"""
