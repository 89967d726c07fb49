"""Which kernel loom's attention runs on this device, and what it keeps for backward against the plan
(loom/parallel/sdpa.py; loom/plan/shapes.py::attention_kv_width).

For fp32, bf16 and fp16, causal and under a document mask, at the 1B preset's heads (32 query heads
of 64, 8 k/v heads): one forward + backward of `attend`, the aten attention op that ran (flash,
efficient or math: the math kernel keeps B·H·T² scores), and the bytes autograd kept (q, k, v as
the kernel got them, its output and log-sum-exp; the mask apart: one per step, shared by every
block) per token, beside the planner's for this device.

    python bench/attention_kernels.py [--device cuda] [--seq 1024] [--json FILE]

Exits 1 when a case ran the math kernel or kept more than 2% beyond (or short of) the plan.

`loom bench --gpu` runs it (bench/gpu.py); tests/distributed/test_bench_gpu.py runs it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's loom

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64  # the 1b preset's
KERNELS = ("flash", "efficient", "cudnn", "math")


def _kernel(names: set[str]) -> str:
    """The attention kernel among the aten ops that ran."""
    for kernel in KERNELS:
        if any(kernel in n and "attention" in n and "backward" not in n for n in names):
            return kernel
    return "?"


def measure(device: str, dtype_name: str, masked: bool, seq: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loom.parallel.sdpa import attend
    from loom.plan.shapes import ModelShape, attention_kv_width

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, n, seq, HEAD_DIM, device=device, dtype=dtype, generator=g, requires_grad=True)
               for n in (HEADS, KV_HEADS, KV_HEADS))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None] if masked else None
    kept: dict[int, int] = {}
    shared = {mask.untyped_storage().data_ptr()} if masked else set()

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in shared:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attend(q, k, v, is_causal=not masked, attn_mask=mask)
        out.float().square().sum().backward()
    names = {e.name for e in prof.events()}
    elem = dtype.itemsize
    shape = ModelShape("1b heads", 100, HEADS * HEAD_DIM, 1, HEADS, KV_HEADS, 4 * HEADS * HEAD_DIM)
    kv = attention_kv_width(shape, elem, "cuda" if device.startswith("cuda") else "cpu", masked)
    # q, out; k, v; lse (fp32); the mask as the kernel's bias: per token, as plan/shapes.py counts them
    planned = elem * (2 * shape.d_model + 2 * kv) + 4 * HEADS + (elem * seq if masked else 0)
    measured = sum(kept.values()) / seq
    return {"case": f"{dtype_name}, {'document mask' if masked else 'causal'}", "kernel": _kernel(names),
            "bytes_per_token": measured, "planned_bytes_per_token": planned,
            "ok": _kernel(names) != "math" and abs(measured / planned - 1) < 0.02}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16", "float16"):
        for masked in (False, True):
            try:
                row = measure(a.device, dtype, masked, a.seq)
            except Exception as e:  # a kernel this device lacks (fp16 on an old CPU build): said, not fatal
                row = {"case": f"{dtype}, {'document mask' if masked else 'causal'}", "kernel": "error",
                       "error": f"{type(e).__name__}: {e}"[:200], "ok": False}
            rows.append(row)
            print(json.dumps(row))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
