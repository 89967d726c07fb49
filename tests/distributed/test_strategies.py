"""Every data-parallel strategy against a single-process reference, on spawned gloo ranks.

Same global batch, same seed: per-step losses, gradient norms and the final gathered weights must
match the plain loop within 1e-5 relative; measured model-state bytes must match the strategy's
formula; a step's gradient collectives are DDP's one sync per optimizer step and FSDP2's one per
micro-step (grad_accum = 2; once per step under reduce_every_micro_step = false). The tiny
model is one FSDP2 unit at the default parallel.fsdp_unit_mb (25 MB), where zero2 and zero3 hold
the same: the `units` cases (fsdp_unit_mb = 0) give the embedding, each block and norm + head their
own unit.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from loom.config import Config, load_config
from loom.data.loader import GlobalBatchSampler, split_train_eval
from loom.models.gpt.model import build_model
from loom.plan.memory import model_state_bytes
from loom.train.driver import train
from loom.train.optim import lr_lambda, param_groups
from loom.train.task import load_data, model_config

STEPS, BATCH, ACCUM, SEQ = 4, 8, 2, 32
RTOL = 1e-5


def make_config(corpus: Path, strategy: str, *extra: str) -> Config:
    return load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', f"data.seq_len={SEQ}", "data.num_workers=0",
        "data.eval_fraction=0.05", f"train.steps={STEPS}", f"train.batch_size={BATCH}",
        f"train.grad_accum={ACCUM}", "train.warmup_steps=2", "train.lr=1e-2", "train.seed=3",
        "train.eval_batches=1", f"parallel.strategy={strategy}", *extra,
    ])


def _next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def reference(cfg: Config, task=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain single-process loop: no wrappers, no process group. `task` brings another model.
    Returns the per-step losses and the final weights (`reference_run`: the gradient norms too)."""
    losses, _, state = reference_run(cfg, task)
    return losses, state


def reference_run(cfg: Config, task=None, loss_fn=None, prepare=None, after_step=None,
                  optimizers=None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The plain loop's per-step losses, gradient norms (before clipping) and final weights. With
    loom's GPT: `loss_fn(model, batch)` instead of the loss on its full logits, `prepare(model)` once
    built, `after_step(model)` after each optimizer step. `optimizers(model, train_config)`: the
    optimizers to step instead of AdamW (each with the LR schedule)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    if task is None:
        tokens, vocab = load_data(cfg)
        train_set, _ = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
        model = build_model(model_config(cfg, vocab), device="cpu")
        model.init_weights(t.seed)
        loss_fn = loss_fn or _next_token_loss
        if prepare is not None:
            prepare(model)
    else:
        train_set, loss_fn = task.train_data, task.loss_fn
        torch.manual_seed(t.seed)
        model = task.model_fn()
    sampler = GlobalBatchSampler(len(train_set), t.batch_size, 0, 1, t.grad_accum, t.seed, num_steps=t.steps)
    opts = optimizers(model, t) if optimizers is not None else [torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t)) for opt in opts]
    micro_batches = iter(sampler)
    losses, norms = [], []
    for _ in range(t.steps):
        for opt in opts:
            opt.zero_grad()
        total = 0.0
        for _ in range(t.grad_accum):
            batch = torch.stack([train_set[i] for i in next(micro_batches)])
            loss = loss_fn(model, batch)
            (loss / t.grad_accum).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip).item())
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()
        if after_step is not None:
            after_step(model)
        losses.append(total / t.grad_accum)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_train(cfg: Config):
    r = train(cfg, None, return_state=True, quiet=True)
    return r.losses, r.state_dict, r.memory, r.grad_norms


@functools.cache
def _run(corpus: Path, strategy: str, world: int, extra: tuple[str, ...] = ()):
    return run_ranks(_rank_train, world, make_config(corpus, strategy, *extra))


@functools.cache
def _reference_run(corpus: Path, extra: tuple[str, ...] = ()):
    return reference_run(make_config(corpus, "ddp", *extra))


def _reference(corpus: Path, extra: tuple[str, ...] = ()):
    losses, _, state = _reference_run(corpus, extra)
    return losses, state


def _reference_norms(corpus: Path, extra: tuple[str, ...] = ()) -> list[float]:
    return _reference_run(corpus, extra)[1]


def assert_matches_reference(results, ref_losses, ref_state, ref_norms=None) -> None:
    """`results`: per rank (losses, state, memory[, grad norms]); the norms are compared when
    `ref_norms` is given (a loss scaled wrong, or a norm taken on one rank's shard, shows there:
    Adam and clipping would hide it from the weights)."""
    for rank, (losses, state, *rest) in enumerate(results):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        assert len(losses) == STEPS and max(rel) < RTOL, f"rank {rank} losses {losses} vs {ref_losses}"
        if ref_norms is not None:
            norms = rest[1]
            rel = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
            assert len(norms) == STEPS and max(rel) < RTOL, f"rank {rank} grad norms {norms} vs {ref_norms}"
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            err = (state[name] - ref).norm() / ref.norm()
            assert err < RTOL, f"rank {rank} {name}: relative error {err:.2e}"
    # The weights must actually have moved: a no-op run would pass the comparison above trivially.
    assert ref_losses[-1] < ref_losses[0]


UNITS = "parallel.fsdp_unit_mb=0"  # a unit per block (and the embedding, norm + head)
HSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=2")
ONCE = "parallel.reduce_every_micro_step=false"  # FSDP2 syncs on the last micro-step only
CASES = [("ddp", 2, ()), ("zero1", 2, ()), ("zero2", 2, ()), ("zero3", 2, ()), ("hsdp", 4, HSDP),
         ("zero2", 2, (UNITS,)), ("zero3", 2, (UNITS,)), ("hsdp", 4, (*HSDP, UNITS)),
         ("zero3", 2, (UNITS, ONCE))]
CASE_IDS = [s + ("-units" if UNITS in extra else "") + ("-once" if ONCE in extra else "")
            for s, _, extra in CASES]


def grad_syncs_per_step(strategy: str, extra: tuple[str, ...]) -> dict[str, int]:
    """A step's all-reduces and reduce-scatters, by hand: DDP (ddp, zero1) all-reduces its one bucket
    once per step (no_sync on the other micro-step; the tiny model's 0.5 MB is under DDP's first,
    1 MB bucket); FSDP2 reduce-scatters each unit (1, or 4 with `units`) on each of the ACCUM
    micro-steps, so that the gradients stay sharded (once per step under reduce_every_micro_step =
    false), and hsdp all-reduces it across the replicas too. The loop adds the mean loss's
    all-reduce, and under FSDP2 the gradient norm's (over shards)."""
    if strategy in ("ddp", "zero1"):
        return {"all_reduce": 1 + 1}
    units = (4 if UNITS in extra else 1) * (1 if ONCE in extra else ACCUM)
    return {"reduce_scatter": units, "all_reduce": (units if strategy == "hsdp" else 0) + 2}


@pytest.mark.parametrize("strategy,world,extra", CASES, ids=CASE_IDS)
def test_strategy_matches_single_process(corpus, strategy, world, extra):
    ref_losses, ref_state = _reference(corpus)
    results = _run(corpus, strategy, world, extra)
    assert_matches_reference(results, ref_losses, ref_state, _reference_norms(corpus))
    # The collectives of step 2, as each rank observed them (CollectiveCounter in the driver).
    want = grad_syncs_per_step(strategy, extra)
    for rank, m in enumerate(results[0][2]):
        got = {kind: m["comm_by_kind"].get(kind, {}).get("count", 0) for kind in want}
        assert got == want, (rank, m["comm_by_kind"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_same_losses_lower_peak(corpus, mode):
    extra = (f"parallel.activation_checkpointing={mode}", "parallel.ac_every=2")
    ref_losses, ref_state = _reference(corpus)
    with_ac = _run(corpus, "zero3", 2, extra)
    assert_matches_reference(with_ac, ref_losses, ref_state)
    plain = _run(corpus, "zero3", 2)
    # every rank returns the gathered per-rank memory list; take rank 0's copy
    peaks_ac = [m["peak_bytes"] for m in with_ac[0][2]]
    peaks_plain = [m["peak_bytes"] for m in plain[0][2]]
    assert all(a < 0.95 * p for a, p in zip(peaks_ac, peaks_plain)), (peaks_ac, peaks_plain)
    if mode == "selective":  # block 0 of the 2 checkpointed, block 1's kept: full's peak is below
        # (0.99 of it: the lean block's activations are small beside this tiny model's other peaks;
        # selective checkpointing every block instead would make the two equal)
        full = _run(corpus, "zero3", 2, ("parallel.activation_checkpointing=full", "parallel.ac_every=2"))
        peaks_full = [m["peak_bytes"] for m in full[0][2]]
        assert all(f < a for f, a in zip(peaks_full, peaks_ac)), (peaks_full, peaks_ac)


TP_CASES = [("zero3", 2, ("parallel.tp=2",)),
            ("zero3", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
            ("zero3", 4, ("parallel.tp=2",)),
            ("ddp", 4, ("parallel.tp=2", "parallel.activation_checkpointing=full")),
            ("hsdp", 4, ("parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1")),
            ("zero1", 4, ("parallel.tp=2",))]
TP_IDS = ["tp2", "tp2-sp", "tp2xzero3-dp2", "tp2xddp-dp2-ac", "tp2xhsdp-2x1", "tp2xzero1-dp2"]


@pytest.mark.parametrize("strategy,world,extra", TP_CASES, ids=TP_IDS)
def test_tensor_parallel_matches_single_process(corpus, strategy, world, extra):
    ref_losses, ref_state = _reference(corpus)
    results = _run(corpus, strategy, world, extra)
    assert_matches_reference(results, ref_losses, ref_state, _reference_norms(corpus))
    # TP divides every split parameter by tp (and FSDP then by dp): the formula within 1%.
    memory = results[0][2]
    shard = {"zero3": world // 2, "ddp": 1, "hsdp": 1, "zero1": world // 2}[strategy]
    replicated = (2 * 2 + 1) * 64  # tiny preset: the norms' gains stay whole
    expected = model_state_bytes(strategy, memory[0]["num_params"], shard, tp=2, tp_replicated=replicated)
    for m in memory:
        assert abs(m["model_state_bytes"] - expected.total) <= 0.01 * expected.total, (m, expected)


PP_CASES = [
    ("zero3", 2, ("parallel.pp=2", "parallel.pp_schedule=gpipe")),
    ("zero3", 2, ("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4")),
    ("zero3", 2, ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
                  "model.n_layers=4")),
    ("ddp", 4, ("parallel.pp=2",)),
    ("zero1", 4, ("parallel.pp=2", "parallel.pp_schedule=gpipe")),
    ("zero3", 4, ("parallel.pp=2", "parallel.tp=2")),
    # sequence parallel: a later stage's input is its 1/tp of each sequence (RoPE over the whole)
    ("zero3", 4, ("parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true")),
    ("zero3", 8, ("parallel.pp=2", "parallel.tp=2")),
    ("zero2", 2, ("parallel.pp=2", "parallel.activation_checkpointing=full")),
]
PP_IDS = ["pp2-gpipe", "pp2-1f1b-m4", "pp2-interleaved", "pp2xddp-dp2", "pp2xzero1-dp2", "pp2xtp2",
          "pp2xtp2-sp", "pp2xdp2xtp2", "pp2-zero2-ac"]


@pytest.mark.parametrize("strategy,world,extra", PP_CASES, ids=PP_IDS)
def test_pipeline_parallel_matches_single_process(corpus, strategy, world, extra):
    """Each rank holds its stage(s) only; together they equal the single-process model."""
    model_extra = tuple(e for e in extra if e.startswith("model."))
    ref_losses, ref_state = _reference(corpus, model_extra)
    results = _run(corpus, strategy, world, extra)
    merged = {}
    for _, state, _, _ in results:
        merged.update(state)
    # The gradient norm adds every stage's squares (the pp group): each rank reports the whole model's.
    assert_matches_reference([(losses, merged, mem, norms) for losses, _, mem, norms in results], ref_losses,
                             ref_state, _reference_norms(corpus, model_extra))
    tp = 2 if "parallel.tp=2" in extra else 1
    dp = world // (2 * tp)
    for rank, (_, state, memory, _) in enumerate(results):
        assert len(state) < len(ref_state)  # a stage, not the whole model
        stage_params = sum(ref_state[name].numel() for name in state)
        replicated = (sum(ref_state[name].numel() for name in state if ref_state[name].ndim == 1) if tp > 1
                      else 0)
        expected = model_state_bytes(strategy, stage_params, dp, tp=tp,
                                     tp_replicated=replicated)
        got = memory[rank]["model_state_bytes"]
        assert abs(got - expected.total) <= 0.01 * expected.total, (rank, got, expected)
        # the step's peak is measured under a pipeline too: model states plus activations
        assert memory[rank]["peak_bytes"] > got, memory[rank]
        # Each micro-step runs parallel.microbatches (default pp) micro-batches through the stages:
        # every boundary between two stages carries one activation forward and one gradient back
        # per micro-batch, and 2 ranks share the pp·v − 1 boundaries' sends.
        m = int(next((e.split("=")[1] for e in extra if e.startswith("parallel.microbatches=")), 2))
        v = 2 if "parallel.pp_virtual_stages=2" in extra else 1
        assert memory[rank]["comm_by_kind"]["send"]["count"] == (2 * v - 1) * m * ACCUM, memory[rank]


MEMORY_CASES = [(s, n, ()) for s in ("ddp", "zero1", "zero2", "zero3") for n in (2, 4)] + [
    ("hsdp", 4, HSDP), ("zero2", 2, (UNITS,)), ("zero3", 2, (UNITS,))]
MEMORY_IDS = [f"{s}-{n}" + ("-units" if UNITS in extra else "") for s, n, extra in MEMORY_CASES]


@pytest.mark.parametrize("strategy,world,extra", MEMORY_CASES, ids=MEMORY_IDS)
def test_model_state_bytes_match_formula(corpus, strategy, world, extra):
    """params, grads and optimizer bytes held per rank = 16Ψ, 8Ψ+8Ψ/N, 16Ψ/N, ... (within 1%)."""
    memory = _run(corpus, strategy, world, extra)[0][2]
    shard = 2 if strategy == "hsdp" else world
    num_params = memory[0]["num_params"]
    expected = model_state_bytes(strategy, num_params, shard)
    for rank, m in enumerate(memory):
        assert m["num_params"] == num_params
        for part, want in (("params_bytes", expected.params), ("grads_bytes", expected.grads),
                           ("optimizer_bytes", expected.optimizer)):
            assert abs(m[part] - want) <= 0.01 * want, f"rank {rank} {part}: {m[part]} vs {want:.0f}"
        assert abs(m["model_state_bytes"] - expected.total) <= 0.01 * expected.total


def _grad_collectives(strategy: str) -> list[dict[str, int]]:
    """Collectives issued by one backward with gradient sync off, then on."""
    from torch.distributed.tensor.debug import CommDebugMode

    from loom.config import validate
    from loom.models.gpt.config import preset
    from loom.models.registry import adapter_for
    from loom.parallel.apply import gradient_sync, parallelize
    from loom.parallel.mesh import init_distributed

    cfg = load_config(None, ["model.preset=tiny", f"parallel.strategy={strategy}"])
    d = init_distributed(lambda world: validate(cfg, world))
    model = build_model(preset("tiny"))
    model = parallelize(model, cfg, d, adapter_for(model))[0]
    counts = []
    for enabled in (False, True):
        batch = torch.randint(0, 256, (2, 17))
        with CommDebugMode() as comm, gradient_sync(model, enabled):
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        counts.append({str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()})
    return counts


@pytest.mark.parametrize("strategy,reduce_op", [("ddp", "allreduce_"), ("zero2", "_reduce_scatter_base_")])
def test_no_gradient_sync_on_non_final_micro_steps(strategy, reduce_op):
    off, on = run_ranks(_grad_collectives, 2, strategy)[0]
    assert off.get(reduce_op, 0) == 0, off
    assert on.get(reduce_op, 0) >= 1, on


PRECISION_CASES = [("zero3", "bf16", 2, ()), ("ddp", "bf16", 2, ()), ("zero1", "bf16", 2, ()),
                   ("hsdp", "bf16", 4, HSDP), ("zero2", "fp16", 2, ()), ("ddp", "fp16", 2, ())]
_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _rank_train_counting_matmul_dtypes(cfg: Config):
    """Train, recording the dtype of the inputs of every matrix multiply the step runs (forward
    and backward), as the kernels see them: below autocast and FSDP's parameter casts; the dtypes
    the gradient collectives (all-reduce, reduce-scatter) carry; and each loss-scaler unscale: the
    scale, and the gradient norm before and after it."""
    from collections import Counter

    from torch.amp import GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.observe.collectives import CollectiveCounter
    from loom.train.optim import clip_grad_norm

    seen: Counter = Counter()
    unscales: list[tuple[float, float, float]] = []

    class MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _MATMULS:
                seen[str(args[-1].dtype).removeprefix("torch.")] += 1
            return func(*args, **(kwargs or {}))

    def recorded(unscale):
        def unscale_(self, optimizer):
            params = [q for g in optimizer.param_groups for q in g["params"]]
            before = clip_grad_norm(params, 0.0).item()  # max_norm 0: the norm, nothing clipped
            unscale(self, optimizer)
            unscales.append((self.get_scale(), before, clip_grad_norm(params, 0.0).item()))
        return unscale_

    for scaler in (GradScaler, ShardedGradScaler):  # FSDP2's has an unscale_ of its own
        scaler.unscale_ = recorded(scaler.unscale_)
    with MatmulDtypes(), CollectiveCounter() as comm:
        losses = train(cfg, None, quiet=True).losses
    # floating point ones: the run's integer all-reduces are its ranks agreeing (stop, checkpoint)
    reduced = sorted({r["dtype"] for r in comm.records
                      if r["kind"] in ("all_reduce", "reduce_scatter") and "float" in r["dtype"]})
    return losses, dict(seen), reduced, unscales


@pytest.mark.parametrize("strategy,precision,world,extra", PRECISION_CASES,
                         ids=[f"{s}-{p}" for s, p, _, _ in PRECISION_CASES])
def test_mixed_precision_computes_in_low_precision_and_tracks_fp32(corpus, strategy, precision, world, extra):
    """The matmuls really run in bf16/fp16 (a run that silently stayed in fp32 fails), gradients
    are reduced in fp32 (FSDP2's reduce_dtype; DDP's fp32 gradients under autocast), fp16 scales
    its loss, and the losses stay within what low precision costs on this model (measured 1e-4 to
    6e-4 relative)."""
    ref_losses, _ = _reference(corpus)
    cfg = make_config(corpus, strategy, f"train.precision={precision}", *extra)
    losses, dtypes, reduced, unscales = run_ranks(_rank_train_counting_matmul_dtypes, world, cfg)[0]
    low = dtypes.get(precision.replace("bf16", "bfloat16").replace("fp16", "float16"), 0)
    assert low >= 0.95 * sum(dtypes.values()) and low > 0, dtypes
    assert reduced == ["float32"], reduced
    if precision == "fp16":
        # One unscale a step, at GradScaler's initial 2^16 (no overflow in 4 steps, no growth before
        # 2000): the backward ran on the scaled loss, so its gradients were 2^16 times the true ones.
        assert [scale for scale, _, _ in unscales] == [2.0**16] * STEPS, unscales
        for scale, before, after in unscales:
            assert before == pytest.approx(scale * after, rel=1e-5), unscales
    else:
        assert unscales == [], unscales  # bf16 keeps fp32's exponent range: nothing to scale
    drift = [abs(a - b) / b for a, b in zip(losses, ref_losses)]
    assert 1e-6 < max(drift) < 2e-3, (drift, losses, ref_losses)
    assert losses[-1] < losses[0]


def test_fp32_runs_every_matmul_in_fp32(corpus):
    cfg = make_config(corpus, "zero3")
    _, dtypes, reduced, unscales = run_ranks(_rank_train_counting_matmul_dtypes, 2, cfg)[0]
    assert set(dtypes) == {"float32"} and dtypes["float32"] > 0, dtypes
    assert reduced == ["float32"] and unscales == [], (reduced, unscales)


def _rank_eval(cfg: Config) -> float | None:
    return train(cfg, None, quiet=True).eval_loss


def test_pipelined_eval_equals_unpipelined(corpus):
    """Forward-only through the stages gives the same held-out loss as the whole model."""
    plain = run_ranks(_rank_eval, 2, make_config(corpus, "zero3"))
    piped = run_ranks(_rank_eval, 2, make_config(corpus, "zero3", "parallel.pp=2"))
    assert plain[0] is not None and plain[0] > 0
    assert all(abs(x - plain[0]) / plain[0] < 1e-5 for x in plain + piped), (plain, piped)
