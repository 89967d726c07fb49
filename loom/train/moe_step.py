"""A mixture of experts in the training step: the auxiliary loss's weight per forward call, and after
each optimizer step the routing's global tally (tokens per expert, dropped choices, aux loss) and
aux-loss-free balancing's bias update from it.

Values stay on the device: the step's MoE vector is read back with the loss, a step late
(loom/train/driver.py StepLog), so the host never waits for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.config import Config, pipeline_microbatches
from loom.models.gpt.config import GPTConfig
from loom.models.gpt.moe import moe_modules
from loom.parallel.mesh import Dist


def configure(parts: list[nn.Module], cfg: Config) -> None:
    """Each MoE block's d(loss)/d(aux loss) per forward call: its coefficient over the micro-batches
    a step averages (the language-model loss is scaled alike: loom/train/step.py). Under LoRA the
    routing is the frozen base's: no aux loss, no bias update."""
    calls = cfg.train.grad_accum * (pipeline_microbatches(cfg.parallel) if cfg.parallel.pp > 1 else 1)
    for part in parts:
        for block in moe_modules(part):
            block.aux_weight = block.cfg.moe_aux_loss_coef / calls
            if cfg.lora.rank is not None:
                block.aux_weight = block.bias_update_rate = 0.0


def experts_of(model: nn.Module) -> int:
    """Routed experts per MoE block of loom's GPT (a pipeline stage without MoE blocks too); 0 for a
    dense or another model."""
    for module in model.modules():
        if isinstance(getattr(module, "cfg", None), GPTConfig):
            return module.cfg.moe_experts
    return 0


def after_step(model: nn.Module, d: Dist | None, experts: int,
               pp_group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """The step's routing over the global batch, every rank alike: [aux loss (mean over MoE blocks and
    forward calls), dropped choices, load imbalance (max over blocks of busiest/mean), tokens per
    expert summed over blocks...]; None for a dense model (`experts` = 0). Moves each block's
    expert_bias by its moe_bias_update_rate, and starts the next step's tally. `d` None: one process,
    no process group (the tests' plain loop)."""
    if not experts:
        return None
    blocks = [b for b in moe_modules(model) if b.stats is not None]
    # One all-reduce over the data-parallel (× cp) ranks: every rank of a stage sees its own tokens.
    tally = torch.stack([torch.cat([b.stats.load, b.stats.dropped.reshape(1),
                                    (b.stats.aux / max(b.stats.calls, 1)).reshape(1)]) for b in blocks]) \
        if blocks else torch.zeros(0, experts + 2, device=d.device if d is not None else None)
    if blocks and d is not None:
        dist.all_reduce(tally, group=d.grad_mesh.get_group())
    ranks = d.grad_mesh.size() if d is not None else 1
    load, dropped, aux = tally[:, :experts], tally[:, experts], tally[:, experts + 1] / ranks
    for block, block_load in zip(blocks, load):
        rate = block.bias_update_rate
        if rate:
            block.expert_bias += rate * torch.sign(block_load.mean() - block_load)
        block.stats = None
    imbalance = (load.max(1).values / load.mean(1).clamp(min=1e-9)).amax().reshape(1) if blocks \
        else torch.zeros(1, device=tally.device)
    sums = torch.cat([aux.sum().reshape(1), aux.new_full((1,), float(len(blocks))),  # no host copy
                      dropped.sum().reshape(1), load.sum(0)])
    if pp_group is not None:  # each pipeline stage holds other blocks: all of them
        dist.all_reduce(sums, group=pp_group)
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=pp_group)
    return torch.cat([sums[:1] / sums[1], sums[2:3], imbalance, sums[3:]])


def metrics(v: list[float] | None) -> dict:
    """metrics.jsonl's MoE fields from after_step's vector, read back on the host."""
    if not v:
        return {}
    return {"moe_aux_loss": v[0], "moe_dropped": int(round(v[1])), "moe_load_imbalance": v[2],
            "moe_expert_tokens": [int(round(x)) for x in v[3:]]}
