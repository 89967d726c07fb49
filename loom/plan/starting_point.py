"""What `loom plan --emit` makes of the CPU demo's settings: a starting point for a real run.

The data and the tokenizer only the user knows: left as marked placeholders that `loom train` refuses
until set. The learning rate, its warmup and the step count follow published rules of thumb for the
model's size and the plan's batch. A setting the user's config changed from loom's default is kept."""

from __future__ import annotations

import bisect
import math

from loom.config import Config, DataConfig, TrainConfig

DATA_PLACEHOLDER = "<your data: a file, folder, glob or prepared folder>"
TOKENIZER_PLACEHOLDER = "<your tokenizer: a tokenizer.json or model folder that fits model.vocab_size>"

# GPT-3's peak learning rates by model size (Brown et al. 2020, Table 2.1), interpolated in log-log
# between rows and held at the ends; Llama-2/3 trained 7-8B at 3e-4 and 70B at 1.5e-4, the same order.
GPT3_LR_TABLE = ((125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4), (2.7e9, 1.6e-4),
                 (6.7e9, 1.2e-4), (13e9, 1.0e-4), (175e9, 0.6e-4))
WARMUP_TOKENS = 375e6  # GPT-3 warmed the learning rate up over its first 375M tokens
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal budget (Hoffmann et al. 2022): ~20 tokens a parameter


def peak_lr(params: float) -> float:
    """GPT-3's Table 2.1 learning rate for a model of `params` parameters."""
    sizes = [n for n, _ in GPT3_LR_TABLE]
    i = bisect.bisect_left(sizes, params)
    if i == 0:
        return GPT3_LR_TABLE[0][1]
    if i == len(sizes):
        return GPT3_LR_TABLE[-1][1]
    (n0, lr0), (n1, lr1) = GPT3_LR_TABLE[i - 1], GPT3_LR_TABLE[i]
    f = math.log(params / n0) / math.log(n1 / n0)
    return float(f"{math.exp(math.log(lr0) + f * math.log(lr1 / lr0)):.2g}")


def budget_steps(params: float, tokens_per_step: int) -> int:
    """Optimizer steps to train on Chinchilla's ~20 tokens per parameter."""
    return math.ceil(TOKENS_PER_PARAM * params / tokens_per_step)


def warmup_steps(tokens_per_step: int, steps: int) -> int:
    """GPT-3's warmup of 375M tokens in steps of this batch (at most a tenth of the run)."""
    return max(1, min(math.ceil(WARMUP_TOKENS / tokens_per_step), steps // 10))


def make_starting_point(cfg: Config, params: float, tokens_per_step: int) -> tuple[dict, str]:
    """What to write over `cfg`'s demo settings: {section.key: (value, comment)}, and the line saying
    what is a placeholder and what was derived. A fine-tune (init_from, LoRA) keeps its LR and steps:
    the rules are for pretraining from scratch."""
    d, t, default = cfg.data, cfg.train, TrainConfig()
    changes: dict[str, tuple[object, str]] = {}
    if not d.mix and d.source == DataConfig.source:
        changes["data.source"] = (DATA_PLACEHOLDER, "set it, here or with --set data.source=PATH")
    if d.tokenizer == DataConfig.tokenizer and not cfg.model.init_from:
        changes["data.tokenizer"] = (TOKENIZER_PLACEHOLDER, "set it, here or with --set data.tokenizer=PATH "
                                     "(byte and bpe suit only small vocabularies)")
    scratch = not cfg.model.init_from and cfg.lora.rank is None
    derived = []
    if scratch and t.steps == default.steps:
        steps = budget_steps(params, tokens_per_step)
        changes["train.steps"] = (steps, f"Chinchilla: {TOKENS_PER_PARAM} tokens per parameter / "
                                  f"{tokens_per_step:,} tokens per step")
        derived.append(f"train.steps = {steps:,} ({TOKENS_PER_PARAM} tokens per parameter, Chinchilla)")
    steps = changes.get("train.steps", (t.steps,))[0]
    if scratch and t.lr == default.lr:
        lr = peak_lr(params)
        changes["train.lr"] = (lr, f"GPT-3's table (Brown et al. 2020) for {params / 1e9:.3g}B parameters")
        derived.append(f"train.lr = {lr:g} (GPT-3's table for {params / 1e9:.3g}B parameters)")
    if scratch and t.warmup_steps == default.warmup_steps:
        warmup = warmup_steps(tokens_per_step, steps)
        changes["train.warmup_steps"] = (warmup, "GPT-3's 375M tokens of warmup")
        derived.append(f"train.warmup_steps = {warmup:,} (GPT-3's 375M tokens)")
    placeholders = [k for k in changes if k.startswith("data.")]
    words = []
    if placeholders:
        words.append(f"placeholders to set before loom train: {', '.join(placeholders)} (in the file, or "
                     f"--set {placeholders[0]}=...)")
    if derived:
        words.append(f"derived: {', '.join(derived)}")
    return changes, "; ".join(words)


def apply(cfg: Config, changes: dict) -> None:
    """Write the values of `changes` into `cfg` (its data and train sections, already copies)."""
    for key, (value, _) in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def annotate(toml: str, changes: dict) -> str:
    """`toml` with each changed key's line followed by its comment."""
    lines, section = [], ""
    for line in toml.split("\n"):
        if line.startswith("["):
            section = line.strip("[]")
        key = f"{section}.{line.partition(' = ')[0]}"
        lines.append(f"{line}  # {changes[key][1]}" if " = " in line and key in changes else line)
    return "\n".join(lines)
