"""Local training and evaluation, and DP-SGD. Knows nothing of federation."""
