"""Context parallelism's attention pieces on one device, against one SDPA over the whole sequence.

Every rank of a cp ring is simulated in one process with loom's own piece functions
(loom/parallel/context_parallel.py: _pieces, _piece_forward, _merge, _piece_backward, _piece_mask),
so the kernels a device runs for CP (CUDA's memory-efficient kernel on a GPU, the flash kernel on a
CPU) are checked without NCCL or several GPUs. Prints, per case (cp 2 and 4; fp32, bf16, fp16;
causal and packed documents; grouped k/v heads), the error of the output and of dq, dk, dv relative
to the largest value of each, and the tolerance the case must meet.

    PYTHONPATH=. python bench/cp_pieces.py [--device cuda|cpu] [--small] [--json FILE]

`loom bench --gpu` runs it as one of its cases; tests/unit/test_cp_kernels.py runs `check` on a CPU,
with the CPU's kernel and with an emulation of the CUDA kernel's contract.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

# The worst relative error each dtype may show (a CPU's flash kernel in bf16 stays within 8e-3).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def ring(q, k, v, grad, docs, cp: int):
    """Output and q/k/v gradients of attention over the whole sequence, computed as the cp ranks of
    a ring do, piece by piece: each rank's query chunks against every rank's k/v chunks, merged by
    online softmax; backward from the merged output and logsumexp. All in fp32 accumulators."""
    from loom.parallel import context_parallel as C

    total, device = q.shape[2], q.device
    ranks = [C.ContextGroup(None, cp, r) for r in range(cp)]
    where = [C.local_positions(total, cp, r, device) for r in range(cp)]
    seqs = [C.Sequence(positions=where[r], docs=docs, cp=ranks[r]) for r in range(cp)]
    c = seqs[0].chunk
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v))
    for r in range(cp):
        ql, gl = q[:, :, where[r]], grad[:, :, where[r]]
        merged = C._kernel(device).output(ql)
        lse = torch.full(ql.shape[:3], float("-inf"), dtype=torch.float32, device=device)
        done = []
        for source in [(r - step) % cp for step in range(cp)]:
            kl, vl = k[:, :, where[source]], v[:, :, where[source]]
            for a, b, causal in C._pieces(ranks[r], source):
                rows, keys = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                mask = C._piece_mask(seqs[r], source, a, b)
                o, piece_lse, aux = C._piece_forward(ql[:, :, rows], kl[:, :, keys], vl[:, :, keys], causal,
                                                     mask)
                C._merge(merged[:, :, rows], lse[:, :, rows], o, piece_lse)
                done.append((source, rows, keys, causal, mask, aux))
        merged = merged.to(q.dtype)  # what the ring's forward returns and saves
        out[:, :, where[r]] = merged.float()
        for source, rows, keys, causal, mask, aux in done:
            kl, vl = k[:, :, where[source]], v[:, :, where[source]]
            dq_p, dk_p, dv_p = C._piece_backward(gl[:, :, rows], ql[:, :, rows], kl[:, :, keys],
                                                 vl[:, :, keys], merged[:, :, rows], lse[:, :, rows], causal,
                                                 mask, aux)
            dq[:, :, where[r][rows]] += dq_p.float()
            dk[:, :, where[source][keys]] += dk_p.float()
            dv[:, :, where[source][keys]] += dv_p.float()
    return out, dq, dk, dv


def check(device: str = "cuda", small: bool = False, dtypes=(torch.float32, torch.bfloat16, torch.float16),
          sizes=(2, 4)) -> dict:
    """{case: {"out", "dq", "dk", "dv", "tolerance", "ok"}} for every cp size, dtype and mask."""
    from loom.parallel import context_parallel as C

    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim = 2, 8, 2, 64
    results = {}
    for cp in sizes:
        for dtype in dtypes:
            for documents in (False, True):
                total = 2 * cp * (20 if small else 256)  # 20 keys a chunk: bias rows that need padding
                q = torch.randn(batch, heads, total, head_dim, device=device, dtype=dtype)
                k, v = (torch.randn(batch, kv_heads, total, head_dim, device=device, dtype=dtype)
                        for _ in "kv")
                grad = torch.randn(batch, heads, total, head_dim, device=device, dtype=dtype)
                docs = None
                if documents:  # three documents, one of which starts inside the first chunk of batch 0
                    ends = torch.zeros(batch, total, dtype=torch.long, device=device)
                    ends[:, total // 3] = 1
                    ends[:, 2 * total // 3 + 5] = 1
                    ends[0, 7] = 1
                    docs = ends.cumsum(1)
                qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
                everywhere = torch.arange(total, device=device)
                mask = C._document_mask(docs, everywhere, everywhere) if documents else None
                ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=mask is None,
                                                     enable_gqa=True)
                ref.backward(grad.float())
                got = ring(q, k, v, grad, docs, cp)
                want = (ref.detach(), qf.grad, kf.grad, vf.grad)
                errors = {name: _relative(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
                name = f"cp{cp}-{str(dtype).removeprefix('torch.')}-{'docs' if documents else 'causal'}"
                tolerance = TOLERANCE[dtype]
                results[name] = {**errors, "tolerance": tolerance,
                                 "ok": all(e <= tolerance for e in errors.values())}
    return results


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (NaN anywhere: inf)."""
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="shorter sequences (a CPU's minute)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    results = check(a.device, a.small)
    for case, r in results.items():
        errors = "  ".join(f"{k} {r[k]:.1e}" for k in ("out", "dq", "dk", "dv"))
        print(f"{case:20s} {errors}  (≤ {r['tolerance']:.0e}) {'ok' if r['ok'] else 'WRONG'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
