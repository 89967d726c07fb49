"""The mixture-of-experts feed-forward: a router, routed SwiGLU experts, optional shared experts.

Routing: scores = softmax or sigmoid of the router's logits (fp32); each token takes the top_k
experts of scores + expert_bias (the bias only chooses: DeepSeek-V3's aux-loss-free balancing);
its weights are the chosen experts' scores, renormalized to sum 1 when moe_norm_topk, times
moe_route_scale. Dropless by default: every token reaches its experts (rows sorted by expert, one
matmul per expert on CPU). With moe_capacity_factor > 0, an expert takes at most
ceil(factor·k·T/E) of a sequence's T tokens, the first in sequence order; the rest are dropped
(counted) and pass on the residual alone.

Balancing, both per sequence so that every layout (any dp, ep, accumulation) trains exactly as one
process does:
  aux loss  E·Σ_e f_e·P_e, f_e = the share of the sequence's k·T choices that went to e, P_e the
            mean over its tokens of e's score (scores normalized to sum 1), averaged over the
            sequences, times moe_aux_loss_coef; it reaches the router through the gradient only
            (AuxLoss), so the training loss stays the language model's.
  bias      expert_bias (a buffer, checkpointed) moves by moe_bias_update_rate·sign(mean − load_e)
            after each optimizer step, from the step's global load (loom/train/step.py).

Under expert parallelism (parallel.ep) the experts' weights are DTensors over the ep ranks and the
rows travel with all-to-all (loom/parallel/expert_parallel.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from loom.models.gpt.config import GPTConfig
from loom.models.gpt.lean_ops import swiglu, swiglu_down
from loom.models.lora import lora_delta
from loom.parallel.expert_parallel import ExpertGroup, return_from_experts, scale_grad, send_to_experts
from loom.parallel.mesh import local_view
from loom.parallel.pipeline import inferring_shapes

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # Experts' parameters: [E, hidden, d], [E, hidden, d], [E, d, hidden]


class Experts(nn.Module):
    """E SwiGLU experts, their weights stacked on dim 0 (split there over the ep ranks)."""

    EXPERT_WEIGHTS = EXPERT_WEIGHTS

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, d_model))  # gate
        self.w3 = nn.Parameter(torch.empty(experts, hidden, d_model))  # up
        self.w2 = nn.Parameter(torch.empty(experts, d_model, hidden))  # down
        self.ep: ExpertGroup | None = None  # set by expert parallelism: this rank holds E/ep of them
        self.lora = None  # LoRA (loom/models/lora.py): its spec, and which weights are adapted

    def add_lora(self, spec, weights: list[str]) -> None:
        """LoRA on each expert's `weights`: {w}_lora_A [E, r, in] and {w}_lora_B [E, out, r]."""
        self.lora, self.lora_weights = spec, tuple(weights)
        for w in weights:
            experts, out, inp = getattr(self, w).shape
            with torch.device(getattr(self, w).device):
                self.register_parameter(f"{w}_lora_A", nn.Parameter(torch.empty(experts, spec.rank, inp)))
                self.register_parameter(f"{w}_lora_B", nn.Parameter(torch.empty(experts, out, spec.rank)))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [M, d] sorted by (local) expert, counts[e] of them for expert e -> [M, d]."""
        grad_scale = 1.0 / self.ep.size if self.ep is not None else 1.0

        def local(name: str) -> tuple[torch.Tensor, ...]:
            return scale_grad(local_view(getattr(self, name)), grad_scale).unbind(0)

        weights = {w: local(w) for w in EXPERT_WEIGHTS}
        if self.lora is not None:
            adapters = {w: (local(f"{w}_lora_A"), local(f"{w}_lora_B")) for w in self.lora_weights}
            return self._forward_lora(rows, counts, weights, adapters)
        w1, w3, w2 = (weights[w] for w in EXPERT_WEIGHTS)
        # Every expert runs, on no rows too: its gradient is then zero, not missing (the engines
        # reduce every parameter's gradient).
        return torch.cat([swiglu_down(F.linear(part, w1[e]), F.linear(part, w3[e]), w2[e])
                          for e, part in enumerate(rows.split(counts))])

    def _forward_lora(self, rows: torch.Tensor, counts: list[int], weights: dict,
                      adapters: dict) -> torch.Tensor:
        spec = self.lora

        def linear(x: torch.Tensor, w: str, e: int) -> torch.Tensor:
            out = F.linear(x, weights[w][e])
            if w in adapters:
                a, b = adapters[w]
                out = out + lora_delta(x, a[e], b[e], spec.scale, spec.dropout, self.training)
            return out

        return torch.cat([linear(swiglu(linear(part, "w1", e), linear(part, "w3", e)), "w2", e)
                          for e, part in enumerate(rows.split(counts))])


class SharedExpert(nn.Module):
    """The always-on experts as one SwiGLU of moe_shared_experts × expert width."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.w2) is not nn.Linear:  # an adapted w2 (LoRA) computes through its own forward
            return self.w2(swiglu(self.w1(x), self.w3(x)))
        return swiglu_down(self.w1(x), self.w3(x), self.w2.weight)


class _AuxLoss(torch.autograd.Function):
    """x unchanged; in backward, the auxiliary loss's gradient (d loss/d aux = weight) joins."""

    @staticmethod
    def forward(ctx, x, aux, weight):
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoEStats:
    """What a block's routing did since the last step (device tensors; read by the step)."""

    def __init__(self, experts: int, device: torch.device) -> None:
        self.load = torch.zeros(experts, device=device)  # tokens routed to each expert (before capacity)
        self.dropped = torch.zeros((), device=device)  # choices dropped by capacity
        self.aux = torch.zeros((), device=device)  # sum of the forward calls' aux losses
        self.calls = 0


class MoE(nn.Module):
    """The feed-forward of an MoE block: router, routed experts, shared experts."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.experts_n, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        # Added to the scores to choose experts only (aux-loss-free balancing); saved in checkpoints
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=True)
        self.experts = Experts(cfg.moe_experts, cfg.d_model, cfg.expert_hidden)
        hidden = cfg.moe_shared_experts * cfg.expert_hidden
        self.shared = SharedExpert(cfg.d_model, hidden) if hidden else None
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.moe_shared_gate else None
        # d(training loss)/d(aux loss) of one forward call: coefficient / micro-batches averaged
        # (loom/train/step.py sets the count; 1 for a single call)
        self.aux_weight = cfg.moe_aux_loss_coef
        self.bias_update_rate = cfg.moe_bias_update_rate  # 0 under LoRA (loom/train/moe_step.py)
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("moe"):  # the block's forward, whole, in profiler traces
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, tokens, d = x.shape
        flat = x.reshape(-1, d)
        scores, chosen, weights = self.route(flat)
        keep = self.capacity_keep(chosen.view(bsz, tokens, -1)).flatten() if self.cfg.moe_capacity_factor \
            else None
        load = torch.bincount(chosen.flatten(), minlength=self.experts_n)  # choices per expert
        aux = self.aux_loss(scores, chosen, bsz) if self.training else None  # for the gradient and the tally
        self._record(load, keep, aux)
        routed = self.run_experts(flat, chosen.flatten(), weights.flatten(), keep, load)
        out = routed.view_as(x)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        if aux is not None and self.cfg.moe_aux_loss_coef and torch.is_grad_enabled():
            out = _AuxLoss.apply(out, aux, self.aux_weight)
        return out

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [N, E] fp32, chosen experts [N, k], their weights [N, k] fp32)."""
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.cfg.moe_score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.cfg.moe_norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
        return scores, chosen, weights * self.cfg.moe_route_scale

    def aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, sequences: int) -> torch.Tensor:
        """E·Σ_e f_e·P_e per sequence, averaged over the sequences (1 when perfectly balanced)."""
        e = self.experts_n
        probs = scores / scores.sum(-1, keepdim=True) if self.cfg.moe_score == "sigmoid" else scores
        p = probs.view(sequences, -1, e).mean(1)  # [B, E]
        counts = F.one_hot(chosen.view(sequences, -1), e).sum(1).float()  # [B, E]
        f = counts / counts.sum(-1, keepdim=True)
        return (e * (f * p).sum(-1)).mean()

    def capacity_keep(self, chosen: torch.Tensor) -> torch.Tensor:
        """[B, T, k] choices -> [B, T, k] bool: kept unless its expert already took its capacity of
        the sequence's tokens (earlier tokens first, then the earlier of a token's choices)."""
        bsz, tokens, k = chosen.shape
        e = self.experts_n
        capacity = math.ceil(self.cfg.moe_capacity_factor * k * tokens / e)
        group = (torch.arange(bsz, device=chosen.device)[:, None] * e + chosen.view(bsz, -1)).flatten()
        order = torch.argsort(group, stable=True)
        sizes = torch.bincount(group, minlength=bsz * e)
        starts = sizes.cumsum(0) - sizes
        place = torch.empty_like(group)
        place[order] = torch.arange(group.numel(), device=group.device) - starts[group[order]]
        return (place < capacity).view(bsz, tokens, k)

    def run_experts(self, flat: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                    keep: torch.Tensor | None, load: torch.Tensor) -> torch.Tensor:
        """Σ over each token's kept choices of weight × expert(token): rows sorted by expert, to the
        experts' ranks and back under expert parallelism. `load`: the choices per expert."""
        token = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(self.top_k)
        if keep is not None:  # by index: a mask's backward would sync with the host again
            kept = keep.nonzero().squeeze(1)
            token, expert, weight = token[kept], expert[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        token, weight = token[order], weight[order]
        counts = load if keep is None else torch.bincount(expert, minlength=self.experts_n)
        rows = flat[token]
        ep = self.experts.ep
        if ep is None:
            out = self.experts(rows, counts.tolist())  # host: the split sizes
        else:
            local_rows, local_counts, back = send_to_experts(rows, counts, ep)
            out = return_from_experts(self.experts(local_rows, local_counts), back, ep)
        out = out * weight.to(out.dtype)[:, None]
        return torch.zeros_like(flat, dtype=out.dtype).index_add(0, token, out)

    def _record(self, load: torch.Tensor, keep: torch.Tensor | None, aux: torch.Tensor) -> None:
        # Training forward calls only, once each: not again when activation checkpointing recomputes
        # it in backward, nor the pipeline's metadata pass before its first step.
        if not self.training or torch._C._current_graph_task_id() != -1 or inferring_shapes():
            return
        if self.stats is None:
            self.stats = MoEStats(self.experts_n, load.device)
        s = self.stats
        with torch.no_grad():
            s.load += load
            if keep is not None:
                s.dropped += (~keep).sum()
            s.aux += aux.detach()
        s.calls += 1


def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model (or of a pipeline stage), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
