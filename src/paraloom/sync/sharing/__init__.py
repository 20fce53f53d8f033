"""Shared gradients: threshold-encoded update sharing with residuals (DL4J's SHARED_GRADIENTS).

One room per job:

- ``recipe.py``: ``SharingRecipe``, every option with its defaults, validated once;
- ``synchronizer.py``: ``SharedGradients``, the step hooks that run the steps below;
- ``view.py``: the local view (the shared parameters plus this replica's unsent updates);
- ``encoder.py``: the message made of the residual each step, and its counters;
- ``exchange.py``: every replica's message to every replica, at once or overlapped;
- ``state.py``: the tensors a replica keeps between steps, and a loaded state waiting for them.

The message formats are in ``paraloom.sync.encoding``, the threshold algorithms and residual
post-processors in ``paraloom.sync.thresholds``, momentum masking in ``paraloom.sync.momentum``.
"""

from paraloom.sync.sharing.recipe import SharingRecipe
from paraloom.sync.sharing.state import differs
from paraloom.sync.sharing.synchronizer import SharedGradients

__all__ = ["SharedGradients", "SharingRecipe", "differs"]
