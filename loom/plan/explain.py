"""`loom plan --explain N`: one candidate's memory and time arithmetic, line by line.

Every line names a quantity, its formula in symbols, the same formula with this candidate's
numbers, and the result, so a person can redo it by hand against the seeds' formulas. The numbers
come from the planner's own functions (plan/memory.py, shapes.py, comm.py, step.py, efficiency.py).
Memory is the planner's account itself: memory.stage_memory's states and the moments of the step it
compared (`moments=`), with shapes.py's activation formulas printed beside them and checked against
the moment that holds exactly the saved activations. For communication and time, where the planner
computes a piece inline, this module repeats that expression. Each section ends with a check line
that its parts add up to the candidate's record — a ✗ there means this explanation and the planner
have drifted apart (the tests fail on it).
"""

from __future__ import annotations

import math

from loom import strategies
from loom.errors import ConfigError
from loom.plan import step as steps
from loom.plan.candidate import Candidate
from loom.plan.comm import pp_sends, ring, tp_reductions
from loom.plan.efficiency import D0_SCALE, DEFAULT, FAMILY, compute_fraction, link_efficiency
from loom.plan.memory import (
    DEEPSPEED_BUCKETS,
    GRAD_COMM_BYTES,
    RECIPES,
    _micro_batches_in_flight,
    ddp_accumulates_apart,
    engine_recipe,
    gpu_memory,
    model_state_bytes,
    stage_memory,
)
from loom.plan.search import estimate, size_text
from loom.plan.shapes import (
    activation_bytes_per_layer,
    checkpointed_layers,
    head_saved_bytes,
    head_transient_bytes,
    layers_of_stage,
    llama_like,
    op_saved_bytes_per_layer,
    residual_bytes,
)

GB = 1e9


def candidate_of(record: dict) -> Candidate:
    """The Candidate a record of `loom plan --format json` prices (the inverse of search.estimate)."""
    hybrid = strategies.lookup(record["strategy"]).dp_mesh == "hybrid"
    deepspeed = record["engine"] == "deepspeed" and record["offload"] == "none"
    return Candidate(record["strategy"], record["dp"], record["tp"], record["pp"],
                     record["dp_shard"] if hybrid else 0, record["offload"], record["pp_schedule"],
                     record["pp_virtual_stages"], record["activation_checkpointing"], record["ac_every"],
                     record["micro_batch"], record["grad_accum"], record["sequence_parallel"],
                     "deepspeed" if deepspeed else "torch")


def explain(plan, index: int) -> str:
    count = len(plan.candidates)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(f"candidate {index} does not exist; the plan has {count} (0–{count - 1})")
    record = plan.candidates[index]
    w, cluster = plan.workload, plan.cluster
    c = candidate_of(record)
    out = _Out()
    _header(out, index, record, w, c, cluster)
    _memory(out, record, w, c, cluster)
    comm, groups = _comm(out, record, w, c, cluster)
    if cluster.gpu is not None and record["step_time_s"] is not None:
        if cluster.profile is None:
            _catalog_time(out, record, w, c, cluster, comm, groups)
        else:
            _measured_time(out, record, w, c, cluster, comm)
        _throughput(out, record, w, c, cluster)
    return "\n".join(out.lines)


# ---------------------------------------------------------------------------------------------
# formatting


def num(x: float) -> str:
    """A number as the explanation prints it: integers exactly, others to 5 significant digits."""
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) < 1e13:
        return f"{int(x):,}"
    return f"{x:.5g}"


def gb(x: float) -> str:
    return f"{num(x / GB)} GB"


def sec(x: float) -> str:
    return f"{num(x)} s"


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines += ["", title]

    def note(self, text: str) -> None:
        self.lines.append(f"  {text}")

    def item(self, what: str, formula: str, numbers: str | None, result: str) -> None:
        """what: formula = numbers = result (numbers left out when they add nothing)."""
        middle = f" = {numbers}" if numbers and numbers != formula and numbers != result else ""
        self.lines.append(f"  {what:<24} {formula}{middle} = {result}")

    def check(self, parts: list[tuple[str, float]], total: float, expected: float, unit) -> bool:
        """`check: a x + b y = total; the record: expected ✓` (✗ when they differ)."""
        ok = math.isclose(total, expected, rel_tol=1e-9, abs_tol=1e-12 * max(1.0, abs(expected)))
        added = math.isclose(sum(v for _, v in parts), total, rel_tol=1e-9, abs_tol=1e-12)
        text = " + ".join(f"{name} {unit(v)}" for name, v in parts) or "nothing"
        mark = "✓" if ok and added else "✗ (this explanation and the planner disagree)"
        self.lines.append(f"  check: {text} = {unit(total)}; the record: {unit(expected)} {mark}")
        return ok and added


def _mismatch(out: _Out, what: str, mine: float, planner: float, unit) -> None:
    if not math.isclose(mine, planner, rel_tol=1e-9, abs_tol=1e-12):
        out.note(f"✗ {what}: this explanation computes {unit(mine)}, the planner {unit(planner)}")


# ---------------------------------------------------------------------------------------------
# header


def _header(out: _Out, index: int, record: dict, w, c: Candidate, cluster) -> None:
    shape = w.shape
    out.lines.append(f"candidate {index}: {record['label']} — engine {record['engine']}"
                     f"{'' if record['runs_in_loom'] else ' (loom does not run it)'}")
    out.note(f"{shape.name}: {num(shape.num_params)} parameters; {cluster.describe()}; recipe {w.recipe}; "
             f"{w.precision} compute (e = {w.act_bytes} bytes per activation element)")
    s = c.strategy_info
    shard = (f"N = {c.shard_size} (dp_shard; {c.replicate_size} replica groups)" if s.dp_mesh == "hybrid"
             else f"N = {c.shard_size}")
    out.note(f"layout: dp {c.dp} × tp {c.tp} × pp {c.pp} = {c.world} ranks; {shard} ranks share one shard "
             f"of the model states")
    accum = "pipeline micro-batches m" if c.pp > 1 else "gradient-accumulation micro-steps"
    out.note(f"batch: global {w.global_batch} sequences × T = s = {w.seq_len} tokens = "
             f"{num(w.tokens_per_step)} tokens per step; per rank micro-batch b = {c.micro_batch} × "
             f"{c.grad_accum} {accum} (dp {c.dp} × {c.micro_batch} × {c.grad_accum} = "
             f"{c.dp * c.micro_batch * c.grad_accum})")
    if shape.known:
        out.note(f"shape: L = {shape.n_layers} layers, h = {shape.d_model}, a = H = {shape.n_heads} heads "
                 f"(Q = {shape.head_dim} per head, {shape.n_kv_heads} kv heads: kv = {shape.kv_dim}), "
                 f"f = {shape.ffn_hidden}, V = {shape.vocab_size}"
                 f"{', tied embeddings' if shape.tie_embeddings else ''}")
    else:
        out.note("shape: parameter count only (activations, TP/PP and attention FLOPs are not modelled)")
    if c.activation_checkpointing != "none":
        every = f" of every {c.ac_every} blocks" if c.activation_checkpointing == "selective" else ""
        out.note(f"activation checkpointing: {c.activation_checkpointing}{every}")
    if c.label() != record["label"]:
        out.note(f"✗ the candidate rebuilt from the record is {c.label()!r}, not {record['label']!r}")
    again = estimate(w, c, cluster)
    same = again["memory_bytes"] == record["memory_bytes"] and again["step_time_s"] == record["step_time_s"]
    if not same:
        out.note("✗ the candidate rebuilt from the record prices differently from the record")


# ---------------------------------------------------------------------------------------------
# memory


def _params_line(out: _Out, shape, stage: int, pp: int) -> int:
    """Ψ of one stage, explained; returns it."""
    total = shape.stage_params(stage, pp)
    if not shape.known:
        if pp == 1:
            out.item("Ψ parameters", "--params", None, num(total))
        else:
            out.item("Ψ stage parameters", "Ψ/p", f"{num(shape.num_params)} / {pp}", num(total))
        return total
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    out.item("P_layer per block", "2h² + 2h·kv + 3h·f + 2h",
             f"2·{d}² + 2·{d}·{kv} + 3·{d}·{f} + 2·{d}", num(shape.layer_params))
    layers = shape.n_layers if pp == 1 else layers_of_stage(shape.n_layers, stage, pp)
    first, last = stage == 0, stage == pp - 1
    sym, vals = [f"{'L' if pp == 1 else 'L_s'}·P_layer"], [f"{layers}·{num(shape.layer_params)}"]
    if first:
        sym.append("V·h")
        vals.append(f"{shape.vocab_size}·{d}")
    if last:
        if shape.tie_embeddings:
            sym.append("h" if pp == 1 else "h + V·h")
            vals.append(f"{d}" if pp == 1 else f"{d} + {shape.vocab_size}·{d}")
        else:
            sym.append("(V·h + h)")
            vals.append(f"({shape.vocab_size}·{d} + {d})")
    what = "Ψ parameters" if pp == 1 else f"Ψ of stage {stage}"
    out.item(what, " + ".join(sym), " + ".join(vals), num(total))
    if pp > 1:
        out.note(f"  (stage {stage} of {pp}: L_s = {layers} blocks{'; the embedding' if first else ''}"
                 f"{'; the final norm and head' if last else ''}"
                 f"{' (tied: its own copy of the embedding)' if last and shape.tie_embeddings else ''})")
    return total


def _state_formula(p: int, g: int, o: int, sp: bool, sg: bool, so: bool) -> tuple[str, str]:
    """('4Ψ/N + 4Ψ/N + 8Ψ/N', '16Ψ/N'): the per-state sum and its collapsed form."""
    terms = [(p, sp), (g, sg), (o, so)]
    full = " + ".join(f"{b}Ψ{'/N' if s else ''}" for b, s in terms)
    whole = sum(b for b, s in terms if not s)
    split = sum(b for b, s in terms if s)
    short = " + ".join(t for t in ((f"{whole}Ψ" if whole else ""), (f"{split}Ψ/N" if split else "")) if t)
    return full, short


# What each moment memory._step_peak compares holds beyond the model states at rest (its names).
MOMENTS = {
    "forward's end": "in the loss: saved, the logits and their fp32 copy | the latest all-gather as well",
    "loss": "backward's start: saved + the loss's gradients of the logits",
    "backward's start": "saved | what backward holds from its start",
    "head backward": "the loss's tensors gone: the logits' and the head weight's gradients",
    "head reduce-scatter": "the head's own unit reduce-scatters its gradient, resharded first",
    "recompute": "the topmost checkpointed block rebuilt, with its backward's first gradients (SwiGLU "
                 "gate and up); its unit gathered again",
    "pipeline": "a micro-batch's backward done, the others in flight, every unit gathered",
    "reduce-scatter": "the end of backward: the last unit's reduce-scatter",
    "tied embedding": "the embedding's gradient added to the head's",
    "optimizer": "foreach AdamW's sqrt(v) on CPU: half the optimizer states",
    "at rest": "between steps: the states alone",
}
OFFLOADED = {"optimizer": "grads and optimizer states to the host (ZeRO-Offload)",
             "optimizer+params": "params, grads and optimizer states to the host",
             "optimizer-nvme": "grads and optimizer states to NVMe (ZeRO-Infinity)",
             "nvme": "params, grads and optimizer states to NVMe (ZeRO-Infinity)"}


def memory_device(cluster) -> str:
    """The device the planner prices memory for (search.estimate): gloo ranks on a measured CPU
    allocate differently from GPUs."""
    profile = cluster.profile
    return "cpu" if profile is not None and profile.device == "cpu" else "cuda"


def _unit(cluster) -> str:
    """What one rank runs on, in the section titles: a GPU, or (planning a CPU) a rank."""
    return "rank" if memory_device(cluster) == "cpu" else "GPU"


def _memory(out: _Out, record: dict, w, c: Candidate, cluster) -> None:
    """The planner's own account (memory.stage_memory) and the moments it compared, explained."""
    shape, frag, device = w.shape, cluster.fragmentation, memory_device(cluster)
    stage = gpu_memory(w, c, frag, device).stage
    moments: list[tuple[str, float, float]] = []
    mem = stage_memory(w, c, stage, frag, device, moments=moments)
    out.section(f"memory per {_unit(cluster)} (GB = 1e9 bytes)"
                f"{'' if c.pp == 1 else f', pipeline stage {stage}'}")
    if c.pp > 1:
        totals = {s: stage_memory(w, c, s, frag, device).total for s in sorted({0, c.pp - 1})}
        out.note("stages 0 and p−1 priced (the embedding, the head): "
                 + ", ".join(f"stage {s} {gb(t)}" for s, t in totals.items())
                 + f"; the larger, stage {stage}, is the GPU's")
    stage_params = _params_line(out, shape, stage, c.pp)
    layers = layers_of_stage(shape.n_layers, stage, c.pp) if shape.known else 0
    replicated = shape.tp_replicated_params(layers, stage == c.pp - 1) if (c.tp > 1 and shape.known) else 0
    psi = stage_params
    if c.tp > 1:
        psi = (stage_params - replicated) / c.tp + replicated
        out.item("Ψ_tp on a TP rank", "(Ψ − R)/tp + R, R = norm gains (2h per block + h)",
                 f"({num(stage_params)} − {num(replicated)})/{c.tp} + {num(replicated)}", num(psi))
    moved = _state_lines(out, w, c, stage_params, replicated, psi, mem)

    deepspeed = c.engine == "deepspeed"
    if deepspeed:
        out.note(f"DeepSpeed buckets: its reduce and all-gather buckets, 2 × 25 MiB = "
                 f"{gb(DEEPSPEED_BUCKETS)}, held through the step")
    buffers = [("DeepSpeed's gradient partitions", moved)] if moved else []
    if shape.known:
        activations = _activation_lines(out, w, c, stage, layers, moments, mem)
        if not moments:  # DeepSpeed's engine: one moment, its buffers and its activations
            moments = [("DeepSpeed's step", activations, mem.buffers - moved)]
        peak = _moment_lines(out, moments)
        if ddp_accumulates_apart(w, c):
            out.note(f"  buffers include DDP's gradients of the no_sync micro-steps, beside its buckets: "
                     f"grads = {gb(mem.grads)}")
        activations = peak[1]
        buffers.insert(0, ("the peak's buffers", peak[2]))
    else:
        out.note("activations: not modelled (parameter count only)")
        activations = 0.0
        if deepspeed:
            buffers.insert(0, ("DeepSpeed buckets", DEEPSPEED_BUCKETS))
        if c.offload != "none":
            layer = llama_like(shape.num_params).layer_params
            out.note(f"offload: a layer's parameters staged in from the host, and the next: 2·e·layer/tp, a "
                     f"Llama-style layer of Ψ having {num(layer)} parameters")
            buffers.append(("2 staged layers", 2 * w.act_bytes * layer / c.tp))
    buffer_total = sum(v for _, v in buffers)
    if len(buffers) > 1:
        out.item("buffers", " + ".join(n for n, _ in buffers), " + ".join(gb(v) for _, v in buffers),
                 gb(buffer_total))
    elif buffers and not shape.known:
        out.item("buffers", buffers[0][0], None, gb(buffer_total))
    allocated = mem.params + mem.grads + mem.optimizer + activations + buffer_total
    fragmentation = frag * allocated
    out.item("fragmentation", f"{frag:g} × allocated (states + activations + buffers)",
             f"{frag:g} × {gb(allocated)}", gb(fragmentation))
    m = record["memory_bytes"]
    for what, mine in (("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer),
                       ("activations", activations), ("buffers", buffer_total), ("host", mem.host),
                       ("nvme", mem.nvme)):
        _mismatch(out, what, mine, m[what], gb)
    parts = [("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer),
             ("activations", activations), ("buffers", buffer_total), ("fragmentation", fragmentation)]
    out.check(parts, allocated + fragmentation, m["total"], gb)
    gpu = cluster.gpu
    if gpu is not None:
        verdict = "fits" if record["fits"] else f"does not fit: {record['why_not']}"
        unit = "rank" if memory_device(cluster) == "cpu" else "GPU"
        out.note(f"{gb(m['total'])} of {size_text(gpu.memory_gb * GB)} per {unit}; {verdict}")
    if mem.host or mem.nvme:
        per_node = cluster.gpus_per_node
        where, value, key = (("host", mem.host, "host_memory_bytes") if mem.host
                             else ("NVMe", mem.nvme, "nvme_bytes"))
        out.item(f"{where} per node", f"{where} per GPU × GPUs per node", f"{gb(value)} × {per_node}",
                 gb(value * per_node))
        _mismatch(out, f"{where} per node", value * per_node, record[key], gb)


def _state_lines(out: _Out, w, c: Candidate, stage_params: int, replicated: int, psi: float, mem) -> float:
    """The model states of the recipe and strategy, and where the account keeps them (GPU, host,
    NVMe); returns the gradient partitions DeepSpeed holds only during the step (a buffer)."""
    recipe = engine_recipe(w, c)
    deepspeed = c.engine == "deepspeed"
    paper = recipe == "zero" or deepspeed
    s = c.strategy_info
    sp, sg, so = (kind in s.sharded for kind in (strategies.PARAMS, strategies.GRADS, strategies.OPTIMIZER))
    if paper and s.zero_stage == 2:
        sp = False
    p, g, o = RECIPES[recipe]
    full, short = _state_formula(p, g, o, sp, sg, so)
    recipe_text = {"torch": "torch: fp32 params 4 + fp32 grads 4 + Adam m, v 8 bytes per parameter",
                   "zero": "ZeRO paper: 16-bit params 2 + 16-bit grads 2 + fp32 master, m, v 12",
                   "megatron": "Megatron: 16-bit params 2 + fp32 main grads 4 + fp32 master, m, v 12",
                   "deepspeed_fp32": "DeepSpeed over fp32 weights: params 4 + grads 4 + master, m, v 12",
                   }[recipe]
    why = f" (the {c.engine} engine's)" if recipe != w.recipe else ""
    shards = ", ".join(k for k, f in (("params", sp), ("grads", sg), ("optimizer", so)) if f) or "nothing"
    out.note(f"model states, recipe {recipe}{why}: {recipe_text}; {c.strategy} shards {shards} "
             f"over N = {c.shard_size}")
    if recipe == "torch":
        seeds = f"the seeds' {c.strategy}: {s.formula}"
    else:
        stage_name = ("DDP", "P_os", "P_os+g", "P_os+g+p")[s.zero_stage]
        whole = ", params whole at rest" if paper and s.zero_stage == 2 else ""
        seeds = f"the ZeRO paper's {stage_name}, K = {o}{whole}"
    out.note(f"  {full} = {short}   ({seeds})")
    states = model_state_bytes(c.strategy, stage_params, c.shard_size, recipe, paper_stages=paper, tp=c.tp,
                               tp_replicated=replicated)
    n = c.shard_size
    psi_sym = "Ψ_tp" if c.tp > 1 else "Ψ"
    for name, b, sharded, value in (("params", p, sp, states.params), ("grads", g, sg, states.grads),
                                    ("optimizer", o, so, states.optimizer)):
        formula = f"{b}·{psi_sym}{'/N' if sharded else ''}"
        numbers = f"{b} × {num(psi)}{f' / {n}' if sharded else ''}"
        out.item(name, formula, numbers, gb(value))
    moved = states.grads if deepspeed and c.offload == "none" else 0.0
    if moved:
        out.note(f"  DeepSpeed frees its gradient partitions after each step: grads {gb(moved)} counted "
                 f"as a buffer (held during the step), 0 at rest")
    if c.offload != "none":
        out.note(f"  offload {c.offload}: {OFFLOADED[c.offload]}: {gb(mem.host + mem.nvme)} per GPU leave "
                 f"the GPU")
    on_gpu = mem.params + mem.grads + mem.optimizer
    out.item("model states on GPU", "params + grads + optimizer",
             f"{gb(mem.params)} + {gb(mem.grads)} + {gb(mem.optimizer)}", gb(on_gpu))
    # every state is somewhere: on the GPU, the host or NVMe, or (DeepSpeed's gradients) a buffer
    _mismatch(out, "model states on GPU + host + NVMe + buffers", on_gpu + mem.host + mem.nvme + moved,
              states.total, gb)
    return moved


def _activation_lines(out: _Out, w, c: Candidate, stage: int, layers: int, moments: list, mem) -> float:
    """One micro-batch's saved activations from shapes.py's formulas, times the micro-batches in
    flight, checked against the moment the planner holds exactly them in; returns the saved bytes
    (DeepSpeed: its activations, which it prices without moments)."""
    shape, tp, e = w.shape, c.tp, w.act_bytes
    last, pipelined = stage == c.pp - 1, c.pp > 1
    deepspeed = c.engine == "deepspeed"
    autocast = not deepspeed and not c.strategy_info.uses_fsdp(tp) and e < 4
    sp = c.sequence_parallel and tp > 1
    sq, b, h, f = w.seq_len, c.micro_batch, shape.d_model, shape.ffn_hidden
    a, v = shape.n_heads, shape.vocab_size
    sb = sq * b
    chunk = w.loss_chunk if tp == 1 and not pipelined else 0  # as memory._step_peak

    how = ("torch.autocast (fp32 residual stream and norms, each matmul casts its input)" if autocast
           else "16-bit weights (FSDP2 MixedPrecisionPolicy / DeepSpeed)" if e < 4 else "fp32")
    out.note(f"activations of one micro-batch (Korthikanti et al. 2022's sbh(34 + 5as/h), adapted to "
             f"RMSNorm, RoPE, SwiGLU, GQA and flash attention), {how}: s·b = {sb}")
    ne, kv = (4 if autocast else e), shape.kv_dim
    split = sb * ((2 * h + 2 * kv + 3 * f) * e + 4 * a)
    norms = 2 * sb * (h * ne + 4)
    linear_inputs = 2 * sb * h * e
    rope = e * sq * shape.head_dim if e < 4 and not autocast else 0
    out.item("split by TP", "s·b·((2h + 2kv + 3f)·e + 4a) (q, k, v, out; gate, up, product; lse)",
             f"{sb}·((2·{h} + 2·{kv} + 3·{f})·{e} + 4·{a})", gb(split))
    out.item("norms", f"2·s·b·(h·{'4' if autocast else 'e'} + 4) (input + fp32 rstd)",
             f"2·{sb}·({h}·{ne} + 4)", gb(norms))
    out.item("linear inputs", "2·s·b·h·e (the two norm outputs)", f"2·{sb}·{h}·{e}", gb(linear_inputs))
    if rope:
        out.item("RoPE table", "e·s·Q (FSDP2's 16-bit cast, kept)", f"{e}·{sq}·{shape.head_dim}", gb(rope))
    per_layer = activation_bytes_per_layer(shape, sq, b, e, tp, sp, autocast)
    over, by = ("/tp", f"/{tp}") if sp else ("", "")
    rope_sym, rope_num = (" + RoPE", f" + {gb(rope)}") if rope else ("", "")
    mine = split / tp + (norms / tp if sp else norms) + linear_inputs + rope
    out.item("per block", f"split/tp + norms{over} + linear inputs{rope_sym}"
             + (" (sequence parallel)" if sp else ""),
             f"{gb(split)}/{tp} + {gb(norms)}{by} + {gb(linear_inputs)}{rope_num}", gb(per_layer))
    _mismatch(out, "per block", mine, per_layer, gb)
    residual = residual_bytes(shape, sq, b, e, autocast)
    ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
    kept_input = residual / (tp if sp else 1)
    if ckpt:
        rule = ("all L_s blocks" if c.activation_checkpointing != "selective"
                else f"⌈L_s/{c.ac_every}⌉ = ⌈{layers}/{c.ac_every}⌉")
        out.item("checkpointed blocks c", rule, None, str(ckpt))
        out.item("kept input", f"s·b·h·{'4' if autocast else 'e'}{over}",
                 f"{sb}·{h}·{4 if autocast else e}{by}", gb(kept_input))
        if c.activation_checkpointing == "op":  # and the matmuls' and attention's outputs
            kv, f, a = shape.kv_dim, shape.ffn_hidden, shape.n_heads
            outputs = sb * (e * (2 * h + 2 * kv + 2 * f) + 4 * a) / tp + 2 * sb * h * e
            out.item("kept outputs (op)", "s·b·(e·(2h + 2kv + 2f) + 4a)/tp + 2·s·b·h·e (q k v, attention "
                     "+ log-sum-exp, gate up; wo, w2 whole)",
                     f"{sb}·({e}·(2·{h} + 2·{kv} + 2·{f}) + 4·{a})/{tp} + 2·{sb}·{h}·{e}", gb(outputs))
            mine = kept_input + outputs
            kept_input = op_saved_bytes_per_layer(shape, sq, b, e, tp, sp, autocast)
            _mismatch(out, "kept (op)", mine, kept_input, gb)
        blocks = (layers - ckpt) * per_layer + ckpt * kept_input
        out.item("blocks", "(L_s − c)·block + c·kept input",
                 f"({layers} − {ckpt})·{gb(per_layer)} + {ckpt}·{gb(kept_input)}", gb(blocks))
    else:
        blocks = layers * per_layer
        out.item("blocks", "L_s·block", f"{layers}·{gb(per_layer)}", gb(blocks))
    parts = [("blocks", blocks)]
    if last:
        head = head_saved_bytes(shape, sq, b, e, tp, pipelined, sp, autocast, chunk)
        logits = f" + sbV/tp·{e} (the logits a pipeline keeps)" if pipelined else ""
        if chunk:  # train.loss_chunk: no logits kept, each token's logsumexp
            out.item("final norm + loss", f"s·b·h·(4 + {'4' if autocast else 'e'}){over} + s·b·h·e "
                     f"+ 4·s·b (chunked loss: fp32 logsumexp)",
                     f"{sb}·{h}·(4 + {ne}){by} + {sb}·{h}·{e} + 4·{sb}", gb(head))
        else:
            out.item("final norm + loss", f"s·b·h·(4 + {'4' if autocast else 'e'}){over} + s·b·h·e "
                     f"+ 4·s·b·V/tp (fp32 log-softmax){logits}",
                     f"{sb}·{h}·(4 + {ne}){by} + {sb}·{h}·{e} + {4 + (e if pipelined else 0)}·{sb}·{v}/{tp}",
                     gb(head))
        parts.append(("head", head))
    elif pipelined:
        out.item("stage output", f"s·b·h·{'4' if autocast else 'e'} (kept for its backward)",
                 f"{sb}·{h}·{4 if autocast else e}", gb(residual))
        parts.append(("stage output", residual))
    one_micro = sum(x for _, x in parts)
    inflight = _micro_batches_in_flight(c, stage)
    p, m, vs = c.pp, c.grad_accum, c.virtual_stages
    if p == 1:
        rule, nums = "1 (no pipeline)", None
    elif c.schedule == "gpipe":
        rule, nums = "m (GPipe: every forward before any backward)", f"{m}"
    elif c.schedule == "interleaved" and stage == 0:
        rule = "min(m·v, p·(1 + (p−1)/(p·v))) (interleaved 1F1B, first stage)"
        nums = f"min({m}·{vs}, {p}·(1 + ({p}−1)/({p}·{vs})))"
    else:
        rule, nums = f"min(m, p − stage) (1F1B, stage {stage})", f"min({m}, {p} − {stage})"
    out.item("micro-batches in flight", rule, nums, num(inflight))
    saved = inflight * one_micro
    out.item("saved", "in flight × (" + " + ".join(n for n, _ in parts) + ")",
             f"{num(inflight)} × {gb(one_micro)}", gb(saved))
    transient = 0.0
    if last:
        transient = head_transient_bytes(shape, sq, b, tp, chunk, e)
        k = 2 if tp == 1 else 3
        if chunk:
            x = 4 + (e if e < 4 else 0)
            out.item("loss gradients", f"min(chunk, s·b)·V·{x} (one chunk's logits and fp32 softmax)",
                     f"{min(chunk, sb)}·{v}·{x}", gb(transient))
        else:
            out.item("loss gradients", f"{k}·4·s·b·V/tp (the loss's fp32 gradients of the logits)",
                     f"{k}·4·{sb}·{v}/{tp}", gb(transient))
    if deepspeed:
        rebuilt = per_layer if ckpt else 0.0
        activations = saved + max(rebuilt, transient)
        out.item("activations", "saved + max(recomputed block, loss gradients) (DeepSpeed's engine)",
                 f"{gb(saved)} + max({gb(rebuilt)}, {gb(transient)})", gb(activations))
        _mismatch(out, "DeepSpeed's activations", activations, mem.activations, gb)
        return activations
    # The planner holds exactly these at backward's start: the loss moment (with the loss's
    # gradients) on the last stage, "backward's start" on the others.
    name, what = ("loss", "saved + loss gradients") if last else ("backward's start", "saved")
    theirs = [act for n, act, _ in moments if n == name]
    if len(theirs) != 1:
        out.note(f"✗ the planner compares no moment {name!r} (its moments: "
                 f"{', '.join(n for n, _, _ in moments) or 'none'})")
    else:
        out.note(f"  {what} = {gb(saved + transient)}: the activations of the moment {name!r} below")
        _mismatch(out, f"{what} (the moment {name!r})", saved + transient, theirs[0], gb)
    return saved


def _moment_lines(out: _Out, moments: list) -> tuple[str, float, float]:
    """Each moment the planner compared, activations | buffers beyond the states at rest; returns
    the peak (the first largest, as memory._step_peak takes it)."""
    peak = max(moments, key=lambda x: x[1] + x[2])
    out.note("moments of the step (memory.stage_memory's), activations | buffers beyond the states at rest; "
             "the peak is the largest sum:")
    for moment in moments:
        name, act, buf = moment
        about = f"   ({MOMENTS[name]})" if name in MOMENTS else ""
        mark = "  ← peak" if moment is peak else ""
        out.lines.append(f"  {name + ':':<24} {gb(act)} | {gb(buf)} = {gb(act + buf)}{about}{mark}")
    if any(buf < 0 for _, _, buf in moments):
        out.note("  (buffers below 0: FSDP2's sharded gradients, counted in the states at rest, are freed at "
                 "the step's start and not rebuilt yet)")
    return peak


# ---------------------------------------------------------------------------------------------
# communication


def _comm(out: _Out, record: dict, w, c: Candidate, cluster):
    from loom.plan.comm import comm_per_step

    comm, groups = comm_per_step(w, c, cluster.gpus_per_node)
    shape, s = w.shape, c.strategy_info
    out.section(f"communication per {_unit(cluster)} per step (ring: all-reduce 2(N−1)/N·Φ, all-gather and "
                "reduce-scatter (N−1)/N·Φ each, broadcast (N−1)/N·Φ; Φ = the whole tensor)")
    per_node = cluster.gpus_per_node
    stage_params = max(shape.stage_params(st, c.pp) for st in {0, c.pp - 1})
    if c.tp > 1 and shape.known:
        replicated = shape.tp_replicated_params(shape.n_layers // c.pp, True)
        local = (stage_params - replicated) / c.tp + replicated
        out.item("Ψ_dp synced per rank", "(Ψ_stage − R)/tp + R",
                 f"({num(stage_params)} − {num(replicated)})/{c.tp} + {num(replicated)}", num(local))
    else:
        local = stage_params / c.tp
        out.item("Ψ_dp synced per rank", "Ψ_stage (heaviest stage)" if c.pp > 1 else "Ψ", None, num(local))
    gbytes = GRAD_COMM_BYTES[w.recipe]
    per_param = w.act_bytes if w.recipe == "torch" else RECIPES[w.recipe][0]
    grad_bytes, param_bytes = gbytes * local, per_param * local
    out.item("Φ_g gradients", f"{gbytes}·Ψ_dp", f"{gbytes} × {num(local)}", gb(grad_bytes))
    out.item("Φ_p parameters", f"{per_param}·Ψ_dp (gathered dtype)", f"{per_param} × {num(local)}",
             gb(param_bytes))
    dp_inter = c.dp * c.tp > per_node
    micro = c.grad_accum if c.pp == 1 else 1
    dp_parts: list[tuple[str, float]] = []

    def link(inter: bool) -> str:
        return "inter-node" if inter else "intra-node"

    if w.recipe != "torch" and s.zero_stage in (1, 2):
        n = c.dp
        out.note(f"ZeRO paper stage {s.zero_stage}: reduce-scatter the gradients, all-gather the updated "
                 f"parameters once: Φ_g + Φ_p ≈ 2Φ, as DDP ({link(dp_inter)}, N = {n})")
        rs, ag = ring("reduce_scatter", n, grad_bytes), ring("all_gather", n, param_bytes)
        out.item("reduce-scatter", "(N−1)/N·Φ_g", f"({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
        out.item("all-gather", "(N−1)/N·Φ_p", f"({n}−1)/{n} × {gb(param_bytes)}", gb(ag))
        dp_parts += [("reduce-scatter", rs), ("all-gather", ag)]
    elif not s.shards_params:
        n = c.dp
        ar = ring("all_reduce", n, grad_bytes)
        out.note(f"{c.strategy}: the gradients all-reduced once per step: 2Φ "
                 f"({link(dp_inter)}, N = dp = {n})")
        out.item("all-reduce", "2(N−1)/N·Φ_g", f"2({n}−1)/{n} × {gb(grad_bytes)}", gb(ar))
        dp_parts.append(("all-reduce", ar))
        if "broadcast" in s.collectives:
            bc = ring("broadcast", n, 4 * local)
            out.item("broadcast", "(N−1)/N·4Ψ_dp (updated fp32 partitions)",
                     f"({n}−1)/{n} × 4 × {num(local)}", gb(bc))
            dp_parts.append(("broadcast", bc))
    else:
        n = c.shard_size
        shard_inter = n * c.tp > per_node
        units = c.fsdp_unit_params(shape, shape.n_layers) if shape.known and c.pp == 1 else None
        if s.reshard_after_forward:
            kept = per_param * units[-1] / c.tp if units else 0.0
            out.note(f"{c.strategy}: all-gather in forward, again in backward (but the unit kept gathered), "
                     f"reduce-scatter the gradients: 3Φ against DDP's 2Φ ({link(shard_inter)}, N = {n})")
            if units:
                out.item("Φ_kept last unit", f"{per_param}·P_unit/tp",
                         f"{per_param} × {num(units[-1])}/{c.tp}", gb(kept))
            gathered = micro * param_bytes + micro * (param_bytes - kept)
            out.item("all-gathered Φ", "k·Φ_p + k·(Φ_p − Φ_kept), k micro-steps",
                     f"{micro}·{gb(param_bytes)} + {micro}·({gb(param_bytes)} − {gb(kept)})", gb(gathered))
        else:
            gathered = micro * param_bytes
            out.note(f"{c.strategy}: all-gather once per micro-step (kept to backward), reduce-scatter "
                     f"the gradients: 2Φ ({link(shard_inter)}, N = {n})")
            out.item("all-gathered Φ", "k·Φ_p, k micro-steps", f"{micro}·{gb(param_bytes)}", gb(gathered))
        ag, rs = ring("all_gather", n, gathered), ring("reduce_scatter", n, grad_bytes)
        out.item("all-gather", "(N−1)/N·Φ", f"({n}−1)/{n} × {gb(gathered)}", gb(ag))
        out.item("reduce-scatter", "(N−1)/N·Φ_g", f"({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
        dp_parts += [("all-gather", ag), ("reduce-scatter", rs)]
        if s.dp_mesh == "hybrid":
            r = c.replicate_size
            ar = ring("all_reduce", r, grad_bytes / n)
            out.item("all-reduce replicas", "2(R−1)/R·Φ_g/N", f"2({r}−1)/{r} × {gb(grad_bytes)}/{n}", gb(ar))
            dp_parts.append(("all-reduce", ar))
    dp_total = sum(v for _, v in dp_parts)
    _mismatch(out, "data-parallel bytes", dp_total, groups["dp"], gb)
    parts = [("dp", dp_total)]

    if c.tp > 1 and shape.known:
        activation, reductions = tp_reductions(w, c)
        layers = shape.n_layers / c.pp
        ckpt = checkpointed_layers(round(layers), c.activation_checkpointing, c.ac_every)
        per_micro = reductions * ring("all_reduce", c.tp, activation)
        tp_total = per_micro * c.grad_accum
        kinds = "an all-gather + a reduce-scatter each (sequence parallel)" if c.sequence_parallel else \
            "all-reduces"
        out.note(f"tensor parallel ({link(c.tp > per_node)}, {kinds}): per block 2 in forward, "
                 f"2 in backward, "
                 f"+1 per checkpointed block, +{2 if c.pp == 1 else 1} for the embedding/head")
        out.item("Φ_a activation", "s·b·h·e", f"{w.seq_len}·{c.micro_batch}·{shape.d_model}·{w.act_bytes}",
                 gb(activation))
        out.item("reductions", f"4·L/p + c + {2 if c.pp == 1 else 1}",
                 f"4·{num(layers)} + {ckpt} + {2 if c.pp == 1 else 1}", num(reductions))
        out.item("tp bytes", "m × reductions × 2(tp−1)/tp·Φ_a",
                 f"{c.grad_accum} × {num(reductions)} × 2({c.tp}−1)/{c.tp} × {gb(activation)}", gb(tp_total))
        _mismatch(out, "tensor-parallel bytes", tp_total, groups["tp"], gb)
        parts.append(("tp", tp_total))
    if c.pp > 1 and shape.known:
        activation, sends = pp_sends(w, c)
        sent = sends * c.grad_accum * activation
        pp_inter = c.world > per_node and c.dp * c.tp >= per_node
        out.note(f"pipeline ({link(pp_inter)}): each micro-batch's activation forward from each of a rank's "
                 f"v stages, its gradient backward: 2v·m sends ((2v−1)·m when p = 2)")
        out.item("pp bytes", "sends·m·s·b·h·e" + ("/tp" if c.sequence_parallel else ""),
                 f"{sends}·{c.grad_accum}·{w.seq_len}·{c.micro_batch}·{shape.d_model}·{w.act_bytes}"
                 + (f"/{c.tp}" if c.sequence_parallel else ""), gb(sent))
        _mismatch(out, "pipeline bytes", sent, groups["pp"], gb)
        parts.append(("pp", sent))
    counts = ", ".join(f"{g} {n}" for g, n in comm.count_by_group.items()) or "none"
    out.note(f"collectives issued per step (each pays a latency α): {counts}")
    out.check(parts, sum(v for _, v in parts), record["comm_bytes_per_step"], gb)
    return comm, groups


# ---------------------------------------------------------------------------------------------
# step time


def _flops_lines(out: _Out, w) -> float:
    shape, t = w.shape, w.seq_len
    per_token = shape.flops_per_token(t)
    if shape.known:
        matmul = shape.num_params - (0 if shape.tie_embeddings else shape.embedding_params)
        what = "N = Ψ" + ("" if shape.tie_embeddings else " − V·h (the input embedding is a lookup)")
        out.item("N matmul weights", what, None, num(matmul))
        out.item("FLOPs per token", "6N + 12·L·H·Q·T",
                 f"6·{num(matmul)} + 12·{shape.n_layers}·{shape.n_heads}·{shape.head_dim}·{t}",
                 num(per_token))
    else:
        out.item("FLOPs per token", "6N (attention unknown)", f"6·{num(shape.params_only)}", num(per_token))
    return per_token


def _common_tail(out: _Out, w, c: Candidate, busy: float) -> float:
    """Bubble, explained; returns it (steps._bubble)."""
    if c.pp <= 1:
        return 0.0
    v = c.virtual_stages if c.schedule == "interleaved" else 1
    frac = steps.bubble_fraction(c.pp, c.grad_accum, v)
    p, m = c.pp, c.grad_accum
    if v > 1:
        out.item("bubble fraction", "(p−1)/(v·m+p−1) (interleaved)", f"({p}−1)/({v}·{m}+{p}−1)", num(frac))
    else:
        out.item("bubble fraction", "(p−1)/(m+p−1)", f"({p}−1)/({m}+{p}−1)", num(frac))
    bubble = steps._bubble(c, busy)
    out.item("bubble", "busy · b/(1−b)", f"{sec(busy)} × {num(frac)}/(1 − {num(frac)})", sec(bubble))
    return bubble


def _offload_lines(out: _Out, w, c: Candidate, cluster) -> float:
    if c.offload == "none":
        return 0.0
    gpu = cluster.gpu
    local = w.shape.num_params / (c.tp * c.pp * c.shard_size)
    out.item("Ψ offloaded per GPU", "Ψ/(tp·pp·N)",
             f"{num(w.shape.num_params)}/({c.tp}·{c.pp}·{c.shard_size})", num(local))
    link = (4 * local + 2 * local) / (gpu.host_link_gbps * 1e9)
    out.item("host link", "(4Ψ + 2Ψ)/host link (fp32 grads out, 16-bit params in)",
             f"6 × {num(local)} / {num(gpu.host_link_gbps)} GB/s", sec(link))
    rate = cluster.cpu_adam_params_per_s / cluster.gpus_per_node
    adam = local / rate
    out.item("host Adam", "Ψ/(CPU Adam rate per node / GPUs per node)",
             f"{num(local)} / ({num(cluster.cpu_adam_params_per_s)}/{cluster.gpus_per_node})", sec(adam))
    total = link + adam
    if c.offload in ("optimizer-nvme", "nvme"):
        disk = 2 * 12 * local / (cluster.nvme_gbps * 1e9 / cluster.gpus_per_node)
        out.item("NVMe", "2·12Ψ/(NVMe bandwidth / GPUs per node) (optimizer states read and written)",
                 f"24 × {num(local)} / ({num(cluster.nvme_gbps)} GB/s / {cluster.gpus_per_node})", sec(disk))
        total += disk
    mine = steps._offload(w, c, cluster)
    _mismatch(out, "offload", total, mine, sec)
    nvme = " + NVMe" if c.offload in ("optimizer-nvme", "nvme") else ""
    out.item("offload", "host link + host Adam" + nvme, None, sec(total))
    return total


def _recompute_lines(out: _Out, w, c: Candidate, compute: float, gpu=None) -> float:
    recompute = steps._recompute(w, c, compute, gpu)
    if recompute and c.activation_checkpointing == "op" and gpu is not None:
        layers, tokens = math.ceil(w.shape.n_layers / c.pp), w.seq_len * c.micro_batch
        moved = steps.block_elementwise_bytes(w.shape, tokens, c.tp)
        a, b, e = steps.BLOCK_ELEMENTWISE
        out.item("recompute", f"micro-steps × ⌈L/p⌉ × max(4·tokens·({a}h + {b}f/tp + {e}kv/tp)/3 / HBM, "
                 f"{steps.KERNELS_PER_LAYER}/3 launches) (a forward's elementwise work again)",
                 f"{steps.micro_steps(c)} × {layers} × max({gb(moved)}/3 / {num(gpu.hbm_tbps)} TB/s, "
                 f"{steps.KERNELS_PER_LAYER // 3} × {num(gpu.kernel_launch_s)} s)", sec(recompute))
    elif recompute:
        layers = w.shape.n_layers
        ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
        out.item("recompute", "compute/3 × checkpointed/L (a forward again)",
                 f"{sec(compute)}/3 × {ckpt}/{layers}", sec(recompute))
    return recompute


def _catalog_time(out: _Out, record: dict, w, c: Candidate, cluster, comm, groups) -> None:
    gpu = cluster.gpu
    out.section(f"step time on {gpu.name} (catalog: {num(gpu.bf16_tflops)} bf16 TFLOP/s dense, "
                f"HBM {num(gpu.hbm_tbps)} TB/s, links {num(gpu.intra_node_gbps)} GB/s intra / "
                f"{num(gpu.inter_node_gbps)} GB/s inter-node)")
    per_token = _flops_lines(out, w)
    flops = w.tokens_per_step * per_token / c.world
    out.item("FLOPs per GPU", "tokens per step × FLOPs per token / GPUs",
             f"{num(w.tokens_per_step)} × {num(per_token)} / {c.world}", num(flops))
    if cluster.achievable_fraction:
        fraction = cluster.achievable_fraction
        out.item("compute fraction", "--hw achievable_fraction", None, num(fraction))
    else:
        fraction = compute_fraction(gpu, w.shape, c.tp)
        frac_max = FAMILY.get(gpu.name, DEFAULT)[0]
        if w.shape.known:
            d0 = D0_SCALE * gpu.bf16_tflops / gpu.hbm_tbps
            out.item("d0", "D0_SCALE × TFLOP/s ÷ TB/s",
                     f"{D0_SCALE} × {num(gpu.bf16_tflops)} ÷ {num(gpu.hbm_tbps)}", num(d0))
            out.item("compute fraction", "frac_max · h/(h + d0) (plan/efficiency.py, fitted)",
                     f"{frac_max} × {shape_d(w)}/({shape_d(w)} + {num(d0)})", num(fraction))
        else:
            out.item("compute fraction", "frac_max (the family's large-model fraction)", None, num(fraction))
    compute = flops / (gpu.bf16_tflops * 1e12 * fraction)
    out.item("compute", "FLOPs / (peak × fraction)",
             f"{num(flops)} / ({num(gpu.bf16_tflops)}e12 × {num(fraction)})", sec(compute))
    if w.shape.known:
        layers = math.ceil(w.shape.n_layers / c.pp)
        floor = steps.micro_steps(c) * layers * steps.KERNELS_PER_LAYER * gpu.kernel_launch_s
        out.item("kernel-launch floor", "micro-steps × ⌈L/p⌉ × kernels per block × launch",
                 f"{steps.micro_steps(c)} × {layers} × {steps.KERNELS_PER_LAYER} × "
                 f"{num(gpu.kernel_launch_s)} s",
                 sec(floor))
        if floor > compute:
            out.note(f"  compute = the floor, {sec(floor)} (the launches take longer than the FLOPs)")
        compute = max(compute, floor)
    recompute = _recompute_lines(out, w, c, compute, gpu)
    busy = compute + recompute
    bubble = _common_tail(out, w, c, busy)

    efficiency = cluster.comm_efficiency or link_efficiency(gpu)
    out.note(f"exposed communication: bytes / (link × efficiency {num(efficiency)}) + α × count (α "
             f"{num(gpu.intra_node_latency_s)} s intra-node, {num(gpu.inter_node_latency_s)} s inter-node)")

    def seconds(what: str, sent: float, inter: bool, group: str) -> float:
        bw = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * efficiency
        latency = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
        count = comm.count_by_group.get(group, 0) if group != "broadcast" else 0
        t = sent / bw + latency * count
        if sent or count:
            link = gpu.inter_node_gbps if inter else gpu.intra_node_gbps
            out.item(what, "Φ_sent/(link × eff) + α × count",
                     f"{gb(sent)}/({num(link)} GB/s × {num(efficiency)}) + {num(latency)} × {count}", sec(t))
        return t

    dp_inter = c.dp * c.tp > cluster.gpus_per_node
    shard_inter = c.shard_size * c.tp > cluster.gpus_per_node
    broadcast = comm.by_kind.get("broadcast", 0.0) if w.recipe == "torch" else 0.0
    dp_bytes = groups["dp"] - broadcast
    dp_link = shard_inter if c.strategy_info.shards_params else dp_inter
    hidden = seconds("data parallel", dp_bytes, dp_link, "dp")
    dp_exposed = max(0.0, hidden - busy)
    out.item("dp exposed", "max(0, dp − (compute + recompute)) (overlapped)",
             f"max(0, {sec(hidden)} − {sec(busy)})", sec(dp_exposed))
    parts = [("dp", dp_exposed)]
    if broadcast:
        parts.append(("broadcast", seconds("ZeRO-1 broadcast", broadcast, dp_inter, "broadcast")))
    if groups["tp"] or comm.count_by_group.get("tp"):
        parts.append(("tp", seconds("tensor parallel", groups["tp"], False, "tp")))
    pp_inter = c.world > cluster.gpus_per_node and c.dp * c.tp >= cluster.gpus_per_node
    if groups["pp"] or comm.count_by_group.get("pp"):
        parts.append(("pp", seconds("pipeline", groups["pp"], pp_inter, "pp")))
    exposed = sum(v for _, v in parts)
    out.item("comm exposed", " + ".join(n for n, _ in parts), " + ".join(sec(v) for _, v in parts),
             sec(exposed))

    optimizer = 0.0
    if c.offload == "none":
        local = steps.local_params(w, c)
        optimizer = (steps.ADAM_BYTES + steps.CLIP_BYTES) * local / (gpu.hbm_tbps * 1e12)
        out.item("Ψ stepped per rank", "Ψ_stage/tp/N", None, num(local))
        out.item("optimizer", "(28 Adam + 12 clip bytes)·Ψ/HBM",
                 f"40 × {num(local)} / {num(gpu.hbm_tbps)} TB/s", sec(optimizer))
    offload = _offload_lines(out, w, c, cluster)
    _finish(out, record, compute, recompute, bubble, exposed, optimizer, offload)


def shape_d(w) -> str:
    return str(w.shape.d_model)


def _finish(out: _Out, record: dict, compute, recompute, bubble, exposed, optimizer, offload) -> None:
    t = record["step_time_breakdown_s"]
    for what, mine in (("compute", compute), ("recompute", recompute), ("bubble", bubble),
                       ("comm_exposed", exposed), ("optimizer", optimizer), ("offload", offload)):
        _mismatch(out, what, mine, t[what], sec)
    parts = [("compute", compute), ("recompute", recompute), ("bubble", bubble), ("comm exposed", exposed),
             ("optimizer", optimizer), ("offload", offload)]
    out.check(parts, sum(v for _, v in parts), record["step_time_s"], sec)


def _throughput(out: _Out, record: dict, w, c: Candidate, cluster) -> None:
    t = record["step_time_s"]
    out.item("tokens/s", "tokens per step / step time", f"{num(w.tokens_per_step)} / {sec(t)}",
             num(round(record["tokens_per_s"])))
    flops = w.tokens_per_step * w.shape.flops_per_token(w.seq_len)
    peak = cluster.gpu.bf16_tflops
    out.item("MFU", "FLOPs per step / (step time × GPUs × peak)",
             f"{num(flops)} / ({sec(t)} × {c.world} × {num(peak)}e12)", f"{record['mfu']:.1%}")


def _measured_time(out: _Out, record: dict, w, c: Candidate, cluster, comm) -> None:
    profile, ranks, shape = cluster.profile, cluster.gpus_per_node, w.shape
    out.section(f"step time on the measured device ({profile.describe()}; rates for {ranks} rank(s) at once)")
    tokens = w.seq_len * c.micro_batch
    bandwidth = profile.elementwise_bytes(ranks, tokens * max(shape.d_model, 1) * 4)
    overhead = profile.op_overhead(ranks)
    out.item("memory bandwidth", "measured elementwise rate at a tensor of s·b·h·4 bytes", None,
             f"{num(bandwidth / 1e9)} GB/s")
    out.item("op overhead", "measured fixed cost per op", None, sec(overhead))
    if shape.known:
        d, tp, kv, f = shape.d_model, c.tp, shape.kv_dim, shape.ffn_hidden
        out.note(f"one block, one micro-batch of s·b = {tokens} tokens: each linear 6·tokens·in·out / its "
                 f"measured rate")
        names = ("q", "k", "v", "o", "gate", "up", "down")
        linears = [(d, d / tp), (d, kv / tp), (d, kv / tp), (d / tp, d),
                   (d, f / tp), (d, f / tp), (f / tp, d)]
        layer = 0.0
        for name, (k, n) in zip(names, linears):
            rate = profile.linear_flops(ranks, tokens, k, n)
            t = 6 * tokens * k * n / rate
            out.item(f"linear {name}", "6·tokens·in·out / rate",
                     f"6·{tokens}·{num(k)}·{num(n)} / {num(rate / 1e12)} TFLOP/s", sec(t))
            layer += t
        attention = 12 * (shape.n_heads / tp) * shape.head_dim * w.seq_len * tokens
        rate = profile.attention_flops(ranks, w.seq_len, shape.head_dim)
        t = attention / rate
        out.item("attention", "12·(H/tp)·Q·T·tokens / rate",
                 f"12·{num(shape.n_heads / tp)}·{shape.head_dim}·{w.seq_len}·{tokens} / "
                 f"{num(rate / 1e12)} TFLOP/s",
                 sec(t))
        layer += t
        a, b, e = steps.BLOCK_ELEMENTWISE
        block_bandwidth = profile.block_elementwise_bytes(ranks, tokens * d * 4)
        moved = 4 * tokens * (a * d + b * f / tp + e * kv / tp)
        t = moved / block_bandwidth
        out.item("elementwise", f"4·tokens·({a}h + {b}f/tp + {e}kv/tp) / block bandwidth",
                 f"{gb(moved)} / {num(block_bandwidth / 1e9)} GB/s", sec(t))
        layer += t
        out.item("block", "linears + attention + elementwise", None, sec(layer))
        in_situ = profile.block_in_situ(ranks, tokens * d * 4)
        if in_situ != 1.0:
            out.item("block as run", "block × in-situ factor (two blocks run whole ÷ their parts, measured)",
                     f"{sec(layer)} × {num(in_situ)}", sec(layer * in_situ))
            layer *= in_situ
        layers = layers_of_stage(shape.n_layers, 0, c.pp)
        last_layers = layers_of_stage(shape.n_layers, c.pp - 1, c.pp)
        vocab = shape.vocab_size / tp
        head_rate = profile.linear_flops(ranks, tokens, d, vocab)
        head = 6 * tokens * d * vocab / head_rate
        head += steps.LOSS_PASSES * 4 * tokens * vocab / bandwidth
        out.item("head + loss", f"6·tokens·h·V/tp / rate + {steps.LOSS_PASSES}·4·tokens·V/tp / bandwidth",
                 f"6·{tokens}·{d}·{num(vocab)} / {num(head_rate / 1e12)} TFLOP/s + "
                 f"{steps.LOSS_PASSES}·4·{tokens}·{num(vocab)} / {num(bandwidth / 1e9)} GB/s", sec(head))
        embedding = 2 * 4 * shape.vocab_size * d / tp / bandwidth
        out.item("embedding backward", "2·4·V·h/tp / bandwidth (a dense [V, h] gradient)",
                 f"8·{shape.vocab_size}·{d}/{tp} / {num(bandwidth / 1e9)} GB/s", sec(embedding))
        first = layers * layer + (embedding if c.pp > 1 else 0.0)
        last = last_layers * layer + head + (embedding if c.pp == 1 else 0.0)
        heaviest = max(first, last)
        if c.pp > 1:
            out.item("heaviest stage", "max(L_0·block + embedding, L_last·block + head)",
                     f"max({layers}·{sec(layer)} + {sec(embedding)}, "
                     f"{last_layers}·{sec(layer)} + {sec(head)})",
                     sec(heaviest))
        else:
            out.item("one micro-step", "L·block + head + embedding",
                     f"{layers}·{sec(layer)} + {sec(head)} + {sec(embedding)}", sec(heaviest))
        compute = steps.micro_steps(c) * heaviest
        out.item("compute", "micro-steps × that", f"{steps.micro_steps(c)} × {sec(heaviest)}", sec(compute))
        ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
        recompute = steps.micro_steps(c) * ckpt * layer / 3
        if recompute and c.activation_checkpointing == "op":  # the block's elementwise part only
            recompute = steps.micro_steps(c) * ckpt * t * in_situ / 3
            out.item("recompute", "micro-steps × checkpointed blocks × elementwise × in-situ/3",
                     f"{steps.micro_steps(c)} × {ckpt} × {sec(t)} × {num(in_situ)}/3", sec(recompute))
        elif recompute:
            out.item("recompute", "micro-steps × checkpointed blocks × block/3",
                     f"{steps.micro_steps(c)} × {ckpt} × {sec(layer)}/3", sec(recompute))
    else:
        per_token = _flops_lines(out, w)
        peak = profile.peak_flops(ranks)
        compute = w.tokens_per_step * per_token / c.world / peak
        out.item("compute", "tokens × FLOPs per token / GPUs / best measured rate",
                 f"{num(w.tokens_per_step)} × {num(per_token)} / {c.world} / {num(peak / 1e12)} TFLOP/s",
                 sec(compute))
        recompute = 0.0
    busy = compute + recompute
    bubble = _common_tail(out, w, c, busy)
    out.note("collectives at their measured α·count + payload/β, plus copying the payload in and out "
             "(2·payload at the bandwidth measured for one collective's size); nothing overlaps")
    parts = []
    for kind, payload in comm.payload_by_kind.items():
        kind = "send" if kind == "recv" else kind
        n = steps._count(comm, kind, payload)
        copy_bw = profile.elementwise_bytes(ranks, payload / max(n, 1))
        t = profile.collective_seconds(ranks, kind, payload, n) + 2 * payload / copy_bw
        fits = profile.ranks_entry(ranks)["collectives"]
        fit = fits.get(kind) or fits.get("all_gather" if kind == "broadcast" else "all_reduce")
        numbers = (f"{num(fit['alpha_s'])} s × {n} + {gb(payload)} / {num(fit['bytes_per_s'] / 1e9)} GB/s + "
                   f"2 × {gb(payload)} / {num(copy_bw / 1e9)} GB/s") if fit else None
        out.item(kind, "α·count + payload/β + 2·payload/bandwidth", numbers, sec(t))
        parts.append(t)
    if c.world > 1:
        t = profile.collective_seconds(ranks, "all_reduce", 8, 2)
        out.item("loop all-reduces", "2·α + 8 bytes/β (mean loss, grad norm)", None, sec(t))
        parts.append(t)
    if not c.strategy_info.shards_params and c.dp > 1:
        grads = 4 * steps.local_params(w, c) * c.shard_size
        copy_bw = profile.elementwise_bytes(ranks, min(grads, steps.DDP_BUCKET))
        t = 4 * grads / copy_bw
        out.item("bucket copies", "4·(4Ψ)/bandwidth (gradients into DDP's buckets and back, read + write)",
                 f"4 × {gb(grads)} / {num(copy_bw / 1e9)} GB/s", sec(t))
        parts.append(t)
    exposed = sum(parts)
    out.item("comm exposed", "sum of the above", None, sec(exposed))
    local = steps.local_params(w, c)
    optimizer = profile.optimizer_seconds(ranks, local)
    if optimizer is not None:
        out.item("optimizer", "Ψ_local × measured clipping + AdamW seconds per parameter",
                 f"{num(local)} × {num(optimizer / local)} s", sec(optimizer))
    else:
        big = profile.elementwise_bytes(ranks, 4 * local)
        ops = 2 * (shape.n_layers if shape.known else 1) * 9 // max(c.pp, 1)
        optimizer = (steps.ADAM_BYTES + steps.CLIP_BYTES) * local / big + 2 * overhead * ops
        out.item("optimizer", "40·Ψ/bandwidth + 2·overhead·(2·L·9/p) (per-tensor ops)",
                 f"40 × {num(local)} / {num(big / 1e9)} GB/s + 2 × {sec(overhead)} × {ops}", sec(optimizer))
    offload = _offload_lines(out, w, c, cluster)
    _finish(out, record, compute, recompute, bubble, exposed, optimizer, offload)
