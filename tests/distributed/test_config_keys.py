"""Config keys whose effect is not in the losses: each test asserts what the key changes (compiled
blocks, FSDP prefetch, resharding and the parameters gathered between forward and backward, units,
activation checkpointing's blocks and recomputation, bf16's gather and reduce dtypes, DDP buckets,
eval points, profiler stacks), so a key that were silently ignored would fail here.

Two spawned runs cover the structural cases, as spawning costs more than the cases: one on 2 gloo
ranks parallelizes a 4-block GPT under each setting; one on a single rank trains a few steps per
setting (eval, profiler).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
from pathlib import Path

import pytest
import test_strategies as S
import torch
import torch.nn.functional as F
from distributed import run_ranks

N_LAYERS = 4  # blocks enough for prefetch depths 1-3 to differ


def _parallelized(*overrides: str):
    from loom.config import load_config, validate
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model
    from loom.models.registry import adapter_for
    from loom.parallel.apply import parallelize
    from loom.parallel.mesh import init_distributed

    # One FSDP unit per block unless a case sets parallel.fsdp_unit_mb (the tiny blocks would group)
    cfg = load_config(None, ["model.preset=tiny", "parallel.fsdp_unit_mb=0", *overrides])
    d = init_distributed(lambda world: validate(cfg, world))
    model = build_model(preset("tiny", n_layers=N_LAYERS))
    return parallelize(model, cfg, d, adapter_for(model))[0]


def _loss(model) -> torch.Tensor:
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (2, 17))
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _all_gathers(comm) -> int:
    return sum(r["kind"] == "all_gather" for r in comm.records)


def _fsdp_groups(model) -> list:
    """The FSDP2 param group of every unit that holds parameters, in module order (a unit of
    several modules, norm + head, once)."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return list({id(g): g for g in groups if g is not None}.values())


def _gathered_bytes(model) -> int:
    """Bytes of unsharded (all-gathered) parameters the units hold now: FSDP2 frees a resharded
    unit's storage (size 0), so what is left allocated is what is gathered."""
    from loom.observe.rank_memory import storage_bytes

    return storage_bytes(getattr(fp, "_unsharded_param", None) for g in _fsdp_groups(model)
                         for fp in g.fsdp_params)


def _rank_structure() -> dict:
    """On each rank: what parallelize built under each setting, and the collectives it issues."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from loom.observe.collectives import CollectiveCounter

    out: dict = {}
    for flag in ("false", "true"):
        model = _parallelized("parallel.strategy=zero3", f"train.compile={flag}")
        out[f"compile={flag}"] = {"compiled": [b._compiled_call_impl is not None for b in model.layers],
                                  "names": [n for n, _ in model.named_parameters()]}
    for depth in (1, 2, 3):
        model = _parallelized("parallel.strategy=zero3", f"parallel.fsdp_prefetch={depth}")
        states = [b._get_fsdp_state() for b in model.layers]
        with CollectiveCounter() as comm:
            # FSDP's pre-forward hook is prepended: ours sees its all-gathers (and prefetches) issued
            first_block_sees: list[int] = []
            model.layers[0].register_forward_pre_hook(lambda *_: first_block_sees.append(_all_gathers(comm)))
            _loss(model).backward()
        out[f"prefetch={depth}"] = {"forward": [len(s._states_to_forward_prefetch) for s in states],
                                    "backward": [len(s._states_to_backward_prefetch) for s in states],
                                    "gathered_before_block0": first_block_sees[0]}
    for strategy, extra in (("zero3", ""), ("zero3", "false"), ("zero2", ""), ("zero2", "true")):
        model = _parallelized(f"parallel.strategy={strategy}",
                              *([f"parallel.reshard_after_forward={extra}"] if extra else []))
        loss = _loss(model)
        weight = model.layers[0].attention.wq.weight  # between forward and backward
        gathered = _gathered_bytes(model)
        with CollectiveCounter() as comm:
            loss.backward()
        out[f"{strategy} reshard={extra or 'default'}"] = {
            "local_shape": tuple(getattr(weight, "_local_tensor", weight).shape),
            "full_shape": tuple(weight.shape), "backward_all_gathers": _all_gathers(comm),
            "gathered_bytes": gathered, "model_params": sum(q.numel() for q in model.parameters()),
            "head_params": model.norm.weight.numel() + model.output.weight.numel()}
    block_mb = 4 * sum(q.numel() for q in model.layers[0].parameters()) / 2**20
    for label, unit_mb in (("0", 0), ("1.5 blocks", 1.5 * block_mb), ("25", 25)):
        model = _parallelized("parallel.strategy=zero3", f"parallel.fsdp_unit_mb={unit_mb}")
        with CollectiveCounter() as forward:
            loss = _loss(model)
        with CollectiveCounter() as backward:
            loss.backward()
        out[f"unit_mb={label}"] = {
            "forward_all_gathers": _all_gathers(forward),
            "reduce_scatters": sum(r["kind"] == "reduce_scatter" for r in backward.records)}
    for mode, every in (("full", 1), ("selective", 1), ("selective", 2), ("selective", 3)):
        model = _parallelized("parallel.strategy=zero3", f"parallel.activation_checkpointing={mode}",
                              f"parallel.ac_every={every}")
        forwards = [0] * N_LAYERS  # each block's forward runs, recomputation in backward included
        for i, block in enumerate(model.layers):
            # a pre-hook: recomputation stops once it has rebuilt what backward needs, before the end
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            inner.register_forward_pre_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
        _loss(model).backward()
        out[f"ac={mode},{every}"] = {"wrapped": [isinstance(b, CheckpointWrapper) for b in model.layers],
                                     "forwards": forwards}
    for strategy in ("zero2", "zero3"):
        model = _parallelized(f"parallel.strategy={strategy}", "train.precision=bf16")
        with CollectiveCounter() as comm:
            _loss(model).backward()
        groups = _fsdp_groups(model)
        out[f"bf16 {strategy}"] = {
            "policies": {(str(g.mp_policy.param_dtype), str(g.mp_policy.reduce_dtype)) for g in groups},
            "units": len(groups),
            "reduced": [(r["kind"], r["dtype"]) for r in comm.records if r["kind"] == "reduce_scatter"]}
    for bucket_mb in (25, 0.001):
        model = _parallelized("parallel.strategy=ddp", f"parallel.ddp_bucket_mb={bucket_mb}")
        _loss(model).backward()  # DDP's first backward uses its initial buckets, then rebuilds by the cap
        with CollectiveCounter() as comm:
            _loss(model).backward()
        out[f"bucket={bucket_mb}"] = {
            "all_reduces": sum(r["kind"] == "all_reduce" for r in comm.records),
            "params_over_cap": sum(q.numel() * q.element_size() >= bucket_mb * 2**20
                                   for q in model.parameters())}
    return out


@pytest.fixture(scope="module")
def structure() -> dict:
    ranks = run_ranks(_rank_structure, 2)
    assert ranks[0] == ranks[1]
    return ranks[0]


def test_compile_compiles_each_block_in_place(structure):
    on, off = structure["compile=true"], structure["compile=false"]
    assert on["compiled"] == [True] * N_LAYERS and off["compiled"] == [False] * N_LAYERS
    assert on["names"] == off["names"]  # in place: checkpoints keep their keys


def _rank_train_compiled(cfg):
    """Training with every block compiled. aot_eager instead of inductor: the same Dynamo capture and
    AOTAutograd graphs (where FSDP2's hooks must compose), without a C++ build (~70 s on 2 cores)."""
    from torch import nn
    from torch._dynamo.utils import counters

    from loom.train.driver import train

    compile_block = nn.Module.compile
    nn.Module.compile = lambda self, *a, **k: compile_block(self, *a, **{**k, "backend": "aot_eager"})
    r = train(cfg, None, return_state=True, quiet=True)
    return (r.losses, r.state_dict, r.memory), dict(counters["stats"]), dict(counters["aot_autograd"])


def test_compiled_training_matches_eager(corpus):
    results = run_ranks(_rank_train_compiled, 2, S.make_config(corpus, "zero3", "train.compile=true"))
    for _, stats, aot in results:
        # the blocks ran as captured graphs (the two blocks share one), through AOTAutograd
        assert stats.get("unique_graphs", 0) >= 1 and stats.get("calls_captured", 0) > 0, stats
        assert aot.get("ok", 0) >= 1, aot
    S.assert_matches_reference([run for run, _, _ in results], *S._reference(corpus))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_fsdp_prefetch_depth(structure, depth):
    got = structure[f"prefetch={depth}"]
    if depth == 1:  # FSDP2's implicit prefetch: no explicit lists
        assert got["forward"] == [0] * N_LAYERS and got["backward"] == [0] * N_LAYERS, got
    else:
        # Units in forward order: the embedding, the blocks, norm + head; block i has N_LAYERS - i
        # units after it and i + 1 before it.
        assert got["forward"] == [min(depth, N_LAYERS - i) for i in range(N_LAYERS)], got
        assert got["backward"] == [min(depth, i + 1) for i in range(N_LAYERS)], got
    # Issued before block 0 computes: the embedding, block 0 and the `depth` blocks prefetched ahead.
    ahead = got["gathered_before_block0"] - structure["prefetch=1"]["gathered_before_block0"]
    assert ahead == (0 if depth == 1 else depth), got


@pytest.mark.parametrize("case,resharded", [("zero3 reshard=default", True), ("zero3 reshard=false", False),
                                            ("zero2 reshard=default", False), ("zero2 reshard=true", True)])
def test_reshard_after_forward_overrides_strategy(structure, case, resharded):
    got = structure[case]
    assert got["full_shape"] == (64, 64)
    # Between forward and backward a block holds its half (2 ranks) or the whole weight ...
    assert got["local_shape"] == ((32, 64) if resharded else (64, 64)), got
    # ... and backward all-gathers every block and the embedding again, or nothing.
    assert got["backward_all_gathers"] == (N_LAYERS + 1 if resharded else 0), got
    # Gathered between forward and backward, per rank: the whole model (every unit stays gathered
    # until backward) or only the head's unit, which backward needs first (fp32: 4 bytes each).
    assert got["gathered_bytes"] == 4 * (got["head_params"] if resharded else got["model_params"]), got


@pytest.mark.parametrize("mode,every", [("full", 1), ("selective", 1), ("selective", 2), ("selective", 3)])
def test_activation_checkpointing_wraps_every_kth_block(structure, mode, every):
    """full checkpoints every block, selective blocks 0, k, 2k, ... (parallel.ac_every = k); each
    checkpointed block runs its forward a second time in backward, the others once."""
    got = structure[f"ac={mode},{every}"]
    wrapped = [mode == "full" or i % every == 0 for i in range(N_LAYERS)]
    assert got["wrapped"] == wrapped, got
    assert got["forwards"] == [2 if w else 1 for w in wrapped], got


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_bf16_gathers_in_bf16_and_reduces_gradients_in_fp32(structure, strategy):
    """Every unit's MixedPrecisionPolicy, and the dtype each reduce-scatter really carries: one per
    unit, in fp32 (a bf16 reduction would sum rounded gradients)."""
    got = structure[f"bf16 {strategy}"]
    assert got["units"] == N_LAYERS + 2  # the embedding, each block, norm + head
    assert got["policies"] == {("torch.bfloat16", "torch.float32")}, got
    assert got["reduced"] == [("reduce_scatter", "float32")] * got["units"], got


@pytest.mark.parametrize("case,units", [("unit_mb=0", N_LAYERS + 2), ("unit_mb=1.5 blocks", 3),
                                        ("unit_mb=25", 1)])
def test_fsdp_unit_mb_groups_modules(structure, case, units):
    """Consecutive modules in forward order share one all-gather and one reduce-scatter until the
    unit holds parallel.fsdp_unit_mb: 0 gives the embedding, each block and norm + head their own;
    1.5 blocks' worth gives (embedding, block 0, block 1), (block 2, block 3), (norm, head); 25 MB
    takes the whole tiny model into one unit, the root's."""
    assert structure[case] == {"forward_all_gathers": units, "reduce_scatters": units}, structure[case]


def test_ddp_bucket_mb_sets_all_reduces_per_backward(structure):
    big, tiny = structure["bucket=25"], structure["bucket=0.001"]
    assert big["all_reduces"] == 1, big  # the whole 0.5 MB of gradients in one bucket
    # A bucket closes once it reaches the cap: at most one parameter over the cap per bucket.
    assert tiny["params_over_cap"] >= 20 and tiny["all_reduces"] >= tiny["params_over_cap"], tiny


# ---------------------------------------------------------------------------------------------
# Keys seen in a run's output: one spawned rank trains a few steps per setting.

EVAL_STEPS = 6


def _rank_runs(cfgs: dict, out_dir: str) -> dict:
    from loom.train.driver import train

    out = {}
    for name, cfg in cfgs.items():
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            r = train(cfg, Path(out_dir) / name, quiet=False)
        out[name] = {"stdout": stdout.getvalue(), "eval_loss": r.eval_loss, "evals": r.extra["evals"]}
    return out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("runs")
    profile = ["train.steps=2", "profile.enabled=true", "profile.wait=0", "profile.warmup=1",
               "profile.active=1"]
    cfgs = {"eval_every=2": S.make_config(corpus, "ddp", f"train.steps={EVAL_STEPS}", "train.eval_every=2"),
            "eval_every=0": S.make_config(corpus, "ddp", f"train.steps={EVAL_STEPS}"),
            "with_stack=true": S.make_config(corpus, "ddp", *profile, "profile.with_stack=true"),
            "with_stack=false": S.make_config(corpus, "ddp", *profile)}
    return run_ranks(_rank_runs, 1, cfgs, str(out_dir))[0], out_dir


def _evals(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"eval loss at step (\d+): ([\d.]+)", stdout)}


def test_eval_every_evaluates_at_multiples(runs):
    """eval_every=k evaluates after steps k, 2k, ... before the last (which the final eval covers);
    0 evaluates only at the end. The periodic losses are printed and written with their step's
    metrics (metrics.jsonl `eval_loss`)."""
    results, out_dir = runs
    periodic, final_only = results["eval_every=2"], results["eval_every=0"]
    evals = _evals(periodic["stdout"])
    assert sorted(evals) == [2, 4], periodic["stdout"]
    assert evals == {k: round(v, 4) for k, v in periodic["evals"].items()}
    records = [json.loads(line)
               for line in (out_dir / "eval_every=2" / "metrics.jsonl").read_text().splitlines()]
    # and the final eval with the last step's (issue 40)
    logged = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert logged == {**periodic["evals"], EVAL_STEPS: periodic["eval_loss"]}
    # evaluated anew each time, on the weights as training went on
    assert evals[2] != evals[4] != round(periodic["eval_loss"], 4)
    assert _evals(final_only["stdout"]) == {} and final_only["evals"] == {}
    assert final_only["eval_loss"] == periodic["eval_loss"]  # eval does not disturb training


def _trace_events(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / "traces" / "rank0.json.gz", "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_with_stack_records_python_frames(runs):
    _, out_dir = runs
    with_stack = _trace_events(out_dir / "with_stack=true")
    without = _trace_events(out_dir / "with_stack=false")
    frames = [e for e in with_stack if e.get("cat") == "python_function"]
    assert any("loom/train/step.py" in e["name"] for e in frames), len(frames)  # loom's own frames
    assert not any(e.get("cat") == "python_function" for e in without)
    # the operators are traced either way: only the Python stacks differ
    assert any(e.get("cat") == "cpu_op" for e in without)
