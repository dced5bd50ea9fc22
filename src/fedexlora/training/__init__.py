"""Local training and evaluation, and DP-SGD. Knows nothing of federation."""

from fedexlora.training.local import *  # noqa: F403
from fedexlora.training.local import __all__  # noqa: F401
