"""loom: a PyTorch-native distributed training framework.

One config chooses the parallel strategy, the memory optimizations and the observability of a run.
"""

__version__ = "0.1.0"
