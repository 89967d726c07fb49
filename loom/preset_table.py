"""`loom presets`: the model presets' shapes as a table (model.preset, `loom plan --model`)."""

from __future__ import annotations

from loom.models.gpt.config import PRESETS, GPTConfig
from loom.plan.report import params_text

COLUMNS = ("name", "params", "d_model", "n_layers", "heads", "kv heads", "ffn", "vocab", "context", "experts")


def preset_row(name: str, g: GPTConfig) -> tuple[str, ...]:
    """One preset's cells: an MoE preset's params with the active ones (a token's top-k experts),
    its experts as routed (top k) + shared."""
    params = params_text(g.num_params())
    experts = "-"
    if g.moe_experts:
        params += f" ({params_text(g.num_params(active=True))} active)"
        shared = f" + {g.moe_shared_experts} shared" if g.moe_shared_experts else ""
        experts = f"{g.moe_experts} (top {g.moe_top_k}){shared}"
    return (name, params, str(g.d_model), str(g.n_layers), str(g.n_heads), str(g.n_kv_heads),
            str(g.ffn_hidden), f"{g.vocab_size:,}", f"{g.max_seq_len:,}", experts)


def presets_table() -> str:
    rows = [COLUMNS, *(preset_row(name, g) for name, g in PRESETS.items())]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    return "\n".join([*lines, "", "use one: --set model.preset=NAME (loom train), --model NAME (loom plan); "
                      "a model.* key replaces one of its values"])
