"""The mixture-of-experts feed-forward: a router, routed SwiGLU experts, optional shared experts.

Routing: scores = softmax or sigmoid of the router's logits (fp32); each token takes the top_k
experts of scores + expert_bias (the bias only chooses: DeepSeek-V3's aux-loss-free balancing);
its weights are the chosen experts' scores, renormalized to sum 1 when moe_norm_topk, times
moe_route_scale. Dropless by default: every token reaches its experts (rows sorted by expert; on
CUDA one grouped GEMM per expert weight, `torch._grouped_mm`, its row offsets on the device: no
host sync at ep 1; on CPU one matmul per expert, the split sizes read on the host). With
moe_capacity_factor > 0, an expert takes at most ceil(factor·k·T/E) of a sequence's T tokens, the
first in sequence order; the rest are dropped (counted) and pass on the residual alone (the kept
choices are found on the host: one sync).

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
from loom.models.gpt.lean_ops import grouped_swiglu_down, swiglu, swiglu_down
from loom.models.lora import lora_delta
from loom.parallel.expert_parallel import ExpertGroup, return_from_experts, scale_grad, send_to_experts
from loom.parallel.mesh import local_view
from loom.parallel.pipeline import inferring_shapes

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # Experts' parameters: [E, hidden, d], [E, hidden, d], [E, d, hidden]
# CUDA's grouped GEMM: each expert's rows start at a multiple of 8 (the weight gradient's product
# over the rows needs 16-byte aligned bf16 group starts), so the rows are laid out padded (on a
# CPU too, where only the tests run the grouped path: it is the same path).
GROUP_ROWS = 8


def grouped_dtype(device: torch.device, dtype: torch.dtype, *widths: int) -> torch.dtype | None:
    """The dtype CUDA's grouped GEMM runs the experts in here (autocast's, or the rows'), or None
    where the per-expert loop runs: on CPU, and where the kernel does not apply (not bf16, before
    sm80, a width whose bf16 rows are not 16-byte aligned)."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return None
    run = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else dtype
    ok = run == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 8
    return run if ok and all(w % 8 == 0 for w in widths) else None


def grouped_layout(counts: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows sorted by expert, `counts` [E] per expert (a device tensor) -> (where each row goes in the
    padded layout [rows], the experts' end offsets there [E] int32, the layout's length). Each
    expert's rows start at a multiple of `align`; the length is static (rows + E·(align − 1)), so
    nothing is read on the host."""
    counts = counts.long()
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                     output_size=rows)
    first = (counts.cumsum(0) - counts)[expert]  # the expert's first row among the sorted rows
    dest = (ends - padded)[expert] + torch.arange(rows, device=counts.device) - first
    return dest, ends.int(), rows + counts.numel() * (align - 1)


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
        # The grouped GEMM's dtype, or None for the per-expert loop; by device when not set (the
        # tests set it on CPU, whose _grouped_mm is the same product in fp32).
        self.grouped: torch.dtype | None = None

    def add_lora(self, spec, weights: list[str]) -> None:
        """LoRA on each expert's `weights`: {w}_lora_A [E, r, in] and {w}_lora_B [E, out, r]."""
        self.lora, self.lora_weights = spec, tuple(weights)
        for w in weights:
            experts, out, inp = getattr(self, w).shape
            with torch.device(getattr(self, w).device):
                self.register_parameter(f"{w}_lora_A", nn.Parameter(torch.empty(experts, spec.rank, inp)))
                self.register_parameter(f"{w}_lora_B", nn.Parameter(torch.empty(experts, out, spec.rank)))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """rows [M, d] sorted by (local) expert, counts[e] of them for expert e (a device tensor,
        or a list where the sizes are on the host already) -> [M, d]."""
        grad_scale = 1.0 / self.ep.size if self.ep is not None else 1.0

        def stacked(name: str) -> torch.Tensor:
            return scale_grad(local_view(getattr(self, name)), grad_scale)

        dtype = self.grouped or grouped_dtype(rows.device, rows.dtype, self.w1.shape[-1], self.w1.shape[-2],
                                              *([self.lora.rank] if self.lora is not None else []))
        if dtype is not None:
            return self._forward_grouped(rows, counts, stacked, dtype)
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # host: the split sizes

        def local(name: str) -> tuple[torch.Tensor, ...]:
            return stacked(name).unbind(0)

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


    def _forward_grouped(self, rows: torch.Tensor, counts, stacked, dtype: torch.dtype) -> torch.Tensor:
        """The same experts as grouped GEMMs over the rows, in `dtype`, each expert's rows padded to a
        multiple of GROUP_ROWS (the padding rows are zeros; their results are never read)."""
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts, device=rows.device)
        dest, ends, length = grouped_layout(counts, rows.shape[0], GROUP_ROWS)
        x = rows.to(dtype)
        # scatter, not index_copy, whose backward keeps its source (the rows) for its shape
        x = x.new_zeros(length, x.shape[1]).scatter(0, dest[:, None].expand_as(x), x)
        spec = self.lora

        def linear(h: torch.Tensor, w: str) -> torch.Tensor:
            with torch.autocast(rows.device.type, enabled=False):
                out = torch._grouped_mm(h, stacked(w).to(dtype).transpose(-2, -1), offs=ends)
                if spec is not None and w in self.lora_weights:
                    a, b = (stacked(f"{w}_lora_{n}").to(dtype).transpose(-2, -1) for n in "AB")
                    if spec.dropout and self.training:
                        h = F.dropout(h, spec.dropout, training=True)
                    low = torch._grouped_mm(h, a, offs=ends) * spec.scale
                    out = out + torch._grouped_mm(low, b, offs=ends)
            return out

        gate, up = linear(x, "w1"), linear(x, "w3")
        if spec is not None and "w2" in self.lora_weights:
            return linear(swiglu(gate, up), "w2")[dest]
        with torch.autocast(rows.device.type, enabled=False):  # w2's input recomputed in backward
            return grouped_swiglu_down(gate, up, stacked("w2").to(dtype), ends)[dest]


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
        load = _count(chosen.flatten(), self.experts_n)  # choices per expert
        aux = self.aux_loss(scores, chosen, bsz) if self.training else None  # for the gradient and the tally
        self._record(load, keep, aux)
        if aux is not None and self.cfg.moe_aux_loss_coef and torch.is_grad_enabled():
            # on the routing weights, beside the aux loss: one compiled graph holds both even where
            # the experts' split sizes break it (CPU's loop; torch 2.11 lost the aux gradient there)
            weights = _AuxLoss.apply(weights, aux, self.aux_weight)
        routed = self.run_experts(flat, chosen.flatten(), weights.flatten(), keep, load)
        out = routed.view_as(x)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
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
        # [B, E] choices per expert (one_hot would check its classes on the host)
        chosen = chosen.view(sequences, -1)
        counts = torch.zeros(sequences, e, device=chosen.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=chosen.device))
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
        sizes = _count(group, bsz * e)
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
        counts = load if keep is None else _count(expert, self.experts_n)
        rows = flat[token]
        ep = self.experts.ep
        if ep is None:
            out = self.experts(rows, counts)
        else:
            local_rows, local_counts, back = send_to_experts(rows, counts, ep)
            out = return_from_experts(self.experts(local_rows, local_counts), back, ep)
        out = out * weight.to(out.dtype)[:, None]
        # scatter_add, not index_add: index_add's backward keeps its source (for its shape), T·k·h more
        return torch.zeros_like(flat, dtype=out.dtype).scatter_add(0, token[:, None].expand_as(out), out)

    def _record(self, load: torch.Tensor, keep: torch.Tensor | None, aux: torch.Tensor) -> None:
        # Training forward calls only, once each: not again when activation checkpointing recomputes
        # it in backward, nor the pipeline's metadata pass before its first step.
        # (Compiled, a checkpointed block recomputes inside the compiled backward, never here.)
        recomputing = not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
        if not self.training or recomputing or inferring_shapes():
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


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """[n] occurrences of each of 0..n-1 in `index` (int64): bincount's, at a static size (bincount's
    own depends on the values, which a compiled block cannot trace)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of a model (or of a pipeline stage), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
