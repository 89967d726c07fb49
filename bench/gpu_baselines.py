"""What loom is measured against on one GPU (`loom bench --gpu`), each a plain script a user could write:

    matmul   the bf16 matmul ceiling: TFLOP/s of one n×n×n product (8192), beside the catalog's peak
    loop     a hand-written training loop: one process, bf16 autocast, fused AdamW, full logits and
             F.cross_entropy, gradient clipping; over loom's own GPT (--model loom) or Hugging Face's
             LlamaForCausalLM of the same shape with SDPA attention (--model hf)

    PYTHONPATH=. python bench/gpu_baselines.py matmul [--size 8192] [--device cuda] --json FILE
    PYTHONPATH=. python bench/gpu_baselines.py loop --model loom|hf [--preset 1b] [--batch 8] [--seq 1024]
                                                [--steps 8] [--precision bf16] [--device cuda] --json FILE

Tokens are random (seeded): what is timed is the step, not the data. tokens/s leaves out the first
two steps (warm-up), as `loom train` does. Peak memory is torch.cuda.max_memory_allocated (none on
a CPU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def matmul(size: int, device: str) -> dict:
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in "ab")
    for _ in range(3):
        a @ b
    repeats = 20 if device == "cuda" else 3
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    peak = None
    if device == "cuda":
        from loom.plan.hardware import detect

        props = torch.cuda.get_device_properties(0)
        gpu = detect(props.name, props.total_memory)
        peak = gpu.bf16_tflops if gpu else None
    return {"tflops": 2 * size**3 / seconds / 1e12, "planned_tflops": peak, "size": size}


def build(model: str, preset_name: str, device: str) -> torch.nn.Module:
    from loom.models.gpt.config import preset

    cfg = preset(preset_name)
    if model == "loom":
        from loom.models.gpt.model import build_model

        net = build_model(cfg, device=device)
        net.init_weights(0)
        return net
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        return LlamaForCausalLM(hf)


def loop(model: str, preset_name: str, batch: int, seq: int, steps: int, precision: str, device: str) -> dict:
    torch.manual_seed(0)
    net = build(model, preset_name, device)
    vocab = net.cfg.vocab_size if model == "loom" else net.config.vocab_size
    optimizer = torch.optim.AdamW(
        net.parameters(),
        lr=3e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        **({"fused": True} if device == "cuda" else {"foreach": True}),
    )
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    tokens = torch.randint(0, vocab, (steps, batch, seq + 1), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(steps):
        _sync(device)
        start = time.perf_counter()
        inputs, targets = tokens[step, :, :-1], tokens[step, :, 1:]
        with torch.autocast(device, dtype=low, enabled=low is not None):
            logits = net(inputs) if model == "loom" else net(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        _sync(device)
        times.append(time.perf_counter() - start)
    timed = times[2:] or times
    return {
        "tokens_per_s": batch * seq * len(timed) / sum(timed),
        "step_s": sum(timed) / len(timed),
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "losses": [x.item() for x in losses],
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["matmul", "loop"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--model", choices=["loom", "hf"], default="loom")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.what == "matmul":
        result = matmul(a.size, a.device)
    else:
        result = loop(a.model, a.preset, a.batch, a.seq, a.steps, a.precision, a.device)
    with open(a.json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
