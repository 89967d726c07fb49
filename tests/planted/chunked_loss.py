"""Planted bugs in the chunked output projection + cross entropy (train.loss_chunk, issue 26)."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_chunked_loss.py"
FP32 = f"{UNIT}::test_fp32_matches_the_full_logits"
GPT = f"{UNIT}::test_gpt_computes_the_same_loss_and_gradients_in_its_head"
DIST = "tests/distributed/test_chunked_loss_ranks.py"  # a basename of its own: pytest imports by it
SFT = f"{DIST}::test_sft_chunked_loss_matches_the_full_logits"
CL = "loom/models/chunked_loss.py"

BUGS = [
    Bug("chunk-backward-ignores-mask", "backward gives IGNORE targets a gradient", CL,
        "g = g.mul_(torch.where(t != IGNORE, scale, 0.0)[:, None]).to(dtype)",
        "g = g.mul_(scale).to(dtype)",
        (FP32, GPT)),
    Bug("chunk-weight-grad-last-chunk", "the weight's gradient keeps only the last chunk's", CL,
        "        elif dw.dtype == g.dtype:\n            dw.addmm_(g.t(), hc)\n"
        "        else:\n            dw += g.t() @ hc\n",
        "        else:\n            dw = (g.t() @ hc).to(dw.dtype)\n",
        (FP32,)),
    Bug("chunk-mean-over-all-tokens", "the masked mean divides by every token, IGNORE ones too", CL,
        "count = (targets != IGNORE).sum().clamp(min=1) if masked else targets.numel()",
        "count = targets.numel()",
        (FP32, GPT)),
    Bug("chunk-forward-full-logits", "each chunk slices the full logits (same values, full memory)", CL,
        "logits = F.linear(hc, weight)",
        "logits = F.linear(h, weight)[start:start + chunk]",
        (f"{UNIT}::test_no_tensor_of_the_full_logits_ever_exists",)),
    Bug("chunk-backward-first-lse", "backward's softmax takes the first chunk's logsumexp for all", CL,
        ".sub_(lse[start:start + chunk, None])",
        ".sub_(lse[:hc.shape[0], None])",
        (FP32,)),
    Bug("gpt-drops-mask", "GPT's head is not told the targets are masked (SFT)", "loom/models/gpt/model.py",
        "return self.output(h, targets=targets, loss_chunk=loss_chunk, masked=masked)",
        "return self.output(h, targets=targets, loss_chunk=loss_chunk)",
        (f"{SFT}[zero3-units-accum2]",)),  # on spawned ranks alone (the unit test would catch it first)
    Bug("config-never-chunks", "the config's loss ignores train.loss_chunk", "loom/train/task.py",
        "    chunk = cfg.train.loss_chunk if gpt else 0\n",
        "    chunk = 0\n",
        (f"{UNIT}::test_the_config_chunks_under_every_layout",)),
    Bug("config-chunks-hugging-face", "a Hugging Face model (logits) is asked for the chunked loss",
        "loom/train/task.py",
        "    chunk = cfg.train.loss_chunk if gpt else 0\n",
        "    chunk = cfg.train.loss_chunk\n",
        (f"{UNIT}::test_the_config_chunks_under_every_layout",)),
    Bug("loss-chunk-negative-allowed", "train.loss_chunk accepts negative values", "loom/config.py",
        '"train.loss_chunk": _count(0,',
        '"train.loss_chunk": _count(-10,',
        (f"{UNIT}::test_loss_chunk_key",)),
    Bug("default-chunk-too-large", "the default chunk is 4096 tokens: at 2048 tokens nothing is chunked",
        "loom/config.py",
        "    loss_chunk: int = 512\n",
        "    loss_chunk: int = 4096\n",
        (f"{UNIT}::test_the_loss_peak_at_gpt2_vocabulary_is_under_a_fifth",)),
    Bug("plan-chunk-prices-every-token", "the plan prices a chunk of logits as all the micro-batch's tokens",
        "loom/plan/shapes.py",
        "return min(chunk, seq * micro_batch) * shape.vocab_size",
        "return seq * micro_batch * shape.vocab_size",
        (f"{UNIT}::test_the_plan_prices_one_chunk_of_logits",)),
    Bug("chunk-weight-grad-last-chunk-ranks", "the same, on spawned zero3 ranks alone", CL,
        "        elif dw.dtype == g.dtype:\n            dw.addmm_(g.t(), hc)\n"
        "        else:\n            dw += g.t() @ hc\n",
        "        else:\n            dw = (g.t() @ hc).to(dw.dtype)\n",
        (f"{DIST}::test_chunked_loss_trains_as_the_full_logits[zero3-units]",)),
]
