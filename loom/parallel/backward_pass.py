"""Which gradients the running backward pass takes: a zero-bubble pipeline (zb, zbv, dualpipev) splits
each backward into an input pass, which takes the stage inputs' gradients, and a weight pass, which
takes the weights' later from what the input pass kept. torch walks the same autograd graph twice, and
a node where an activation meets a weight (an autograd Function's: a norm, SwiGLU fused with its down
projection, the chunked loss) runs its backward in both. A Function computes all its gradients at once
and cannot see which the engine will keep, so it asks here and computes only those: without this, the
weight's matmul in the input pass and the input's in the weight pass are done and thrown away.

The pass is set by the pipeline stage around torch's backward of each kind (loom/parallel/pipeline.py)
and read by the Functions in loom/models. It is one value for the process, not per thread: on CUDA the
autograd engine runs a backward on its own device thread, and no two backwards run at once (DualPipeV's
overlap pairs a forward with a backward).
"""

from __future__ import annotations

import contextlib

# torch's own names for them (PipelineStage.backward_maybe_with_nosync)
FULL, INPUT, WEIGHT = "full", "input", "weight"
_pass = FULL


@contextlib.contextmanager
def backward_pass(kind: str):
    """Within it, a backward of `kind`: FULL (every gradient), INPUT or WEIGHT."""
    global _pass
    if kind not in (FULL, INPUT, WEIGHT):
        raise ValueError(f"unknown backward pass {kind!r}")
    before, _pass = _pass, kind
    try:
        yield
    finally:
        _pass = before


def takes_inputs() -> bool:
    """Whether this backward takes the gradients of activations (all but a weight pass)."""
    return _pass != WEIGHT


def takes_weights() -> bool:
    """Whether this backward takes the gradients of weights (all but an input pass)."""
    return _pass != INPUT
