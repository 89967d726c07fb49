"""The lean decoder block (issue 26) beside the block it replaced and Hugging Face's, on one CPU:

  saved   bytes autograd keeps for one block's backward, per token per d_model, at the 125m shape
          (d 768, 12 heads, f 2048) and 1 × 1024 tokens: loom's lean Block, the reference block
          (bench/reference_block.py, loom's before issue 26) and transformers' LlamaDecoderLayer
          (eager attention, as asked, and sdpa, the fair match for loom's fused attention; built
          from a LlamaConfig of the same shape: nothing downloaded), in bf16
          (16-bit weights: FSDP2's path) and under torch.autocast (ddp's: fp32 weights and residual
          stream). Everything kept but the parameters and what the model shares between its blocks
          (the RoPE table, Hugging Face's cos/sin and causal mask); autocast's 16-bit weight copies
          that autograd keeps count, as they are memory held until backward;
  loss    the peak of the loss's forward + backward beyond its inputs (torch's MemTracker) at
          V = 50257, 2048 tokens, bf16: train.loss_chunk 512 against 0 (the full logits); and
          its recompute: head matmuls per chunk and the loss's time, gradients computed in forward
          (loom's default) against the recompute in backward (GPipe and the split-backward
          schedules), whose second matmul's share of the loss's time the default saves;
  speed   tokens/s of a forward + backward through a few blocks, lean against reference,
          alternated (fp32, bf16 and autocast; the median of the pairs' ratios).

    python bench/lean_block.py [--json PATH] [--quick]

`loom bench --only memory` runs it and prints its rows (bench/benchmarks.py, memory()).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from reference_block import RefBlock  # noqa: E402

from loom.models.chunked_loss import Head  # noqa: E402
from loom.models.gpt.config import preset  # noqa: E402
from loom.models.gpt.model import Block, rope_tables  # noqa: E402

TOKENS, VOCAB, LOSS_TOKENS, LOSS_CHUNK = 1024, 50257, 2048, 512
MODES = ("bf16", "autocast")


def _context(mode: str):
    return torch.autocast("cpu", torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()


def _kept_bytes(run, shared: list[torch.Tensor], mode: str) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs its forward, beside `shared`."""
    skip = {t.untyped_storage().data_ptr() for t in shared}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _context(mode):
        run()
    return sum(kept.values())


def _hf_layer(cfg, attention: str):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = LlamaConfig(hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                     rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=TOKENS,
                     vocab_size=cfg.vocab_size, attn_implementation=attention)
    return LlamaDecoderLayer(hf, layer_idx=0), LlamaRotaryEmbedding(hf)


def saved_per_token_per_d(mode: str) -> dict[str, float]:
    """{lean, reference, hf, hf_sdpa}: bytes kept for backward per token per d_model, one block."""
    cfg = preset("125m", max_seq_len=TOKENS)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.manual_seed(0)
    out = {}
    rope = rope_tables(cfg.head_dim, TOKENS, cfg.rope_theta).to(dtype)
    for name, block in (("lean", Block(cfg)), ("reference", RefBlock(cfg))):
        block = block.to(dtype)
        x = torch.randn(1, TOKENS, cfg.d_model, dtype=dtype, requires_grad=True)
        out[name] = _kept_bytes(lambda: block(x, rope), [*block.parameters(), rope], mode)
    for name, attention in (("hf", "eager"), ("hf_sdpa", "sdpa")):
        out[name] = _hf_kept_bytes(cfg, attention, dtype, mode)
    return {k: v / TOKENS / cfg.d_model for k, v in out.items()}


def _hf_kept_bytes(cfg, attention: str, dtype: torch.dtype, mode: str) -> int:
    """Eager attention keeps the s×s probabilities (fp32 and the 16-bit copy); sdpa (is_causal, no
    mask) a fused kernel's output and statistics, as loom's."""
    layer, rotary = _hf_layer(cfg, attention)
    layer = layer.to(dtype)
    x = torch.randn(1, TOKENS, cfg.d_model, dtype=dtype, requires_grad=True)
    positions = torch.arange(TOKENS)[None]
    with _context(mode):
        cos, sin = rotary(x, positions)  # the model computes these once for all its layers
    shared = [*layer.parameters(), cos, sin]
    mask = None
    if attention == "eager":
        mask = torch.full((TOKENS, TOKENS), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        shared.append(mask)
    run = lambda: layer(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))  # noqa: E731
    return _kept_bytes(run, shared, mode)


def loss_peak_bytes(chunk: int, d_model: int = 768) -> int:
    """Peak live bytes of the loss's forward + backward beyond its inputs, bf16 (Head, as GPT calls it)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    head = Head(d_model, VOCAB, bias=False).to(torch.bfloat16)
    h = torch.randn(1, LOSS_TOKENS, d_model, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, LOSS_TOKENS))
    tracker = MemTracker()
    tracker.track_external(h, head.weight, targets)
    with tracker:
        head(h, targets, loss_chunk=chunk).backward()
    peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    inputs = h.numel() * h.element_size() + head.weight.numel() * 2 + targets.numel() * targets.element_size()
    return peak - inputs


def loss_recompute(pairs: int, chunk: int = LOSS_CHUNK, d_model: int = 768) -> dict:
    """The chunked loss's forward + backward, bf16, both ways (Head's grad_in_forward): head matmuls
    per chunk, counted at dispatch, and seconds (alternated; each side the fastest of 2)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    head = Head(d_model, VOCAB, bias=False).to(torch.bfloat16)
    h = torch.randn(1, LOSS_TOKENS, d_model, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, LOSS_TOKENS))
    matmuls = [0]

    class HeadMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            matmuls[0] += func.__name__.split(".")[0] in ("mm", "addmm") and out.shape[-1] == VOCAB
            return out

    def run(in_forward: bool) -> float:
        head.zero_grad(set_to_none=True)
        h.grad = None
        start = time.perf_counter()
        head(h, targets, loss_chunk=chunk, grad_in_forward=in_forward).backward()
        return time.perf_counter() - start

    chunks = -(-LOSS_TOKENS // chunk)
    out: dict = {}
    for in_forward, name in ((True, "in_forward"), (False, "recompute")):
        matmuls[0] = 0
        with HeadMatmuls():
            run(in_forward)
        out[f"{name}_matmuls_per_chunk"] = matmuls[0] / chunks
    times: dict[str, list[float]] = {"in_forward": [], "recompute": []}
    for i in range(pairs + 1):
        for name in times:
            seconds = min(run(name == "in_forward") for _ in range(2))
            if i:  # the first pair warms up
                times[name].append(seconds)
    out.update({f"{name}_s": statistics.median(t) for name, t in times.items()})
    # the share of the recompute path's loss time that its second head matmul costs
    ratios = [a / b for a, b in zip(times["in_forward"], times["recompute"])]
    out["recompute_share"] = 1 - statistics.median(ratios)
    return out


def _step_s(blocks: nn.ModuleList, x: torch.Tensor, rope: torch.Tensor, mode: str) -> float:
    blocks.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with _context(mode):  # backward inside autocast too, as loom's train step runs it
        h = x
        for block in blocks:
            h = block(h, rope)
        h.float().square().mean().backward()
    return time.perf_counter() - start


def tokens_per_s(mode: str, pairs: int, n_blocks: int = 2, tokens: int = 512) -> dict[str, float]:
    """Forward + backward through n_blocks of the 125m shape, lean and reference alternated (one
    warm-up each first), each side's time the fastest of 3 steps (other processes on the cores slow
    some steps, never speed one up): the median tokens/s of each and the median of the pairs' ratios."""
    cfg = preset("125m", max_seq_len=tokens)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.manual_seed(0)
    lean = nn.ModuleList(Block(cfg) for _ in range(n_blocks)).to(dtype)
    ref = nn.ModuleList(RefBlock(cfg) for _ in range(n_blocks)).to(dtype)
    ref.load_state_dict(lean.state_dict())
    x = torch.randn(1, tokens, cfg.d_model, dtype=dtype, requires_grad=True)
    rope = rope_tables(cfg.head_dim, tokens, cfg.rope_theta).to(dtype)
    times: dict[str, list[float]] = {"lean": [], "reference": []}
    for i in range(pairs + 1):
        for name, blocks in (("lean", lean), ("reference", ref)):
            seconds = min(_step_s(blocks, x, rope, mode) for _ in range(3))
            if i:  # the first pair warms the allocator and the kernels
                times[name].append(seconds)
    ratio = statistics.median(r / s for s, r in zip(times["lean"], times["reference"]))
    return {"lean": tokens / statistics.median(times["lean"]),
            "reference": tokens / statistics.median(times["reference"]), "ratio": ratio}


def measure(quick: bool = False) -> dict:
    threads = torch.get_num_threads()
    saved = {mode: saved_per_token_per_d(mode) for mode in MODES}
    loss = {"chunked": loss_peak_bytes(LOSS_CHUNK), "full": loss_peak_bytes(0)}
    pairs = 3 if quick else 5
    loss["recompute"] = loss_recompute(pairs - 1)
    speed = {mode: tokens_per_s(mode, pairs) for mode in ("fp32", *MODES)}
    return {"saved_per_token_per_d": saved, "loss_peak_bytes": loss, "tokens_per_s": speed,
            "shape": "125m (d 768, 12 heads, 12 kv heads, f 2048)", "tokens": TOKENS, "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="fewer timed pairs")
    a = ap.parse_args()
    result = measure(a.quick)
    for mode, per in result["saved_per_token_per_d"].items():
        lean = per["lean"]
        print(f"saved, {mode}: lean {lean:.2f}, reference {per['reference']:.2f}, HF eager {per['hf']:.2f}, "
              f"HF sdpa {per['hf_sdpa']:.2f} bytes/token/d ({lean / per['reference']:.2f}× the reference, "
              f"{lean / per['hf']:.2f}× HF eager, {lean / per['hf_sdpa']:.2f}× HF sdpa)")
    loss = result["loss_peak_bytes"]
    print(f"loss peak: chunk {LOSS_CHUNK} {loss['chunked'] / 2**20:.1f} MiB, full logits "
          f"{loss['full'] / 2**20:.1f} MiB ({loss['chunked'] / loss['full']:.3f}×)")
    r = loss["recompute"]
    print(f"loss recompute: head matmuls per chunk {r['in_forward_matmuls_per_chunk']:g} (gradients in "
          f"forward) vs {r['recompute_matmuls_per_chunk']:g} (recomputed in backward); loss fwd+bwd "
          f"{r['in_forward_s'] * 1e3:.0f} ms vs {r['recompute_s'] * 1e3:.0f} ms: the recompute is "
          f"{r['recompute_share']:.0%} of the recompute path's loss time")
    for dtype, s in result["tokens_per_s"].items():
        print(f"tokens/s, {dtype}: lean {s['lean']:,.0f}, reference {s['reference']:,.0f} "
              f"({s['ratio']:.2f}× the pairs' median)")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
