"""Predicted step time: compute, recompute, pipeline bubble, exposed communication, optimizer,
offload.

Two ways to price compute and collectives:
- on a catalog GPU, compute runs at the family's calibrated fraction of the bf16 dense peak
  (plan/efficiency.py, fitted to published runs: docs/calibration.md), but no layer runs faster
  than its kernels can be launched (a per-kernel floor); collectives cost a latency α each plus
  their bytes at the link's calibrated efficiency;
- on a measured device (`loom plan --calibrate`: plan/device.py), each linear layer and attention
  runs at the rate measured for its shape, elementwise work (norms, RoPE, SwiGLU, residuals, the
  loss, as counted on loom's block) at the measured memory bandwidth plus a fixed cost per op,
  and every collective at its measured α + bytes/β.
Then, for both:
- recomputation repeats the forward (a third of the work) of the checkpointed blocks;
- the bubble of a pipeline is its schedule's idle time in a rank's forward (F), input-gradient (B)
  and weight-gradient (W) passes, split as the FLOPs split (bubble_time): (p−1)/(m+p−1) of the step
  for 1F1B, less for interleaved, zero-bubble (zb, zbv) and DualPipeV;
- on GPUs data-parallel collectives overlap with compute (DDP buckets, FSDP prefetch) and only the
  part longer than the compute is exposed; ZeRO-1's parameter broadcast follows the optimizer
  step, and TP and PP transfers sit on the critical path: those are exposed. Context parallelism's
  ring passes the next k/v block while the current one's attention runs: only the excess of each
  hop over that block's attention is exposed, plus a latency per hop; Ulysses' all_to_alls are
  exposed (plan/context.py), and so are expert parallelism's (plan/experts.py: the experts wait for
  their rows). On a CPU the cores that compute also move the bytes: nothing overlaps;
- a mixture of experts computes its active parameters (each token's k routed experts); its MoE
  blocks are not split by TP (each TP rank runs them whole: tp times their FLOPs on the TP group),
  and under expert parallelism the busiest rank's experts take the workload's moe_imbalance times
  the mean rows: the routed experts' time scales by it. loom runs a rank's experts one after the
  other: their kernels count toward the launch floor (KERNELS_PER_EXPERT each, per MoE block);
- the optimizer step streams params, grads and Adam's m and v (28 bytes per fp32 parameter) and
  the gradient clip reads and scales the grads (12 more) at memory bandwidth;
- offload moves gradients out and parameters in over the host link each step and runs Adam on
  the host CPUs (NVMe adds reading and writing the optimizer states), without overlap;
- LoRA (plan/lora.py) computes no frozen weight's gradient: 4 FLOPs per frozen weight and token, not
  6, plus 6 per adapter a token passes through (lora.flops_per_token), a forward being half the step's
  rather than a third; each adapted linear adds its kernels (KERNELS_PER_ADAPTER); the optimizer, the
  offload's gradients and host Adam see only what trains.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from loom.config import V_SCHEDULES
from loom.plan import context, experts, lora, muon
from loom.plan.candidate import head_recomputed
from loom.plan.comm import DDP_BUCKET, CommAccount, cp_exchange, ep_payload_per_step
from loom.plan.comm import ring as comm_ring
from loom.plan.efficiency import D0_SCALE, DEFAULT, FAMILY, compute_fraction, link_efficiency
from loom.plan.in_flight import overlapped_pairs
from loom.plan.memory import (
    heaviest_rank,
    rank_lora_params,
    rank_stages_of,
    rank_sum,
)
from loom.plan.shapes import checkpointed_layers, rank_flops_per_token, with_stage_split, worthwhile_split
from loom.plan.terms import NO_TERMS, Terms, gb, num, sec

# Elementwise traffic of one decoder block's forward + backward per token (bytes, fp32), counted
# on loom's block with a TorchDispatchMode over every non-matmul aten op (inputs + outputs):
# 93·d + 22·f + 18·kv_dim elements (tests/unit/test_plan_truth.py recounts it), in 88 ops (the lean
# block: k, v stay kv_dim wide; SwiGLU fused with w2 recomputes the product and silu twice, 6·f more,
# 1·f of them silu_backward's in-place output, counted as its input too); the loss adds about six
# passes over the fp32 logits.
BLOCK_ELEMENTWISE = (93, 22, 18)
LOSS_PASSES = 6
KERNELS_PER_LAYER = 3 * 40  # GPU kernels of a block's forward + backward (a fused-free eager run)
# An MoE block runs its rank's E/ep experts one by one (loom/models/gpt/moe.py Experts): each its two
# linears and swiglu_down, forward and backward; routing and dispatch add their own (top-k, sort,
# gathers, the all-to-alls' bookkeeping)
KERNELS_PER_EXPERT, KERNELS_PER_ROUTING = 3 * 5, 3 * 30
# The MoE feed-forward's elementwise traffic per token beyond its SwiGLUs' (fp32 elements, forward +
# backward): the rows gathered, sorted, sent back, weighted and added (k·h each), the scores (E)
MOE_ELEMENTWISE = (12, 10)
ADAM_BYTES, CLIP_BYTES = 28, 12  # per fp32 parameter: read p, g, m, v and write p, m, v; clip
# An adapted linear's kernels (LoRA): forward A·x, the scale, B·(A·x), the add; backward B's and A's
# weight gradients, the input gradients through B and A, their sum, the scale's
KERNELS_PER_ADAPTER = 10


@dataclass(frozen=True)
class StepTime:
    compute: float
    recompute: float
    bubble: float
    comm_exposed: float
    optimizer: float
    offload: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.comm_exposed + self.optimizer + self.offload

    def to_dict(self) -> dict:
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                "comm_exposed": self.comm_exposed, "optimizer": self.optimizer, "offload": self.offload,
                "total": self.total}


@dataclass(frozen=True)
class Passes:
    """FLOPs of one token's forward (F), input-gradient backward (B) and weight-gradient backward (W):
    the three passes a split-backward schedule places apart. Only their ratios matter to the bubble."""

    f: float
    b: float
    w: float

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


EQUAL_PASSES = Passes(1.0, 1.0, 1.0)  # every linear layer, nothing else: 2N FLOPs each


def passes(shape, seq_len: int, lora_spec=None) -> Passes:
    """F, B, W per token from the model's FLOPs: each linear layer (the head included) costs 2·in·out
    in each of the three; attention's score and context matmuls (4·L·H·Q·T forward) have B twice their
    forward (a gradient for each operand) and no W; the input embedding is a lookup. Under LoRA a
    frozen weight has no W: W is the adapters' weight gradients (2 each, the head's if it trains)."""
    if lora_spec is not None:
        total, forward = lora.flops_per_token(shape, lora_spec, seq_len)
        counted = lora.counted_shape(shape)
        weights = 2 * lora.active_adapters(counted, lora_spec)
        if lora_spec.train_embeddings:
            weights += 2 * counted.vocab_size * counted.d_model
        return Passes(forward, total - forward - weights, weights)
    total = shape.flops_per_token(seq_len)
    attention = 12.0 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len if shape.known else 0.0
    weights = (total - attention) / 3  # 2N
    return Passes(weights + attention / 3, weights + 2 * attention / 3, weights)


# Each schedule's bubble, in one rank's per-micro-batch F, B, W (all its stages): the formula as
# printed, and its value. p ranks, v stages per rank (round-robin); the V schedules' chunk is half a
# rank (F' = F/2, B' = B/2, W' = W/2).
BUBBLE_FORMULAS = {
    "gpipe": "(p−1)(F+B+W)",
    "1f1b": "(p−1)(F+B+W)",
    "interleaved": "(p−1)(F+B+W)/v",
    "zb": "max(0, (p−1)(F+B−W)/v)",
    "zbv": "max(0, (p−1)(F'+B'−2W'))",
    "dualpipev": "max(0, (p−1)(F&B'+B'−2W')), F&B' = F'+B'+W'",
}


def bubble_time(pp: int, virtual: int = 1, schedule: str = "1f1b", split: Passes = EQUAL_PASSES) -> float:
    """The idle time of a rank's step, in the units of `split` (one rank's F, B, W of one micro-batch).

    - gpipe, 1f1b: (p−1)(F+B+W); interleaved 1F1B: (p−1)(F+B+W)/v (Narayanan et al. 2021).
    - zb, torch's ScheduleInterleavedZeroBubble (ZB-H1 of Qi et al. 2023, round-robin over v stages
      per rank): (p−1)(F+B−W)/v: the deferred W's fill all of the bubble but F+B−W; none left when
      W ≥ F+B.
    - zbv (ZB-V, Qi et al. 2023 §6): two chunks per rank in a V, each half of the rank's layers:
      (p−1)(F'+B'−2W') with one chunk's times; zero when F = B = W.
    - dualpipev: DeepSeek's DualPipe table gives (PP/2−1)(F&B+B−3W), where its B is a *full* backward
      chunk (inputs and weights) and F&B the overlapped forward and backward of two micro-batches on a
      chunk. DualPipeV over p ranks is DualPipe over PP = 2p ranks cut in half (2p chunks, two per rank,
      each half a rank's layers), so PP/2 − 1 = p − 1; in this module's B (inputs only) the full backward
      is B'+W': (p−1)(F&B' + B' + W' − 3W') = (p−1)(F&B' + B' − 2W'). F&B' is priced F'+B'+W', with no
      overlap: overlapping two micro-batches saves no FLOPs (what it can hide is an expert all-to-all,
      which this bubble does not credit), and loom on CPU runs torch's OVERLAP_F_B one after the other.
    """
    if pp <= 1:
        return 0.0
    f, b, w = split.f, split.b, split.w
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * (f + b + w)
    if schedule == "interleaved":
        return (pp - 1) * (f + b + w) / virtual
    if schedule == "zb":
        return max(0.0, (pp - 1) * (f + b - w) / virtual)
    if schedule == "zbv":
        return max(0.0, (pp - 1) * (f + b - 2 * w) / 2)
    if schedule == "dualpipev":
        return max(0.0, (pp - 1) * ((f + b + w) + b - 2 * w) / 2)
    raise ValueError(f"pipeline schedule {schedule!r} is unknown; choose one of: "
                     f"{', '.join(BUBBLE_FORMULAS)}")


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1, schedule: str | None = None,
                    split: Passes = EQUAL_PASSES) -> float:
    """The bubble's share of a rank's step: bubble / (m·(F+B+W) + bubble) (bubble_time); for gpipe and
    1f1b (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1). No schedule: 1f1b, or interleaved when v > 1."""
    schedule = schedule or ("interleaved" if virtual > 1 else "1f1b")
    bubble = bubble_time(pp, virtual, schedule, split)
    return bubble / (microbatches * split.total + bubble) if bubble else 0.0


def pipeline_text(cfg, shape=None) -> str:
    """The layout's pipeline line (`loom train` and its --dry-run): stages per rank, the schedule, the
    F:B:W split of the model `shape` (1:1:1 unknown), its bubble formula and value."""
    from loom.config import pipeline_microbatches  # loom.config's own imports reach loom.plan

    p = cfg.parallel
    pp, microbatches, virtual, schedule = p.pp, pipeline_microbatches(p), p.pp_virtual_stages, p.pp_schedule
    split = EQUAL_PASSES if shape is None else passes(shape, cfg.data.seq_len, lora.from_config(cfg))
    stages = "2 stages per rank (V)" if schedule in V_SCHEDULES else f"{virtual} virtual"
    t = split.total
    value = bubble_fraction(pp, microbatches, virtual, schedule, split)
    text = (f"pipeline: {pp} stages × {stages}, {schedule}, {microbatches} micro-batches per step: bubble "
            f"{BUBBLE_FORMULAS[schedule]} / (m(F+B+W) + bubble) = {value:.3f} "
            f"(F:B:W = {split.f / t:.2f}:{split.b / t:.2f}:{split.w / t:.2f})")
    return text if shape is None or not shape.known else text + _blocks_text(cfg, shape)


def _blocks_text(cfg, shape) -> str:
    """"; blocks per stage 4/4/4/4; the head's rank runs 1.52× the mean rank's FLOPs, 1.02× with
    parallel.pp_stage_layers = [5, 5, 5, 1]": the stages as they run, and the balanced split where it is
    worth it (shapes.worthwhile_split) and not the one given."""
    from loom.config import stages_per_rank

    p = cfg.parallel
    total = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
    given = tuple(p.pp_stage_layers) if len(p.pp_stage_layers) == total else ()
    even = with_stage_split(shape, ())
    run = with_stage_split(shape, given)
    text = f"; blocks per stage {'/'.join(map(str, run.stage_sizes(total)))}"
    args = (cfg.data.seq_len, p.pp, p.pp_schedule, p.pp_virtual_stages)
    balanced = worthwhile_split(even, *args)
    if not balanced or balanced == given:
        return text
    now, better = _busiest_rank(run, *args)[1], _busiest_rank(with_stage_split(shape, balanced), *args)[1]
    return (f"{text}; the busiest rank runs {now:.2f}× the mean rank's FLOPs, {better:.2f}× with "
            f"parallel.pp_stage_layers = [{', '.join(map(str, balanced))}]")


def busiest_pipeline_rank(w, c) -> tuple[int, float]:
    """(the pipeline rank whose stages run the most FLOPs, those ÷ the mean rank's). A pipeline runs
    at its slowest rank's pace, and the head's stage runs more than its share: the 1b's 128,256 × 2048
    head is three and a half of its blocks at 4,096 tokens, so at pp 4 its last rank runs 1.52× the
    mean (as does rank 0 of a V, which holds both ends). Of LoRA the shares of the dense model's."""
    if c.pp == 1 or not w.shape.known:
        return 0, 1.0
    return _busiest_rank(w.shape, w.seq_len, c.pp, c.schedule, c.virtual_stages)


@functools.lru_cache(maxsize=4096)
def _busiest_rank(shape, seq_len: int, pp: int, schedule: str, virtual: int) -> tuple[int, float]:
    """busiest_pipeline_rank, remembered (the search asks for every candidate)."""
    per_rank = rank_flops_per_token(shape, seq_len, pp, schedule, virtual)
    top = max(range(pp), key=lambda r: (per_rank[r], -r))
    return top, pp * per_rank[top] / sum(per_rank)


def micro_steps(c) -> int:
    """Forward + backward passes a rank runs per optimizer step (a pipeline stage runs all m)."""
    return c.grad_accum


def local_params(w, c) -> float:
    """Parameters a rank steps the optimizer over: its stages', split by TP and the shard; of an MoE
    model's MoE blocks the feed-forward whole over TP and the routed experts split over ep, sharded
    over N_e (the heaviest rank's). Under LoRA only what trains."""
    shape = w.shape
    heaviest = heaviest_rank(shape, c)
    if w.lora is not None:
        rest, routed = rank_lora_params(w, c, heaviest)
        return rest.trainable / c.shard_size + routed.trainable / c.expert_shard_size
    params = rank_sum(c, heaviest, shape.stage_params)
    if not shape.moe:
        return params / c.tp / c.shard_size
    ffn = rank_sum(c, heaviest, shape.stage_moe_layers) * shape.moe_ffn_params()
    routed = rank_sum(c, heaviest, shape.stage_routed_params)
    rest = params - ffn
    return rest / c.tp / c.shard_size + (ffn - routed) / c.shard_size + routed / c.ep / c.expert_shard_size


def step_time(w, c, cluster, comm: CommAccount, groups: dict[str, float],
              terms: Terms = NO_TERMS) -> StepTime:
    if cluster.profile is not None:
        return measured_step_time(w, c, cluster, comm, terms)
    return catalog_step_time(w, c, cluster, comm, groups, terms)


def flops_per_token(w, terms: Terms = NO_TERMS) -> float:
    """ModelShape.flops_per_token at the workload's sequence length (under LoRA lora.flops_per_token),
    recorded with its parts."""
    shape, t = w.shape, w.seq_len
    if w.lora is not None:
        return _lora_flops_per_token(w, terms)
    per_token = shape.flops_per_token(t)
    if shape.known:
        matmul = shape.active_params - (0 if shape.tie_embeddings else shape.embedding_params)
        what = "N = Ψ" + ("" if shape.tie_embeddings else " − V·h (the input embedding is a lookup)")
        if shape.moe:
            what = "N = Ψ_active" + ("" if shape.tie_embeddings else " − V·h")
            if terms:
                terms.item("Ψ_active", "Ψ − L_m·(E − k)·3h·h_e (each token's k routed experts of E)",
                           f"{num(shape.num_params)} − {shape.moe_layers}·({shape.moe_experts} − "
                           f"{shape.moe_top_k})·3·{shape.d_model}·{shape.moe_hidden}",
                           num(shape.active_params))
        if terms:
            terms.item("N matmul weights", what, None, num(matmul))
            terms.item("FLOPs per token", "6N + 12·L·H·Q·T",
                       f"6·{num(matmul)} + 12·{shape.n_layers}·{shape.n_heads}·{shape.head_dim}·{t}",
                       num(per_token))
    elif terms:
        terms.item("FLOPs per token", "6N (attention unknown)", f"6·{num(shape.params_only)}",
                   num(per_token))
    return per_token


def _lora_flops_per_token(w, terms: Terms = NO_TERMS) -> float:
    """lora.flops_per_token, recorded: no frozen weight's gradient, the adapters' 6 FLOPs each."""
    shape, t = w.shape, w.seq_len
    per_token, _ = lora.flops_per_token(shape, w.lora, t)
    if terms:
        active = lora.active_adapters(lora.counted_shape(shape), w.lora)
        matmul = shape.active_params - (0 if shape.tie_embeddings else shape.embedding_params) \
            if shape.known else shape.num_params
        terms.item("N matmul weights", "Ψ" + ("_active" if shape.moe else "")
                   + ("" if shape.tie_embeddings or not shape.known else " − V·h"), None, num(matmul))
        where = " (of the routed experts' its k)" if shape.moe else "" if shape.known else \
            " (on its Llama-style stand-in)"
        terms.item("A adapters per token", f"the adapters a token passes through{where}", None, num(active))
        head = " + 2·V·h (the trained head's gradient)" if w.lora.train_embeddings else ""
        attention = f"12·{shape.n_layers}·{shape.n_heads}·{shape.head_dim}·{t}" if shape.known else "0"
        terms.item("FLOPs per token", f"4N + 12·L·H·Q·T + 6A{head} (LoRA: no frozen weight's gradient)",
                   f"4·{num(matmul)} + {attention} + 6·{num(active)}" + (" + …" if head else ""),
                   num(per_token))
    return per_token


def forward_share(w) -> float:
    """The forward's share of a step's compute: a third; under LoRA about half (lora.flops_per_token)."""
    if w.lora is None:
        return 1 / 3
    total, forward = lora.flops_per_token(w.shape, w.lora, w.seq_len)
    return forward / total


def _adapter_kernels(w, c) -> tuple[int, int]:
    """(kernels LoRA adds to a dense block, to an MoE block on a rank): KERNELS_PER_ADAPTER per adapted
    linear, a rank's E/ep experts' each."""
    if w.lora is None:
        return 0, 0
    shape = w.shape
    dense = KERNELS_PER_ADAPTER * lora.adapted_linears(shape, w.lora, False)
    if not shape.moe:
        return dense, 0
    experts_each = len(w.lora.expert_targets)
    moe = lora.adapted_linears(shape, w.lora, True) - experts_each + shape.moe_experts // c.ep * experts_each
    return dense, KERNELS_PER_ADAPTER * moe


def catalog_step_time(w, c, cluster, comm: CommAccount, groups: dict[str, float],
                      terms: Terms = NO_TERMS) -> StepTime:
    gpu = cluster.gpu
    per_token = flops_per_token(w, terms)
    flops = w.tokens_per_step * per_token / c.world
    if terms:
        terms.item("FLOPs per GPU", "tokens per step × FLOPs per token / GPUs",
                   f"{num(w.tokens_per_step)} × {num(per_token)} / {c.world}", num(flops))
    top, imbalance = busiest_pipeline_rank(w, c)
    if imbalance != 1.0:  # the pipeline runs at its busiest rank's pace
        flops *= imbalance
        if terms:
            terms.item("busiest pipeline rank", "p × its stages' share of the FLOPs per token (blocks "
                       "6·P + 12·H·Q·T each, the last stage's head 6·V·h)", f"rank {top}: {c.pp} × "
                       f"{num(imbalance / c.pp)}", num(imbalance))
            terms.item("FLOPs on it", "FLOPs per GPU × that", None, num(flops))
    flops += moe_extra_flops(w, c, terms)
    if cluster.achievable_fraction:
        fraction = cluster.achievable_fraction
        if terms:
            terms.item("compute fraction", "--hw achievable_fraction", None, num(fraction))
    else:
        fraction = compute_fraction(gpu, w.shape, c.tp)
        if w.shape.known:
            d0, d = D0_SCALE * gpu.bf16_tflops / gpu.hbm_tbps, w.shape.d_model
            if terms:
                terms.item("d0", "D0_SCALE × TFLOP/s ÷ TB/s",
                           f"{D0_SCALE} × {num(gpu.bf16_tflops)} ÷ {num(gpu.hbm_tbps)}", num(d0))
                terms.item("compute fraction", "frac_max · h/(h + d0) (plan/efficiency.py, fitted)",
                           f"{FAMILY.get(gpu.name, DEFAULT)[0]} × {d}/({d} + {num(d0)})", num(fraction))
        elif terms:
            terms.item("compute fraction", "frac_max (the family's large-model fraction)", None,
                       num(fraction))
    compute = flops / (gpu.bf16_tflops * 1e12 * fraction)
    if terms:
        terms.item("compute", "FLOPs / (peak × fraction)",
                   f"{num(flops)} / ({num(gpu.bf16_tflops)}e12 × {num(fraction)})", sec(compute))
    dense_adapters, moe_adapters = _adapter_kernels(w, c)  # LoRA's, per block
    if w.shape.known and w.shape.moe:  # and a rank's experts run one after the other
        layers = math.ceil(w.shape.n_layers / c.pp)
        moe = max(w.shape.stage_moe_layers(s, c.pp) for s in range(c.pp))
        local = w.shape.moe_experts // c.ep
        kernels = layers * KERNELS_PER_LAYER + moe * (KERNELS_PER_ROUTING + local * KERNELS_PER_EXPERT)
        adapters = (layers - moe) * dense_adapters + moe * moe_adapters
        kernels += adapters
        floor = micro_steps(c) * kernels * gpu.kernel_launch_s
        if terms:
            lora_sym, lora_num = ((" + LoRA's 10 per adapted linear", f" + {adapters}") if adapters
                                  else ("", ""))
            terms.item("kernel-launch floor", "micro-steps × (⌈L/p⌉ × kernels per block + L_m × (routing + "
                       f"E/ep × kernels per expert){lora_sym}) × launch",
                       f"{micro_steps(c)} × ({layers} × {KERNELS_PER_LAYER} + {moe} × ({KERNELS_PER_ROUTING} "
                       f"+ {local} × {KERNELS_PER_EXPERT}){lora_num}"
                       + f") × {num(gpu.kernel_launch_s)} s", sec(floor))
        if floor > compute and terms:
            terms.note(f"  compute = the floor, {sec(floor)} (the launches take longer than the FLOPs)")
        compute = max(compute, floor)
    elif w.shape.known:  # no layer runs faster than its kernels launch
        layers = math.ceil(w.shape.n_layers / c.pp)
        per_block = KERNELS_PER_LAYER + dense_adapters  # LoRA: KERNELS_PER_ADAPTER per adapted linear
        floor = micro_steps(c) * layers * per_block * gpu.kernel_launch_s
        if terms:
            terms.item("kernel-launch floor", "micro-steps × ⌈L/p⌉ × kernels per block × launch"
                       + (" (LoRA: + 10 per adapted linear)" if dense_adapters else ""),
                       f"{micro_steps(c)} × {layers} × {per_block} × {num(gpu.kernel_launch_s)} s",
                       sec(floor))
        if floor > compute and terms:
            terms.note(f"  compute = the floor, {sec(floor)} (the launches take longer than the FLOPs)")
        compute = max(compute, floor)
    recompute = _recompute(w, c, compute, gpu, terms)
    recompute += _head_recompute(w, c, gpu.bf16_tflops * 1e12 * fraction, terms)
    busy = compute + recompute
    bubble = _bubble(w, c, busy, terms, imbalance)
    efficiency = cluster.comm_efficiency or link_efficiency(gpu)
    if terms:
        terms.note(f"exposed communication: bytes / (link × efficiency {num(efficiency)}) + α × count "
                   f"(α {num(gpu.intra_node_latency_s)} s intra-node, {num(gpu.inter_node_latency_s)} s "
                   f"inter-node)")

    def seconds(what: str, sent: float, inter: bool, group: str) -> float:
        link = gpu.inter_node_gbps if inter else gpu.intra_node_gbps
        latency = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
        count = comm.count_by_group.get(group, 0) if group != "broadcast" else 0
        t = sent / (link * 1e9 * efficiency) + latency * count
        if (sent or count) and terms:
            terms.item(what, "Φ_sent/(link × eff) + α × count",
                       f"{gb(sent)}/({num(link)} GB/s × {num(efficiency)}) + {num(latency)} × {count}",
                       sec(t))
        return t

    # Each group's bytes on its link; a ZeRO-1 broadcast and TP/PP transfers are exposed.
    dp_inter = c.grad_sync_size * c.tp > cluster.gpus_per_node
    shard_inter = c.shard_size * c.tp > cluster.gpus_per_node
    broadcast = comm.by_kind.get("broadcast", 0.0) if w.recipe == "torch" else 0.0
    dp_bytes = groups["dp"] - broadcast
    dp_link = shard_inter if c.strategy_info.shards_params else dp_inter
    hidden_dp = seconds("data parallel", dp_bytes, dp_link, "dp")
    parts = [("dp", max(0.0, hidden_dp - busy))]
    if terms:
        terms.item("dp exposed", "max(0, dp − (compute + recompute)) (overlapped)",
                   f"max(0, {sec(hidden_dp)} − {sec(busy)})", sec(parts[0][1]))
    if broadcast:
        parts.append(("broadcast", seconds("ZeRO-1 broadcast", broadcast, dp_inter, "broadcast")))
    if groups["tp"] or comm.count_by_group.get("tp"):
        parts.append(("tp", seconds("tensor parallel", groups["tp"], False, "tp")))
    pp_inter = c.world > cluster.gpus_per_node and c.grad_sync_size * c.tp >= cluster.gpus_per_node
    if groups["pp"] or comm.count_by_group.get("pp"):
        parts.append(("pp", seconds("pipeline", groups["pp"], pp_inter, "pp")))
    if c.cp > 1 and w.shape.known:
        inter = c.cp * c.tp > cluster.gpus_per_node
        link = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * efficiency
        alpha = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
        block = context.block_attention_flops(w.shape, c.local_seq(w.seq_len), c.micro_batch, c.tp)
        block_s = block / (gpu.bf16_tflops * 1e12 * fraction)
        if terms:
            terms.item("cp block attention",
                       "4·(a/tp)·Q·(s/cp)·b·(s/cp) / (peak × fraction) (one hop's forward)",
                       f"{num(block)} / ({num(gpu.bf16_tflops)}e12 × {num(fraction)})", sec(block_s))
        parts.append(("cp", _cp_seconds(w, c, link, alpha, block_s, True, terms, wire=True)))
    if c.ep > 1 and w.shape.moe:  # the experts wait for their rows: exposed (but under DualPipeV's overlap)
        inter = experts.inter_node(c, cluster.gpus_per_node)
        alone = seconds("expert parallel", groups["ep"], inter, "ep")
        parts.append(("ep", _ep_exposed(c, alone, busy, terms)))
    exposed = sum(v for _, v in parts)
    if terms:
        terms.item("comm exposed", " + ".join(n for n, _ in parts), " + ".join(sec(v) for _, v in parts),
                   sec(exposed))
    optimizer = 0.0
    if c.offload == "none":
        local = local_params(w, c)
        optimizer = (ADAM_BYTES + CLIP_BYTES) * local / (gpu.hbm_tbps * 1e12)
        if terms:
            terms.item("Ψ stepped per rank", "Ψ_stage/tp/N" if w.lora is None else
                       "Ψ_lora/N (what trains, a rank's after TP)", None, num(local))
            terms.item("optimizer", "(28 Adam + 12 clip bytes)·Ψ/HBM",
                       f"40 × {num(local)} / {num(gpu.hbm_tbps)} TB/s", sec(optimizer))
    if w.muon is not None and w.shape.known:
        cost = muon.workload_cost(w, c)
        ns = cost.flops / (gpu.bf16_tflops * 1e12 * fraction)
        optimizer += ns
        if terms:
            terms.item("muon Newton-Schulz", "a rank's ns_steps·(4m²n + 2m³) FLOPs / (peak × fraction)",
                       f"{num(cost.flops)} / ({num(gpu.bf16_tflops)}e12 × {num(fraction)})", sec(ns))
        for ex in cost.exchanges:  # exposed: the optimizer waits for them
            inter = ex.group > cluster.gpus_per_node
            link = gpu.inter_node_gbps if inter else gpu.intra_node_gbps
            alpha = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
            sent = comm_ring(ex.kind, ex.group, ex.payload)
            t = sent / (link * 1e9 * efficiency) + alpha * ex.count
            optimizer += t
            if terms:
                terms.item(f"muon {ex.kind}", "Φ_sent/(link × eff) + α × count (exposed)",
                           f"{gb(sent)}/({num(link)} GB/s × {num(efficiency)}) + {num(alpha)} × {ex.count}",
                           sec(t))
    return StepTime(compute, recompute, bubble, exposed, optimizer, _offload(w, c, cluster, terms))


def moe_extra_flops(w, c, terms: Terms = NO_TERMS) -> float:
    """FLOPs a GPU runs beyond its share of the model's (tokens × FLOPs per token / GPUs): the MoE
    feed-forwards run whole on each of the tp ranks, and the busiest rank's experts take the
    imbalance times the mean rows: tokens/GPUs × ((tp − 1)·F_moe + tp·(imbalance − 1)·F_routed)."""
    shape = w.shape
    if not shape.moe:
        return 0.0
    imbalance = experts.imbalance(w, c)
    moe, routed = shape.moe_ffn_flops_per_token(), shape.routed_flops_per_token()
    extra = w.tokens_per_step / c.world * ((c.tp - 1) * moe + c.tp * (imbalance - 1) * routed)
    lora_words = ""
    if w.lora is not None:  # no frozen weight's gradient: 4 FLOPs per weight, not 6 (adapters left out)
        extra, lora_words = extra * 4 / 6, " × 4/6 (LoRA)"
    if extra and terms:
        terms.item("MoE beyond the share", "tokens/GPUs × ((tp − 1)·F_moe + tp·(imbalance − 1)·F_routed) "
                   f"(the MoE whole on each TP rank; the busiest rank's experts){lora_words}",
                   f"{num(w.tokens_per_step)}/{c.world} × (({c.tp} − 1)·{num(moe)} + "
                   f"{c.tp}·({imbalance:g} − 1)·{num(routed)}){lora_words}", num(extra))
    return extra


def measured_step_time(w, c, cluster, comm: CommAccount, terms: Terms = NO_TERMS) -> StepTime:
    """Compute and collectives at the rates `loom plan --calibrate` measured on this device."""
    profile, ranks, shape = cluster.profile, cluster.gpus_per_node, w.shape
    tokens = c.local_seq(w.seq_len) * c.micro_batch
    bandwidth = profile.elementwise_bytes(ranks, tokens * max(shape.d_model, 1) * 4)
    overhead = profile.op_overhead(ranks)
    if terms:
        terms.item("memory bandwidth", "measured elementwise rate at a tensor of s·b·h·4 bytes", None,
                   f"{num(bandwidth / 1e9)} GB/s")
        terms.item("op overhead", "measured fixed cost per op", None, sec(overhead))
    if shape.known:
        d, tp = shape.d_model, c.tp
        if terms:
            terms.note(f"one block, one micro-batch of s·b = {tokens} tokens: each linear "
                       f"6·tokens·in·out / its measured rate")
        layer = block_seconds(profile, ranks, shape, w.seq_len, tokens, tp, terms, w.lora)
        if terms:
            terms.item("block", "linears + attention + elementwise", None, sec(layer))
        in_situ = profile.block_in_situ(ranks, tokens * d * 4)
        if in_situ != 1.0 and terms:
            terms.item("block as run",
                       "block × in-situ factor (two blocks run whole ÷ their parts, measured)",
                       f"{sec(layer)} × {num(in_situ)}", sec(layer * in_situ))
        moe_layer = 0.0
        if shape.moe:  # an MoE block: its feed-forward in place of the dense SwiGLU
            imbalance = experts.imbalance(w, c)
            dense_ffn = ffn_seconds(profile, ranks, shape, tokens, tp, terms, w.lora)
            moe_ffn = moe_ffn_seconds(profile, ranks, shape, tokens, c.ep, imbalance, terms, w.lora)
            moe_layer = (layer - dense_ffn + moe_ffn) * in_situ
            if terms:
                terms.item("MoE block as run", "(block − dense SwiGLU + MoE feed-forward) × in-situ factor",
                           f"({sec(layer)} − {sec(dense_ffn)} + {sec(moe_ffn)}) × {num(in_situ)}",
                           sec(moe_layer))
        layer *= in_situ
        vocab = shape.vocab_size / tp
        head_rate = profile.linear_flops(ranks, tokens, d, vocab)
        trains = w.lora is None or w.lora.train_embeddings  # LoRA: a frozen head has no weight gradient
        passes = 6 if trains else 4
        head = passes * tokens * d * vocab / head_rate
        head += LOSS_PASSES * 4 * tokens * vocab / bandwidth
        if terms:
            terms.item("head + loss",
                       f"{passes}·tokens·h·V/tp / rate + {LOSS_PASSES}·4·tokens·V/tp / bandwidth",
                       f"{passes}·{tokens}·{d}·{num(vocab)} / {num(head_rate / 1e12)} TFLOP/s + "
                       f"{LOSS_PASSES}·4·{tokens}·{num(vocab)} / {num(bandwidth / 1e9)} GB/s", sec(head))
        embedding = 2 * 4 * shape.vocab_size * d / tp / bandwidth  # backward: a dense [V, d] gradient
        if not trains:
            embedding = 0.0  # LoRA: the frozen embedding has none
        elif terms:
            terms.item("embedding backward", "2·4·V·h/tp / bandwidth (a dense [V, h] gradient)",
                       f"8·{shape.vocab_size}·{d}/{tp} / {num(bandwidth / 1e9)} GB/s", sec(embedding))

        def stage_seconds(stage: int, stages: int) -> float:
            """A micro-batch through one stage: its blocks, the embedding's backward on the first, the
            head and the loss on the last."""
            start, count = shape.stage_layers(stage, stages)
            moe = shape.moe_layers_in(start, count)
            ends = (head if stage == stages - 1 else 0.0) + (embedding if stage == 0 else 0.0)
            return (count - moe) * layer + moe * moe_layer + ends

        # the pipeline runs at its busiest rank's pace: the head's, or a V's rank 0 holding both ends
        per_rank = [rank_sum(c, r, stage_seconds, 0.0) for r in range(c.pp)]
        top = max(range(c.pp), key=lambda r: (per_rank[r], -r))
        heaviest = per_rank[top]
        imbalance = heaviest * c.pp / sum(per_rank)
        stages, total = rank_stages_of(c, top)
        ckpt_layers = ckpt_moe = 0  # the blocks and MoE blocks recomputed: the busiest rank's
        for stage in stages:
            start, count = shape.stage_layers(stage, total)
            ckpt_layers += count
            ckpt_moe += experts.checkpointed_moe_layers(shape, start, count, c.activation_checkpointing,
                                                        c.ac_every)
        if terms:
            moe = rank_sum(c, top, shape.stage_moe_layers)
            what = (f"rank {top}, its stages {', '.join(map(str, stages))} of {total}: " if c.pp > 1 else "")
            ends = " + the embedding" * (stages[0] == 0) + " + head" * (stages[-1] == total - 1)
            terms.item("busiest rank's micro-step" if c.pp > 1 else "one micro-step",
                       "Σ its stages' (L_s − L_m)·block + L_m·MoE block, the embedding's backward and the "
                       "head + loss where held",
                       f"{what}({ckpt_layers} − {moe})·{sec(layer)} + {moe}·{sec(moe_layer)}{ends}",
                       sec(heaviest))
        compute = micro_steps(c) * heaviest
        if terms:
            terms.item("compute", "micro-steps × that", f"{micro_steps(c)} × {sec(heaviest)}", sec(compute))
        ckpt = checkpointed_layers(ckpt_layers, c.activation_checkpointing, c.ac_every)
        recompute = micro_steps(c) * ckpt * layer / 3
        if w.lora is not None:  # a forward is about half of a LoRA block
            recompute = micro_steps(c) * ckpt * layer * forward_share(w)
        if ckpt_moe and c.activation_checkpointing != "op":
            recompute = micro_steps(c) * ((ckpt - ckpt_moe) * layer + ckpt_moe * moe_layer) / 3
            if terms:
                terms.item("recompute", "micro-steps × (checkpointed dense blocks × block + MoE ones × MoE "
                           "block)/3", f"{micro_steps(c)} × ({ckpt - ckpt_moe} × {sec(layer)} + {ckpt_moe} × "
                           f"{sec(moe_layer)})/3", sec(recompute))
        if recompute and c.activation_checkpointing == "op":  # the matmuls and attention are kept, not rerun
            elementwise = block_elementwise_seconds(profile, ranks, shape, tokens, tp)
            recompute = micro_steps(c) * ckpt * elementwise * in_situ / 3
            if terms:
                terms.item("recompute", "micro-steps × checkpointed blocks × elementwise × in-situ/3",
                           f"{micro_steps(c)} × {ckpt} × {sec(elementwise)} × "
                           f"{num(in_situ)}/3", sec(recompute))
        elif recompute and terms and not ckpt_moe:
            terms.item("recompute", "micro-steps × checkpointed blocks × block/3",
                       f"{micro_steps(c)} × {ckpt} × {sec(layer)}/3", sec(recompute))
        recompute += _head_recompute(w, c, head_rate, terms)
    else:
        per_token = flops_per_token(w, terms)
        peak = profile.peak_flops(ranks)
        compute = w.tokens_per_step * per_token / c.world / peak
        if terms:
            terms.item("compute", "tokens × FLOPs per token / GPUs / best measured rate",
                       f"{num(w.tokens_per_step)} × {num(per_token)} / {c.world} / "
                       f"{num(peak / 1e12)} TFLOP/s", sec(compute))
        recompute, imbalance = 0.0, 1.0
    busy = compute + recompute
    bubble = _bubble(w, c, busy, terms, imbalance)
    # Collectives at their measured cost, and the copies in and out of their buffers.
    if terms:
        terms.note("collectives at their measured α·count + payload/β, plus copying the payload in and out "
                   "(2·payload at the bandwidth measured for one collective's size); nothing overlaps")
    exposed = 0.0
    # Muon's exchange is priced with its optimizer step (_measured_muon_seconds), not here
    own = ({} if w.muon is None or not shape.known
           else {ex.kind: ex for ex in muon.workload_cost(w, c).exchanges})
    for kind, payload in comm.payload_by_kind.items():
        if kind in context.OBSERVED or kind == experts.KIND:  # the context- and expert-parallel ones, below
            continue
        kind = "send" if kind == "recv" else kind
        count = _count(comm, kind, payload)
        if kind in own:
            payload, count = payload - own[kind].payload, count - own[kind].count
            if payload <= 0:
                continue
        copy_bw = profile.elementwise_bytes(ranks, payload / max(count, 1))
        t = profile.collective_seconds(ranks, kind, payload, count) + 2 * payload / copy_bw  # staging copies
        fits = profile.ranks_entry(ranks)["collectives"]
        fit = fits.get(kind) or fits.get("all_gather" if kind == "broadcast" else "all_reduce")
        numbers = (f"{num(fit['alpha_s'])} s × {count} + {gb(payload)} / {num(fit['bytes_per_s'] / 1e9)} "
                   f"GB/s + 2 × {gb(payload)} / {num(copy_bw / 1e9)} GB/s") if fit else None
        if terms:
            terms.item(kind, "α·count + payload/β + 2·payload/bandwidth", numbers, sec(t))
        exposed += t
    if c.cp > 1 and shape.known:
        fits = profile.ranks_entry(ranks)["collectives"]
        fit = fits.get(context.OBSERVED[context.KINDS[c.cp_mode]]) or fits.get("all_reduce")
        if fit is not None:
            rate = profile.attention_flops(ranks, w.seq_len, shape.head_dim)
            block_s = context.block_attention_flops(shape, c.local_seq(w.seq_len), c.micro_batch, c.tp) / rate
            exposed += _cp_seconds(w, c, fit["bytes_per_s"], fit["alpha_s"], block_s, profile.device != "cpu",
                                   terms, wire=False)
    if c.ep > 1 and shape.moe:  # the experts wait for their rows: exposed (but under DualPipeV's overlap)
        fits = profile.ranks_entry(ranks)["collectives"]
        fit = fits.get(experts.OBSERVED) or fits.get("all_reduce")
        if fit is not None:
            payload, ops = ep_payload_per_step(w, c)
            t = ops * fit["alpha_s"] + payload / fit["bytes_per_s"]
            if terms:
                terms.item("expert parallel", "α·all_to_alls + payload/β",
                           f"{num(fit['alpha_s'])} s × {ops} + {gb(payload)} / "
                           f"{num(fit['bytes_per_s'] / 1e9)} GB/s", sec(t))
            exposed += _ep_exposed(c, t, busy, terms)
    if c.world > 1:  # the loop's few-byte all-reduces: mean loss and gradient norm
        t = profile.collective_seconds(ranks, "all_reduce", 8, 2)
        if terms:
            terms.item("loop all-reduces", "2·α + 8 bytes/β (mean loss, grad norm)", None, sec(t))
        exposed += t
    # gradients into DDP's buckets and back (under ep, ddp replicates through FSDP2: no buckets)
    if not c.strategy_info.shards_params and c.dp > 1 and c.ep == 1:
        grads = 4 * local_params(w, c) * c.shard_size
        copy_bw = profile.elementwise_bytes(ranks, min(grads, DDP_BUCKET))
        t = 4 * grads / copy_bw
        if terms:
            terms.item("bucket copies",
                       "4·(4Ψ)/bandwidth (gradients into DDP's buckets and back, read + write)",
                       f"4 × {gb(grads)} / {num(copy_bw / 1e9)} GB/s", sec(t))
        exposed += t
    if terms:
        terms.item("comm exposed", "sum of the above", None, sec(exposed))
    local = local_params(w, c)
    optimizer = profile.optimizer_seconds(ranks, local)
    if optimizer is None:  # a profile from before the optimizer was measured: its bytes and ops
        big = profile.elementwise_bytes(ranks, 4 * local)
        ops = 2 * (shape.n_layers if shape.known else 1) * 9 // max(c.pp, 1)
        optimizer = (ADAM_BYTES + CLIP_BYTES) * local / big + 2 * overhead * ops
        if terms:
            terms.item("optimizer", "40·Ψ/bandwidth + 2·overhead·(2·L·9/p) (per-tensor ops)",
                       f"40 × {num(local)} / {num(big / 1e9)} GB/s + 2 × {sec(overhead)} × {ops}",
                       sec(optimizer))
    elif terms:
        terms.item("optimizer", "Ψ_local × measured clipping + AdamW seconds per parameter",
                   f"{num(local)} × {num(optimizer / local)} s", sec(optimizer))
    if w.muon is not None and shape.known:
        optimizer += _measured_muon_seconds(w, c, profile, ranks, terms)
    return StepTime(compute, recompute, bubble, exposed, optimizer, _offload(w, c, cluster, terms))


def _measured_muon_seconds(w, c, profile, ranks: int, terms: Terms) -> float:
    """Muon on a calibrated device: its Newton-Schulz FLOPs at the best measured matmul rate, its
    exchange at the measured collective's α and β (exposed: the optimizer waits for it)."""
    cost = muon.workload_cost(w, c)
    peak = profile.peak_flops(ranks)
    ns = cost.flops / peak
    moved = 0.0
    if terms:
        terms.item("muon Newton-Schulz", "a rank's ns_steps·(4m²n + 2m³) FLOPs / best measured rate",
                   f"{num(cost.flops)} / {num(peak / 1e12)} TFLOP/s", sec(ns))
    for ex in cost.exchanges:
        t = profile.collective_seconds(ranks, ex.kind, ex.payload, ex.count)
        moved += t
        if terms:
            terms.item(f"muon {ex.kind}", "α·count + payload/β (exposed: the optimizer waits for them)",
                       f"{ex.count} × over {ex.group} ranks, {gb(ex.payload)}", sec(t))
    return ns + moved


LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


def ffn_seconds(profile, ranks: int, shape, tokens: int, tp: int, terms: Terms = NO_TERMS,
                spec=None) -> float:
    """block_seconds' dense SwiGLU: gate, up and down at their measured rates and its elementwise share
    (BLOCK_ELEMENTWISE's f term): what an MoE block runs moe_ffn_seconds in place of (`spec`: LoRA's,
    no weight gradient; its adapters in block_seconds)."""
    d, f = shape.d_model, shape.ffn_hidden
    passes = 6 if spec is None else 4
    t = 0.0
    for k, n in ((d, f / tp), (d, f / tp), (f / tp, d)):
        t += passes * tokens * k * n / profile.linear_flops(ranks, tokens, k, n)
    bandwidth = profile.block_elementwise_bytes(ranks, tokens * d * 4)
    t += 4 * tokens * BLOCK_ELEMENTWISE[1] * f / tp / bandwidth
    if terms:
        terms.item("dense SwiGLU", f"gate, up, down linears + 4·tokens·{BLOCK_ELEMENTWISE[1]}f/tp / block "
                   "bandwidth", None, sec(t))
    return t


def moe_ffn_seconds(profile, ranks: int, shape, tokens: int, ep: int, imbalance: float,
                    terms: Terms = NO_TERMS, spec=None) -> float:
    """An MoE feed-forward's forward + backward on a rank's `tokens` (whole over TP) at the measured
    rates: the router [h → E], the shared SwiGLU, and the rank's E/ep experts one after the other, each
    taking r = imbalance·tokens·k·ep/E rows (three linears h → h_e, h → h_e, h_e → h); the elementwise
    work: the SwiGLUs' (BLOCK_ELEMENTWISE's f term over imbalance·k·h_e + h_s) and the routing's
    (MOE_ELEMENTWISE: k·h rows moved, E scores). `spec` (LoRA): the linears without their weight
    gradients, 4/6 of their time (the experts' adapters left out)."""
    d, e, he, sh = shape.d_model, shape.moe_experts, shape.moe_hidden, shape.moe_shared_hidden
    router = 6 * tokens * d * e / profile.linear_flops(ranks, tokens, d, e)
    shared = 0.0
    if sh:
        shared = 2 * 6 * tokens * d * sh / profile.linear_flops(ranks, tokens, d, sh) \
            + 6 * tokens * sh * d / profile.linear_flops(ranks, tokens, sh, d)
    rows = imbalance * tokens * shape.moe_top_k * ep / e
    per_expert = 2 * 6 * rows * d * he / profile.linear_flops(ranks, rows, d, he) \
        + 6 * rows * he * d / profile.linear_flops(ranks, rows, he, d)
    routed = e // ep * per_expert
    bandwidth = profile.block_elementwise_bytes(ranks, tokens * d * 4)
    moved, scores = MOE_ELEMENTWISE
    elementwise = 4 * tokens * (BLOCK_ELEMENTWISE[1] * (imbalance * shape.moe_top_k * he + sh)
                                + moved * shape.moe_top_k * d + scores * e) / bandwidth
    if spec is not None:  # no frozen weight's gradient
        router, shared, routed = router * 4 / 6, shared * 4 / 6, routed * 4 / 6
    total = router + shared + routed + elementwise
    if terms:
        terms.item("MoE router + shared", "6·tokens·h·E / rate + the shared SwiGLU's linears", None,
                   sec(router + shared))
        terms.item("MoE experts", "E/ep × 3 linears of r = imbalance·tokens·k·ep/E rows",
                   f"{e // ep} × {sec(per_expert)} (r = {num(rows)})", sec(routed))
        terms.item("MoE elementwise", f"4·tokens·({BLOCK_ELEMENTWISE[1]}·(imbalance·k·h_e + h_s) + "
                   f"{moved}·k·h + {scores}·E) / block bandwidth", None, sec(elementwise))
    return total


def block_seconds(profile, ranks: int, shape, seq: int, tokens: int, tp: int,
                  terms: Terms = NO_TERMS, spec=None) -> float:
    """One decoder block's forward + backward over `tokens` tokens at the rates `profile` measured
    for its parts alone: the linears, attention and the elementwise work. How much slower the block
    runs as a whole is the profile's block_in_situ factor, applied by the caller. `spec` (LoRA): the
    linears without their weight gradients (4 FLOPs per weight, not 6), and the adapters."""
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    linears = [(d, d / tp), (d, kv / tp), (d, kv / tp), (d / tp, d),  # q, k, v, o
               (d, f / tp), (d, f / tp), (f / tp, d)]  # gate, up, down
    passes = 6 if spec is None else 4
    layer = 0.0
    for name, (k, n) in zip(LINEARS, linears):
        rate = profile.linear_flops(ranks, tokens, k, n)
        t = passes * tokens * k * n / rate
        if terms:
            terms.item(f"linear {name}", f"{passes}·tokens·in·out / rate",
                       f"{passes}·{tokens}·{num(k)}·{num(n)} / {num(rate / 1e12)} TFLOP/s", sec(t))
        layer += t
    if spec is not None:
        layer += adapter_seconds(profile, ranks, shape, spec, tokens, tp, terms)
    attention = 12 * (shape.n_heads / tp) * shape.head_dim * seq * tokens
    rate = profile.attention_flops(ranks, seq, shape.head_dim)
    if terms:
        terms.item("attention", "12·(H/tp)·Q·T·tokens / rate",
                   f"12·{num(shape.n_heads / tp)}·{shape.head_dim}·{seq}·{tokens} / "
                   f"{num(rate / 1e12)} TFLOP/s", sec(attention / rate))
    layer += attention / rate
    return layer + block_elementwise_seconds(profile, ranks, shape, tokens, tp, terms)


def adapter_seconds(profile, ranks: int, shape, spec, tokens: int, tp: int, terms: Terms = NO_TERMS) -> float:
    """A block's LoRA adapters, forward + backward: each adapted linear's A [r, in] and B [out, r] as a TP
    rank holds them (plan/lora.py), 6 FLOPs per weight and token at the rate measured for that shape."""
    r, t = spec.rank, 0.0
    for role in spec.targets:
        inp, out, split = lora.linears(shape)[role]
        a_in = inp / tp if split == lora.ROW else inp  # A's input: split for a row-split linear
        b_out = out / tp if split == lora.COLUMN else out  # B's output: split for a column-split one
        t += 6 * tokens * r * a_in / profile.linear_flops(ranks, tokens, a_in, r) \
            + 6 * tokens * r * b_out / profile.linear_flops(ranks, tokens, r, b_out)
    if terms:
        terms.item("LoRA adapters", "Σ 6·tokens·r·(in + out) / their rates (A, B as a TP rank holds them)",
                   None, sec(t))
    return t


def block_elementwise_bytes(shape, tokens: int, tp: int) -> float:
    """The elementwise traffic of one block's forward + backward (BLOCK_ELEMENTWISE), fp32 bytes."""
    a, b, e = BLOCK_ELEMENTWISE
    return 4 * tokens * (a * shape.d_model + b * shape.ffn_hidden / tp + e * shape.kv_dim / tp)


def block_elementwise_seconds(profile, ranks: int, shape, tokens: int, tp: int,
                              terms: Terms = NO_TERMS) -> float:
    """block_seconds' elementwise part: what "op" checkpointing recomputes (a third of it, forward's)."""
    block_bandwidth = profile.block_elementwise_bytes(ranks, tokens * shape.d_model * 4)
    moved = block_elementwise_bytes(shape, tokens, tp)
    a, b, e = BLOCK_ELEMENTWISE
    if terms:
        terms.item("elementwise", f"4·tokens·({a}h + {b}f/tp + {e}kv/tp) / block bandwidth",
                   f"{gb(moved)} / {num(block_bandwidth / 1e9)} GB/s", sec(moved / block_bandwidth))
    return moved / block_bandwidth


def _cp_seconds(w, c, rate: float, alpha: float, block_s: float, overlap: bool,
                terms: Terms = NO_TERMS, wire: bool = True) -> float:
    """The context-parallel exchange's exposed seconds per step (plan/context.py): per block and
    micro-batch forward and backward, and the forward again of each recomputed block. `rate`: the
    link's bytes per second (`wire`: of the bytes sent; else a measured rate per payload byte);
    `block_s`: one hop's forward attention, which a ring hop hides behind."""
    ex, layers, ckpt = cp_exchange(w, c)
    if c.cp_mode == "ring":
        forward, backward = context.ring_exposed(ex, rate, alpha, block_s, overlap, w.act_bytes)
        if terms:
            cp, kv, dkv = c.cp, 2 * ex.block / rate, 2 * ex.block * 4 / w.act_bytes / rate
            over, over_n = (("max(0, 2·B_kv/link − block)", f"max(0, {sec(kv)} − {sec(block_s)})") if overlap
                            else ("2·B_kv/link", sec(kv)))
            back, back_n = (("max(0, 2·B_kv·(1 + 4/e)/link − 2·block)",
                             f"max(0, {sec(kv + dkv)} − 2·{sec(block_s)})") if overlap
                            else ("2·B_kv·(1 + 4/e)/link", sec(kv + dkv)))
            terms.item("ring forward", f"(cp−1)·({over} + α)", f"({cp}−1)·({over_n} + {num(alpha)} s)",
                       sec(forward))
            terms.item("ring backward", f"(cp−1)·{back} + 2·B_kv·4/e/link + (2cp−1)·α",
                       f"({cp}−1)·{back_n} + {sec(dkv)} + (2·{cp}−1)·{num(alpha)} s", sec(backward))
    else:
        share = (c.cp - 1) / c.cp if wire else 1.0
        forward = backward = context.alltoall_seconds(ex, share, rate, alpha)
        if terms:
            part, nums = ("(cp−1)/cp·", f"({c.cp}−1)/{c.cp}·") if wire else ("", "")
            terms.item("all_to_all pass", f"{part}(2q + 2kv)/β + 4·α (exposed)",
                       f"{nums}{gb(ex.forward)}/{num(rate / 1e9)} GB/s + 4 × {num(alpha)} s", sec(forward))
    m = c.grad_accum
    total = m * (layers * (forward + backward) + ckpt * forward)
    if terms:
        terms.item("context parallel", "m·(L_s·(forward + backward) + c·forward)",
                   f"{m}·({layers}·({sec(forward)} + {sec(backward)}) + {ckpt}·{sec(forward)})", sec(total))
    return total


def _count(comm: CommAccount, kind: str, payload: float) -> int:
    """How many collectives of `kind` a step issues (DDP's buckets where the plan leaves it open)."""
    known = comm.count_by_kind.get(kind)
    return known if known else max(1, math.ceil(payload / DDP_BUCKET))


def _recompute(w, c, compute: float, gpu=None, terms: Terms = NO_TERMS) -> float:
    if not w.shape.known or c.activation_checkpointing == "none":
        return 0.0
    layers = w.shape.n_layers
    if c.activation_checkpointing == "op" and gpu is not None:
        # only the elementwise work of a forward is rerun, at memory bandwidth (or kernel launches)
        stage = math.ceil(layers / c.pp)
        tokens = c.local_seq(w.seq_len) * c.micro_batch
        moved = block_elementwise_bytes(w.shape, tokens, c.tp)
        per_layer = max(moved / 3 / (gpu.hbm_tbps * 1e12), KERNELS_PER_LAYER / 3 * gpu.kernel_launch_s)
        recompute = micro_steps(c) * stage * per_layer
        a, b, e = BLOCK_ELEMENTWISE
        if terms:
            terms.item("recompute",
                       f"micro-steps × ⌈L/p⌉ × max(4·tokens·({a}h + {b}f/tp + {e}kv/tp)/3 / HBM, "
                       f"{KERNELS_PER_LAYER}/3 launches) (a forward's elementwise work again)",
                       f"{micro_steps(c)} × {stage} × max({gb(moved)}/3 / {num(gpu.hbm_tbps)} TB/s, "
                       f"{KERNELS_PER_LAYER // 3} × {num(gpu.kernel_launch_s)} s)", sec(recompute))
        return recompute
    ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
    if w.lora is not None:  # a forward is about half of a LoRA step
        share = forward_share(w)
        recompute = compute * share * ckpt / layers
        if recompute and terms:
            terms.item("recompute", "compute × forward share × checkpointed/L (a forward again; LoRA: the "
                       "forward's share of the FLOPs)", f"{sec(compute)} × {num(share)} × {ckpt}/{layers}",
                       sec(recompute))
        return recompute
    recompute = compute / 3 * ckpt / layers
    if recompute and terms:
        terms.item("recompute", "compute/3 × checkpointed/L (a forward again)",
                   f"{sec(compute)}/3 × {ckpt}/{layers}", sec(recompute))
    return recompute


def _head_recompute(w, c, rate: float, terms: Terms = NO_TERMS) -> float:
    """The chunked loss's head matmul again in backward, where its gradients are not made in forward
    (candidate.head_recomputed: GPipe, the split backwards): 2·s·b·h·V/tp FLOPs a micro-batch on the
    last stage for each backward pass through it, one under GPipe, two under a split backward (its
    input pass and its weight pass each take the logits again: loom/parallel/backward_pass.py), at
    `rate`, FLOP/s (the stages wait for it)."""
    if not w.shape.known or not head_recomputed(w, c):
        return 0.0
    tokens = c.local_seq(w.seq_len) * c.micro_batch
    again = 2 if c.split_backward else 1
    seconds = micro_steps(c) * again * 2 * tokens * w.shape.d_model * w.shape.vocab_size / c.tp / rate
    if terms:
        terms.item("loss recompute", f"micro-steps × passes × 2·s·b·h·V/tp / rate (train.loss_chunk under "
                   f"{c.schedule}: each chunk's logits again in each backward pass)",
                   f"{micro_steps(c)} × {again} × 2·{tokens}·{w.shape.d_model}·{w.shape.vocab_size}/{c.tp} / "
                   f"{num(rate / 1e12)} TFLOP/s", sec(seconds))
    return seconds


def _ep_exposed(c, ep_s: float, busy: float, terms: Terms = NO_TERMS) -> float:
    """EP's all-to-alls, exposed; under DualPipeV's overlap (parallel.dualpipev_overlap) a forward and a
    backward paired in torch's OVERLAP_F_B run at once, each one's all-to-alls under the other's compute
    (loom/parallel/fb_overlap.py): the paired share of rank 0's passes (the fewest pairs) hides up to its
    share of the compute."""
    if not (c.schedule == "dualpipev" and c.pp > 1 and c.dualpipev_overlap):
        return ep_s
    m = c.grad_accum
    pairs = overlapped_pairs(c.pp, m, 0)
    hidden = pairs / (2 * m) * min(ep_s, busy)
    if terms:
        terms.item("ep hidden (DualPipeV)", "pairs/(2m) × min(ep, compute + recompute), pairs = 2m − 3p + 1",
                   f"{pairs}/{2 * m} × min({sec(ep_s)}, {sec(busy)})", sec(hidden))
    return ep_s - hidden


def _bubble(w, c, busy: float, terms: Terms = NO_TERMS, imbalance: float = 1.0) -> float:
    """The schedule's idle time (bubble_time) as a share b of the step, then busy · b/(1−b). `busy` is
    the busiest rank's; the fill and drain pass through every rank, so the bubble is priced on the
    mean rank's, busy ÷ `imbalance` (the busiest rank's passes ÷ the mean's)."""
    if c.pp <= 1:
        return 0.0
    if imbalance != 1.0:
        if terms:
            terms.item("mean rank's busy", "busy ÷ the busiest rank's share over the mean's (the fill and "
                       "drain pass every rank)", f"{sec(busy)} ÷ {num(imbalance)}", sec(busy / imbalance))
        busy /= imbalance
    p, m, v, schedule = c.pp, c.grad_accum, c.virtual_stages, c.schedule
    split = passes(w.shape, w.seq_len, w.lora)
    b = bubble_fraction(p, m, v, schedule, split)
    if terms:
        per = busy / m / split.total  # seconds per FLOP of one rank's micro-batch
        f, bw, wg = (per * x for x in (split.f, split.b, split.w))
        t = per * bubble_time(p, v, schedule, split)
        shares = ":".join(f"{x / split.total:.3f}" for x in (split.f, split.b, split.w))
        terms.item("F, B, W per micro-batch", "busy/m split as the FLOPs (each linear 2·in·out in each; "
                   "attention's matmuls B = 2F, no W)", f"{sec(busy)}/{m} × {shares}",
                   f"{sec(f)}, {sec(bw)}, {sec(wg)}")
        terms.item("bubble time", f"{BUBBLE_FORMULAS[schedule]} ({schedule})",
                   _bubble_numbers(schedule, p, v, f, bw, wg), sec(t))
        if schedule == "dualpipev":
            terms.note("  F&B' priced F'+B'+W': a forward beside a backward shares the device, their compute "
                       "does not shrink; what the pair hides is the expert all-to-all (ep hidden)")
        terms.item("bubble fraction", "bubble time / (m·(F+B+W) + bubble time)",
                   f"{sec(t)} / ({m}·{sec(f + bw + wg)} + {sec(t)})", num(b))
    bubble = busy * b / (1 - b)
    if terms:
        terms.item("bubble", "busy · b/(1−b)", f"{sec(busy)} × {num(b)}/(1 − {num(b)})", sec(bubble))
    return bubble


def _bubble_numbers(schedule: str, p: int, v: int, f: float, b: float, w: float) -> str:
    """BUBBLE_FORMULAS[schedule] with the numbers put in (a V's chunk: half the rank's F, B, W)."""
    if schedule in ("gpipe", "1f1b"):
        return f"({p}−1)({sec(f)} + {sec(b)} + {sec(w)})"
    if schedule == "interleaved":
        return f"({p}−1)({sec(f)} + {sec(b)} + {sec(w)})/{v}"
    if schedule == "zb":
        return f"max(0, ({p}−1)({sec(f)} + {sec(b)} − {sec(w)})/{v})"
    f, b, w = f / 2, b / 2, w / 2
    if schedule == "zbv":
        return f"max(0, ({p}−1)({sec(f)} + {sec(b)} − 2·{sec(w)}))"
    return f"max(0, ({p}−1)(({sec(f)} + {sec(b)} + {sec(w)}) + {sec(b)} − 2·{sec(w)}))"


def _offload(w, c, cluster, terms: Terms = NO_TERMS) -> float:
    if c.offload == "none":
        return 0.0
    gpu = cluster.gpu
    if w.lora is not None:
        return _lora_offload(w, c, cluster, terms)
    local = w.shape.num_params / (c.tp * c.pp * c.shard_size)
    if w.shape.moe:  # the MoE blocks whole over TP, the routed experts split over ep
        local = local_params(w, c)
        if terms:
            terms.item("Ψ offloaded per GPU", "the heaviest stage's Ψ stepped per rank", None, num(local))
    elif terms:
        terms.item("Ψ offloaded per GPU", "Ψ/(tp·pp·N)",
                   f"{num(w.shape.num_params)}/({c.tp}·{c.pp}·{c.shard_size})", num(local))
    link = (4 * local + 2 * local) / (gpu.host_link_gbps * 1e9)  # fp32 gradients out, 16-bit params in
    if terms:
        terms.item("host link", "(4Ψ + 2Ψ)/host link (fp32 grads out, 16-bit params in)",
                   f"6 × {num(local)} / {num(gpu.host_link_gbps)} GB/s", sec(link))
    rate = cluster.cpu_adam_params_per_s / cluster.gpus_per_node
    adam = local / rate
    if terms:
        terms.item("host Adam", "Ψ/(CPU Adam rate per node / GPUs per node)",
                   f"{num(local)} / "
                   f"({num(cluster.cpu_adam_params_per_s)}/{cluster.gpus_per_node})", sec(adam))
    offload = link + adam
    nvme = ""
    if c.offload in ("optimizer-nvme", "nvme"):
        disk = 2 * 12 * local / (cluster.nvme_gbps * 1e9 / cluster.gpus_per_node)
        if terms:
            terms.item("NVMe", "2·12Ψ/(NVMe bandwidth / GPUs per node) (optimizer states read and written)",
                       f"24 × {num(local)} / ({num(cluster.nvme_gbps)} GB/s / {cluster.gpus_per_node})",
                       sec(disk))
        offload, nvme = offload + disk, " + NVMe"
    if terms:
        terms.item("offload", "host link + host Adam" + nvme, None, sec(offload))
    return offload


def _lora_offload(w, c, cluster, terms: Terms = NO_TERMS) -> float:
    """FSDP2's CPU offload under LoRA: the trainable parameters' fp32 gradients out, every parameter in
    (the frozen base in its dtype, what trains in fp32), host Adam over what trains."""
    shape, gpu = w.shape, cluster.gpu
    rest, routed = rank_lora_params(w, c, heaviest_rank(shape, c))
    frozen = rest.frozen / c.shard_size + routed.frozen / c.expert_shard_size
    trained = local_params(w, c)
    b = w.lora.base_bytes
    link = (4 * trained + b * frozen + 4 * trained) / (gpu.host_link_gbps * 1e9)
    adam = trained / (cluster.cpu_adam_params_per_s / cluster.gpus_per_node)
    if terms:
        terms.item("Ψ_base, Ψ_lora per GPU", "a rank's shard of the frozen base, of what trains", None,
                   f"{num(frozen)}, {num(trained)}")
        terms.item("host link", f"(4Ψ_lora + {b}Ψ_base + 4Ψ_lora)/host link (fp32 grads out; the base and "
                   "what trains in)",
                   f"(8 × {num(trained)} + {b} × {num(frozen)}) / {num(gpu.host_link_gbps)} GB/s",
                   sec(link))
        terms.item("host Adam", "Ψ_lora/(CPU Adam rate per node / GPUs per node)",
                   f"{num(trained)} / ({num(cluster.cpu_adam_params_per_s)}/{cluster.gpus_per_node})",
                   sec(adam))
        terms.item("offload", "host link + host Adam", None, sec(link + adam))
    return link + adam
