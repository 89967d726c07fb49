"""Mixtures of experts and expert parallelism in the step ledger, the diagnosis, the report and the
comparison: synthetic traces where EP's all-to-alls run inside their profiler ranges (`ep_alltoall`)
beside an all-reduce (and CP's ring) outside them, and run folders whose metrics.jsonl carries the
routing (`moe_*`, `ep_*`), with a known answer."""

from __future__ import annotations

import json
import math
import tomllib

import pytest
from analysis_inputs import MOE_CONFIG, MOE_ROWS, write_moe_run, write_run
from test_ledger import GPU_PID, X, write_trace
from test_report import _Rects

from loom.checked import BadFile
from loom.cli import main
from loom.observe.analyze import analyze, render_table
from loom.observe.compare import compare, render_compare
from loom.observe.diagnose import DROPPED_SHARE, EXPERT_IMBALANCE, diagnose, try_text
from loom.observe.ledger import EP_ALLTOALL, analyze_dir
from loom.observe.report import LEDGER_BAR_W, render_html

MAIN, GLOO = 11, 12
SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def test_the_kind_is_the_models():
    """The model side marks its all-to-alls with context_parallel.EP_ALLTOALL; the ledger (which
    runs without torch) spells the same name."""
    from loom.parallel.context_parallel import EP_ALLTOALL as MODEL_SIDE
    assert EP_ALLTOALL == MODEL_SIDE == "ep_alltoall"


def ep_cpu_events(ep: bool = True, cp: bool = False, t0: float = 0.0, step: int = 1) -> list[dict]:
    """One 100 ms gloo step on the main thread (ms after t0), EP's all-to-alls inside the ops of their
    autograd Function as torch records them:
    mm 0-20 · ep_alltoall 20-26 in _AllToAll: the dispatch issued 20-21 (512×64 fp32; gloo's thread
    21-26), waited for · mm 26-40 · ep_alltoall 40-41: the combine issued (256×64; gloo 41-50) · mm
    41-47 under it · a wait gap 47-50 · mm 50-60 (or with `cp`: cp_ring 50-53, a send issued 50-51 and
    run on this thread 51-53, then mm 53-60) · an all-reduce issued 60-61 (gloo 61-65), waited for ·
    mm 65-100. Without `ep` the ranges are gone: the same all-to-alls are plain all_to_all."""
    def x(name, start, dur, cat="cpu_op", tid=MAIN, **args):
        return X(name, t0 + start, dur, cat, tid=tid, **args)

    f32 = {"Input_type": ["float"]}
    two = ["float", "float"]
    events = [x(f"ProfilerStep#{step}", 0, 100, "user_annotation"), x("aten::mm", 0, 20),
              x("aten::mm", 26, 14), x("_AllToAll", 20, 6),
              x("c10d::alltoall_base_", 20, 1, Input_Dims=[[512, 64], [512, 64]], Input_type=two),
              x("gloo:all_to_all", 21, 5, "user_annotation", tid=GLOO, Input_Dims=[[512, 64]], **f32),
              x("_AllToAll", 40, 1),
              x("c10d::alltoall_base_", 40, 1, Input_Dims=[[256, 64], [256, 64]], Input_type=two),
              x("gloo:all_to_all", 41, 9, "user_annotation", tid=GLOO, Input_Dims=[[256, 64]], **f32),
              x("aten::mm", 41, 6),
              x("c10d::allreduce_", 60, 1, Input_Dims=[[[1000]], [], []], Input_type=["TensorList", "", ""]),
              x("gloo:all_reduce", 61, 4, "user_annotation", tid=GLOO, Input_Dims=[[1000]], **f32),
              x("aten::mm", 65, 35)]
    if ep:
        events += [x(EP_ALLTOALL, 20, 6, "user_annotation"), x(EP_ALLTOALL, 40, 1, "user_annotation")]
    if cp:
        events += [x("cp_ring", 50, 3, "user_annotation"),
                   x("c10d::send", 50, 1, Input_Dims=[[[1024]]], Input_type=["TensorList"]),
                   x("gloo:send", 51, 2, "user_annotation", Input_Dims=[[1024]], **f32), x("aten::mm", 53, 7)]
    else:
        events.append(x("aten::mm", 50, 10))
    return events


def _parts(s: dict) -> tuple:
    return s["wall_ms"], s["compute_ms"], s["comm_exposed_ms"], s["comm_hidden_ms"], s["idle_ms"]


def test_ep_alltoall_has_its_own_kind_and_time(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", ep_cpu_events())
    led = analyze_dir(tmp_path)["ranks"]["0"]
    (s,) = led["steps"]
    # exposed: the dispatch's range 20-26, the combine's issue 40-41 and its wait 47-50, the all-reduce
    # 60-65; hidden: the combine under mm 41-47
    assert _parts(s) == (100.0, 85.0, 15.0, 6.0, 0.0)
    assert (s["ep_exposed_ms"], s["ep_hidden_ms"]) == (10.0, 6.0)
    assert "cp_exposed_ms" not in s
    kinds = [(c["kind"], c["bytes"], c["duration_ms"]) for c in led["collectives"]]
    assert kinds == [("ep_alltoall", 131072, 5.0), ("ep_alltoall", 65536, 9.0), ("all_reduce", 4000, 4.0)]
    table = render_table({"ranks": {"0": led}})
    assert "ep exp ms ep hid ms" in table and table.splitlines()[1].endswith("10.0       6.0")


def test_without_ep_ranges_the_alltoall_is_plain_and_computes(tmp_path):
    led = analyze_dir(write_trace(tmp_path / "rank0.json", ep_cpu_events(ep=False)))["ranks"]["0"]
    (s,) = led["steps"]
    assert [c["kind"] for c in led["collectives"]] == ["all_to_all", "all_to_all", "all_reduce"]
    assert "ep_exposed_ms" not in s and "ep_hidden_ms" not in s
    # the wait inside _AllToAll (21-26) reads as compute, the dispatch as hidden under it
    assert _parts(s) == (100.0, 90.0, 10.0, 11.0, 0.0)


def test_cp_and_ep_exchanges_are_told_apart(tmp_path):
    led = analyze_dir(write_trace(tmp_path / "rank0.json", ep_cpu_events(cp=True)))["ranks"]["0"]
    (s,) = led["steps"]
    assert _parts(s) == (100.0, 82.0, 18.0, 6.0, 0.0)
    assert (s["ep_exposed_ms"], s["ep_hidden_ms"]) == (10.0, 6.0)
    assert (s["cp_exposed_ms"], s["cp_hidden_ms"]) == (3.0, 0.0)
    assert [c["kind"] for c in led["collectives"]] == ["ep_alltoall", "ep_alltoall", "cp_ring", "all_reduce"]


def test_host_syncs_in_moe_blocks_are_the_blocks_own(tmp_path):
    """loom's MoE blocks (their `moe` range) read the routing's split sizes on the host: those syncs
    are counted apart (host_syncs_moe) and never make a finding; one outside them does."""
    events = ep_cpu_events() + [X("moe", 18, 32, "user_annotation"), X("aten::item", 30, 0.5),
                                X("aten::_local_scalar_dense", 30.1, 0.2), X("aten::item", 44, 0.5)]
    plain = analyze_dir(write_trace(tmp_path / "rank0.json", events))["ranks"]["0"]
    (s,) = plain["steps"]
    assert (s["host_syncs"], s["host_syncs_moe"], s["host_syncs_loop"]) == (0, 2, 0)
    assert "sync" not in {f["category"] for f in diagnose({"ranks": {"0": plain}})}
    events.append(X("aten::item", 70, 0.5))  # in the model's own code, outside the blocks
    (s,) = analyze_dir(write_trace(tmp_path / "rank0.json", events))["ranks"]["0"]["steps"]
    assert (s["host_syncs"], s["host_syncs_moe"]) == (1, 2)
    (tmp_path / "dense").mkdir()
    (s,) = analyze_dir(write_trace(tmp_path / "dense" / "rank0.json", ep_cpu_events()))["ranks"]["0"]["steps"]
    assert "host_syncs_moe" not in s  # no MoE block in the trace: the step keys are as before


def test_gpu_ep_alltoall_is_its_sendrecv_kernel(tmp_path):
    """GPU: gemm 0-30 and 45-100; EP's all-to-all issued 25-26 inside ep_alltoall, which NCCL runs as
    a SendRecv kernel 28-45; an all-reduce issued 85, its kernel 90-95 under the gemm."""
    events = [X("ProfilerStep#1", 0, 100, "user_annotation"), X(EP_ALLTOALL, 25, 2, "user_annotation"),
              X("c10d::alltoall_base_", 25, 1), X("c10d::allreduce_", 85, 1),
              X("gemm", 0, 30, "kernel", tid=7, pid=GPU_PID), X("gemm", 45, 55, "kernel", tid=7, pid=GPU_PID),
              X(SENDRECV, 28, 17, "kernel", tid=20, pid=GPU_PID),
              X(ALLREDUCE, 90, 5, "kernel", tid=20, pid=GPU_PID)]
    led = analyze_dir(write_trace(tmp_path / "rank0.json", events))["ranks"]["0"]
    (s,) = led["steps"]
    assert _parts(s) == (100.0, 85.0, 15.0, 7.0, 0.0)
    assert (s["ep_exposed_ms"], s["ep_hidden_ms"]) == (15.0, 2.0)
    assert [(c["kind"], c["duration_ms"]) for c in led["collectives"]] == [("ep_alltoall", 17.0),
                                                                          ("all_reduce", 5.0)]


# -- the diagnosis: exposed expert dispatch -------------------------------------------------------

def ep_step(ep_exposed: float, other_exposed: float = 2.0, wall: float = 100.0) -> dict:
    """A 100 ms ledger step: EP's all-to-alls exposed `ep_exposed` ms of the exposed comm."""
    exposed = ep_exposed + other_exposed
    compute = wall - exposed
    return {"step": 1, "wall_ms": wall, "compute_ms": compute, "comm_exposed_ms": exposed,
            "comm_hidden_ms": 5.0, "ep_exposed_ms": ep_exposed, "ep_hidden_ms": 5.0, "io_ms": 0.0,
            "idle_ms": 0.0, "forward_ms": 30.0, "backward_ms": 50.0, "optimizer_ms": 5.0, "data_ms": 0.0,
            "host_syncs": 0, "shares": {"compute": compute, "comm_exposed": exposed, "io": 0.0, "idle": 0.0}}


def ep_ledger(ep_exposed: float = 30.0) -> dict:
    # the all-gathers take longer than EP's all-to-alls, yet EP's measured exposed time decides the split
    calls = [{"step": 1, "kind": "ep_alltoall", "duration_ms": 5.0, "bytes": 1 << 20} for _ in range(4)]
    calls += [{"step": 1, "kind": "all_gather", "duration_ms": 40.0, "bytes": 8 << 20} for _ in range(4)]
    return {"ranks": {str(r): {"steps": [ep_step(ep_exposed)], "collectives": calls} for r in range(2)},
            "stragglers": []}


def checked_toml(f: dict) -> dict:
    """A finding whose TRY line is TOML that sets its key to its value."""
    if f["knob"]:
        line = try_text(f).split("  (", 1)[0]
        assert tomllib.loads(line.replace(f["knob"], "k", 1))["k"] == f["value"], line
    return f


def ep_finding(parallel: dict, model: dict | None = None, ep_exposed: float = 30.0) -> dict:
    config = {"parallel": parallel, "model": model or {}}
    found = [checked_toml(f) for f in diagnose(ep_ledger(ep_exposed), config)
             if f.get("kind") == "ep_alltoall"]
    assert len(found) <= 1, found
    return found[0] if found else {}


@pytest.mark.parametrize("ep, model, value, says", [
    (8, {"preset": "tiny-moe"}, 4, "now 8: "),
    (4, {"preset": "qwen3-moe-30b"}, 2, "32 → 64 experts per rank"),
    (6, {"preset": "tiny-moe", "moe_experts": 12}, 3, "2 → 4 experts per rank"),
    (9, {"preset": "tiny-moe", "moe_experts": 72}, 3, "now 9: "),  # 4 ranks would not divide 9 (or 72)
    (2, {"preset": "mixtral-8x7b"}, 1, "no all-to-all at all"),
])
def test_exposed_ep_alltoall_names_fewer_ep_ranks(ep, model, value, says):
    f = ep_finding({"strategy": "zero3", "ep": ep}, model)
    assert (f["category"], f["knob"], f["value"]) == ("comm", "parallel.ep", value)
    assert "ep_alltoall exposed: 30% of the step" in f["title"]
    assert f", ep {ep}" in f["evidence"] and says in f["note"]
    assert try_text(f).startswith(f"parallel.ep = {value}  (")


@pytest.mark.parametrize("parallel, knob, value, says", [
    ({"pp_schedule": "dualpipev", "dualpipev_overlap": False}, "parallel.dualpipev_overlap", True,
     "now false"),
    ({"pp_schedule": "1f1b", "microbatches": 4}, "parallel.pp_schedule", "dualpipev", "now 1f1b"),
    ({"pp_schedule": "1f1b", "microbatches": 2}, "parallel.ep", 1, "no all-to-all"),  # a V needs 2·pp
    # overlapped already
    ({"pp_schedule": "dualpipev", "microbatches": 4}, "parallel.ep", 1, "no all-to-all"),
])
def test_exposed_ep_alltoall_under_a_pipeline_names_dualpipev(parallel, knob, value, says):
    f = ep_finding({"strategy": "zero3", "ep": 2, "pp": 2, **parallel}, {"preset": "tiny-moe", "n_layers": 4})
    assert (f["knob"], f["value"]) == (knob, value) and says in f["note"]


def test_ep_finding_threshold_and_unknown_layout():
    assert ep_finding({"ep": 4}, ep_exposed=5.0) == {}  # 7% of the step exposed: no finding
    f = ep_finding({})  # no config.toml: the kind is known, the layout is not
    assert f["knob"] is None and "parallel.ep" in f["note"]


# -- the diagnosis: the experts' load ---------------------------------------------------------------

def moe_summary(imbalance: float = 1.2, dropped_pct: float = 0.0, tokens: list[int] | None = None) -> dict:
    return {"steps": [2, 3], "profiled": True, "aux_loss": 1.1, "load_imbalance": imbalance,
            "dropped": None, "dropped_pct": dropped_pct, "expert_tokens": tokens, "ep_bytes": None,
            "ep_wait_s": None}


def moe_findings(moe: dict, model: dict, parallel: dict | None = None, io: float = 0.0) -> list[dict]:
    step = ep_step(0.0, other_exposed=0.0)
    step["shares"]["io"], step["io_ms"] = io, io
    step["shares"]["compute"] -= io
    ledger = {"ranks": {"0": {"steps": [step], "collectives": []}}, "stragglers": [], "moe": moe}
    return [checked_toml(f) for f in diagnose(ledger, {"parallel": parallel or {}, "model": model})]


@pytest.mark.parametrize("model, knob, value, says", [
    ({"preset": "tiny-moe"}, "model.moe_aux_loss_coef", 0.1, "now 0.01: "),  # the preset's coefficient × 10
    ({"preset": "tiny-moe", "moe_aux_loss_coef": 0.003}, "model.moe_aux_loss_coef", 0.03, "now 0.003: "),
    ({"preset": "tiny-moe", "moe_aux_loss_coef": 0.0}, "model.moe_aux_loss_coef", 0.01, "now 0: "),
    # aux-loss-free balancing runs (the preset's bias rate): its rate, not the loss
    ({"preset": "deepseek-v3"}, "model.moe_bias_update_rate", 0.01, "now 0.001: "),
    ({"preset": "tiny-moe", "moe_bias_update_rate": 0.002}, "model.moe_bias_update_rate", 0.02,
     "now 0.002: "),
    ({"preset": "tiny-moe", "init_from": "/models/mixtral"}, "model.moe_aux_loss_coef", 0.01, "now unknown"),
])
def test_expert_load_imbalance_names_the_balancing_knob(model, knob, value, says):
    (f,) = moe_findings(moe_summary(2.0, tokens=[40, 8, 8, 8, 8, 8, 8, 40]), model, {"ep": 4})
    assert (f["category"], f["knob"], f["value"]) == ("moe", knob, value)
    assert f["value"] == pytest.approx(value) and says in f["note"]
    assert f["title"] == "Expert load imbalance: the busiest expert takes 2.00× the mean load"
    assert "moe_load_imbalance 2.00" in f["evidence"] and "median over 2 profiled step(s)" in f["evidence"]
    assert "expert 0 took 2.50× the mean of the 8 experts' tokens, the least busy 0.50×" in f["evidence"]
    assert "expert parallelism over 4 ranks" in f["cause"]
    assert f["expected_effect"].startswith("the busiest expert's load towards the mean: up to 50% less")


def test_expert_findings_fire_above_their_thresholds_only():
    model = {"preset": "tiny-moe", "moe_capacity_factor": 1.25}
    assert moe_findings(moe_summary(EXPERT_IMBALANCE, DROPPED_SHARE), model) == []
    assert moe_findings(moe_summary(1.49, 0.99), model) == []
    titles = [f["title"] for f in moe_findings(moe_summary(1.51, 1.01), model)]
    assert titles == ["Expert load imbalance: the busiest expert takes 1.51× the mean load",
                      "1.0% of the routed tokens are dropped at the experts' capacity"]
    assert moe_findings(None, model) == [] and moe_findings({}, model) == []


@pytest.mark.parametrize("model, value, says", [
    ({"preset": "tiny-moe", "moe_capacity_factor": 1.25}, 2.5, "now 1.25: "),
    ({"preset": "tiny-moe", "moe_capacity_factor": 1.25, "init_from": "/m"}, 2.5, "now 1.25: "),
    ({"preset": "tiny-moe", "init_from": "/models/mixtral"}, 0, "dropless"),  # its capacity unknown
])
def test_dropped_tokens_name_the_capacity_factor(model, value, says):
    (f,) = moe_findings(moe_summary(1.1, 3.0), model)
    assert (f["category"], f["knob"], f["value"]) == ("moe", "model.moe_capacity_factor", value)
    assert says in f["note"]
    assert ("or 0 for dropless" in f["note"]) == (value != 0)  # the other way, where there is one
    assert "moe_dropped is 3.0% of the tokens × top-k routed" in f["evidence"]
    # dropless runs drop nothing: a dropped count there is no capacity's doing
    assert moe_findings(moe_summary(1.1, 3.0), {"preset": "tiny-moe"}) == []


def test_expert_findings_in_the_experts_order():
    """Compute share first: IO, then the experts' load (an imbalance), then the exposed transfers,
    before the phases."""
    ledger = ep_ledger()
    for info in ledger["ranks"].values():
        info["steps"][0]["optimizer_ms"] = 40.0
    ledger["moe"] = moe_summary(2.0, 3.0)
    findings = diagnose(ledger, {"parallel": {"ep": 4}, "model": {"preset": "tiny-moe",
                                                                    "moe_capacity_factor": 1.0}})
    assert [(f["category"], f["knob"]) for f in findings] == [
        ("moe", "model.moe_aux_loss_coef"), ("moe", "model.moe_capacity_factor"), ("comm", "parallel.ep"),
        ("optimizer", "train.optimizer_impl")]


# -- a run's records: metrics.jsonl, memory.json, config.toml -------------------------------------

def test_routing_read_over_the_profiled_steps(tmp_path):
    analysis = analyze(write_moe_run(tmp_path / "run"))
    moe = analysis["moe"]
    assert moe["steps"] == [2, 3] and moe["profiled"]  # sample_events' ProfilerStep#1, #2 after step 0
    assert (moe["load_imbalance"], moe["dropped"], moe["dropped_pct"]) == (2.1875, 1.5, 1.171875)
    assert moe["aux_loss"] == pytest.approx(1.2) and (moe["ep_bytes"], moe["ep_wait_s"]) == (7168, 0.003)
    assert moe["expert_tokens"] == [70, 22, 24, 24, 24, 24, 24, 44]
    run = analysis["run"]
    assert (run["moe"]["experts"], run["moe"]["top_k"], run["ep"]) == (8, 2, 2)
    assert run["ep_ranks"] == {"0": 0, "1": 1}  # memory.json
    assert (run["moe"]["aux_loss_coef"], run["moe"]["capacity_factor"]) == (0.01, 1.25)  # preset, config
    moe_findings = [(f["knob"], f["value"]) for f in analysis["findings"] if f["category"] == "moe"]
    assert moe_findings == [("model.moe_aux_loss_coef", 0.1), ("model.moe_capacity_factor", 2.5)]
    assert "experts (median over 2 profiled step(s)): load imbalance 2.19" in render_table(analysis)


def test_without_summary_every_logged_step_counts(tmp_path):
    run = write_moe_run(tmp_path / "run")
    (run / "summary.json").unlink()  # the profiled steps' training steps are unknown
    analysis = analyze(run)
    assert analysis["moe"]["steps"] == [1, 2, 3, 4] and not analysis["moe"]["profiled"]
    assert analysis["moe"]["load_imbalance"] == 1.4375  # median of 1, 2.5, 1.875, 1: balanced enough
    assert [f for f in analysis["findings"] if f["category"] == "moe"] == []


def test_a_dense_run_has_no_routing(tmp_path):
    analysis = analyze(write_run(tmp_path / "run"))
    assert analysis["moe"] is None and "moe" not in analysis["run"] and analysis["run"]["ep"] == 1
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 5.0}) + "\n")
    assert analyze(tmp_path / "run")["moe"] is None


def _edit_row(index: int, **changes):
    def edit(run):
        rows = [dict(r) for r in MOE_ROWS]
        rows[index].update(changes)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return edit


def _edit_memory(rank: str, **changes):
    def edit(run):
        doc = json.loads((run / "memory.json").read_text())
        for key, value in changes.items():
            if value is None:
                del doc["ranks"][rank][key]
            else:
                doc["ranks"][rank][key] = value
        (run / "memory.json").write_text(json.dumps(doc))
    return edit


def _edit_config(old: str, new: str):
    def edit(run):
        (run / "config.toml").write_text(MOE_CONFIG.replace(old, new))
    return edit


@pytest.mark.parametrize("edit, file, message", [
    (_edit_row(1, moe_load_imbalance="high"), "metrics.jsonl:2",
     "moe_load_imbalance must be a finite number in [0, 65536], got 'high' (str)"),
    (_edit_row(1, moe_load_imbalance=1e9), "metrics.jsonl:2",
     "moe_load_imbalance must be a finite number in"),
    (_edit_row(2, moe_aux_loss=math.nan), "metrics.jsonl:3",
     "moe_aux_loss must be a finite number ≥ 0, got nan"),
    (_edit_row(1, moe_aux_loss=-0.5), "metrics.jsonl:2", "moe_aux_loss must be a finite number ≥ 0"),
    (_edit_row(1, moe_expert_tokens=[16, -2]), "metrics.jsonl:2",
     "moe_expert_tokens must be a non-empty list of integers ≥ 0 (tokens per expert), got [16, -2]"),
    (_edit_row(1, moe_expert_tokens=[]), "metrics.jsonl:2", "moe_expert_tokens must be a non-empty list"),
    (_edit_row(1, moe_expert_tokens=[1.5, 2]), "metrics.jsonl:2",
     "moe_expert_tokens must be a list of integers"),
    (_edit_row(1, moe_expert_tokens=[True, 2]), "metrics.jsonl:2",
     "moe_expert_tokens must be a list of integers"),
    (_edit_row(1, moe_expert_tokens="8"), "metrics.jsonl:2", "moe_expert_tokens must be a list of integers"),
    (_edit_row(2, moe_expert_tokens=[32] * 4), "metrics.jsonl:3",
     "moe_expert_tokens must be a list of 8 counts, as on the lines before it (one per expert)"),
    (_edit_row(1, moe_dropped=-1), "metrics.jsonl:2", "moe_dropped must be an integer ≥ 0, got -1 (int)"),
    (_edit_row(1, moe_dropped=2.0), "metrics.jsonl:2", "moe_dropped must be an integer ≥ 0, got 2.0 (float)"),
    (_edit_row(1, moe_dropped=500), "metrics.jsonl:2",
     "moe_dropped must be at most the 128 choices routed (sum of moe_expert_tokens), got 500"),
    (_edit_row(1, ep_bytes=True), "metrics.jsonl:2", "ep_bytes must be an integer ≥ 0, got True (bool)"),
    (_edit_row(1, ep_bytes="4k"), "metrics.jsonl:2", "ep_bytes must be an integer ≥ 0"),
    (_edit_row(2, ep_wait_s=-1.0), "metrics.jsonl:3", "ep_wait_s must be a finite number ≥ 0, got -1.0"),
    (_edit_row(2, ep_wait_s=math.inf), "metrics.jsonl:3", "ep_wait_s must be a finite number ≥ 0, got inf"),
    (_edit_memory("1", ep=0), "memory.json", "ranks.1.ep must be an integer in [1, 1048576], got 0 (int)"),
    (_edit_memory("1", ep=4, ep_rank=3), "memory.json",
     "ranks.1.ep must be the ep of every rank (2, as an earlier rank says), got 4 (int)"),
    (_edit_memory("1", ep_rank=2), "memory.json",
     "ranks.1.ep_rank must be an integer in [0, 1], got 2 (int)"),
    (_edit_memory("0", ep=None), "memory.json",
     "ranks.0.ep is missing; it must be an integer in [1, 1048576]"),
    (_edit_memory("0", ep_rank="0"), "memory.json", "ranks.0.ep_rank must be an integer in [0, 1], got '0'"),
    (_edit_config("ep = 2", "ep = 0"), "config.toml",
     "parallel.ep must be an integer in [1, 1048576], got 0"),
    (_edit_config("ep = 2", "ep = 2.5"), "config.toml", "parallel.ep must be an integer in [1, 1048576]"),
    (_edit_config("moe_capacity_factor = 1.25", "moe_capacity_factor = -1.0"), "config.toml",
     "model.moe_capacity_factor must be a finite number in [0, 1000000.0], got -1.0"),
    (_edit_config("moe_capacity_factor = 1.25", 'moe_aux_loss_coef = "high"'), "config.toml",
     "model.moe_aux_loss_coef must be a finite number in [0, 1000000.0], got 'high'"),
    (_edit_config("moe_capacity_factor = 1.25", "moe_bias_update_rate = nan"), "config.toml",
     "model.moe_bias_update_rate must be a finite number in [0, 1000000.0], got nan"),
    (_edit_config("moe_capacity_factor = 1.25", "moe_experts = 1.5"), "config.toml",
     "model.moe_experts must be an integer in [0, 65536], got 1.5"),
    (_edit_config("moe_capacity_factor = 1.25", "moe_top_k = 0"), "config.toml",
     "model.moe_top_k must be an integer in [1, 65536], got 0"),
])
def test_bad_routing_records_are_one_line(tmp_path, capsys, edit, file, message):
    run = write_moe_run(tmp_path / "run")
    edit(run)
    with pytest.raises(BadFile) as e:
        analyze(run)
    assert str(e.value).startswith(f"{run / file}: {message}"), str(e.value)
    capsys.readouterr()
    assert main(["analyze", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"loom: error: {e.value}", err


def test_bad_rows_outside_the_profiled_steps_are_not_read(tmp_path):
    """With summary.json the analysed steps are the profiled ones: a damaged routing elsewhere (a
    diverged step's NaN) is not read, as the losses of those steps are not."""
    run = write_moe_run(tmp_path / "run")
    _edit_row(0, moe_aux_loss=math.nan, moe_load_imbalance="x")(run)
    assert analyze(run)["moe"]["steps"] == [2, 3]
    (run / "summary.json").unlink()
    with pytest.raises(BadFile, match="metrics.jsonl:1: moe_aux_loss must be a finite number"):
        analyze(run)


# -- the report and the comparison --------------------------------------------------------------

def test_report_shows_the_experts_and_the_ep_alltoall(tmp_path):
    run = write_moe_run(tmp_path / "run")  # two profiled steps: training steps 2 and 3
    write_trace(run / "traces" / "rank0.json", ep_cpu_events() + ep_cpu_events(t0=100.0, step=2))
    page = render_html(analyze(run))
    assert "<dt>mixture of experts</dt><dd>8 experts · top-2 · ep 2</dd>" in page
    assert ("<dt>expert load</dt><dd>busiest expert 2.19× the mean · 1.17% dropped · aux loss 1.2 "
            "(median of 2 profiled steps)</dd>") in page
    bars = _Rects()
    bars.feed(page)  # its own segment in the ledger bar, beside the rest of the exposed comm (ms of 100)
    widths = {part: width for _, part, _, width in bars.segments}
    assert [part for _, part, _, _ in bars.segments] == ["compute", "ep_exposed", "comm_exposed"]
    assert (widths["ep_exposed"], widths["comm_exposed"]) == pytest.approx((0.10 * LEDGER_BAR_W,
                                                                           0.05 * LEDGER_BAR_W))
    assert "The exposed EP all-to-all is expert parallelism's" in page
    steps = page[page.index('id="steps"'):page.index('id="phases"')]
    assert '<th class="n">EP all-to-all exposed</th><th class="n">EP all-to-all hidden</th>' in steps
    assert '<td class="n">10.0</td><td class="n">6.00</td>' in steps
    assert "<title>exposed EP all-to-all 10%</title>" in steps
    page = render_html(analyze(write_run(tmp_path / "dense")))
    assert "mixture of experts" not in page and "ep_exposed" not in page and "EP all-to-all" not in page


def test_report_without_config_takes_the_experts_from_the_records(tmp_path):
    run = write_moe_run(tmp_path / "run")
    (run / "config.toml").unlink()
    analysis = analyze(run)
    assert analysis["run"]["moe"] == {"experts": 8, "top_k": None}  # the length of moe_expert_tokens
    assert analysis["run"]["ep"] == 2  # memory.json
    assert "<dt>mixture of experts</dt><dd>8 experts · ep 2</dd>" in render_html(analysis)


def test_compare_names_the_ep_and_moe_keys_that_differ(tmp_path):
    def run(name: str, config: str = MOE_CONFIG, ep_trace: bool = True) -> dict:
        folder = write_moe_run(tmp_path / name, config)
        if ep_trace:
            write_trace(folder / "traces" / "rank0.json", ep_cpu_events())
        return analyze(folder)

    ep2, ep4 = run("ep2"), run("ep4", MOE_CONFIG.replace("ep = 2", "ep = 4"))
    r = compare(ep2, ep4)
    assert r["layout"] == [{"key": "parallel.ep", "a": 2, "b": 4}]
    assert r["why"]["config_key"] == "parallel.ep" and "parallel.ep = 4 in B, 2 in A" in r["why"]["text"]
    assert (r["a"]["ep"], r["b"]["moe"]["experts"]) == (2, 8)
    assert "8 experts top-2, ep 4)" in render_compare(r).splitlines()[1]
    assert "ep_alltoall" in r["collectives"]
    aux = run("aux", MOE_CONFIG.replace("moe_capacity_factor = 1.25", "moe_capacity_factor = 1.25\n"
                                        "moe_aux_loss_coef = 0.1"))
    r = compare(ep2, aux)
    assert r["layout"] == [{"key": "model.moe_aux_loss_coef", "a": 0.01, "b": 0.1}]
    assert "model.moe_aux_loss_coef = 0.1 in B, 0.01 in A" in r["why"]["text"]
    dense = analyze(write_run(tmp_path / "dense"))
    assert compare(dense, ep2)["layout"] == [{"key": "parallel.ep", "a": 1, "b": 2},
                                             {"key": "model.moe_experts", "a": 0, "b": 8}]
    assert compare(ep2, run("same"))["layout"] == []


def overlapped_cpu_events() -> list[dict]:
    """One 100 ms gloo step of DualPipeV's overlapped forward (main thread) and backward (a helper
    thread carrying its `PP:` action, loom/parallel/fb_overlap.py), ms:
    main    mm 0-20 · ep_alltoall 20-40 (issued 20-21, gloo 21-40) · mm 40-70 · its turn's wait 70-80 ·
            mm 80-100
    helper  mm backward 0-30 · _AllToAllBackward 30-60 holding ep_alltoall 30-60 (issued 30-31, gloo
            31-60) · mm backward 60-75 · a node 75-90 holding its turn's wait 75-90 · nothing 90-100"""
    helper, gloo2 = 13, 14
    two, f32 = ["float", "float"], {"Input_type": ["float"]}
    node = "autograd::engine::evaluate_function: "
    return [
        X("ProfilerStep#1", 0, 100, "user_annotation"),
        X("PP:(0F1;3B0)OVERLAP_F_B", 0, 100, "user_annotation"),
        X("PP:0F1", 0, 100, "user_annotation"), X("aten::mm", 0, 20),
        X(EP_ALLTOALL, 20, 20, "user_annotation"),
        X("c10d::alltoall_base_", 20, 1, Input_Dims=[[512, 64], [512, 64]], Input_type=two),
        X("gloo:all_to_all", 21, 19, "user_annotation", tid=GLOO, Input_Dims=[[512, 64]], **f32),
        X("aten::mm", 40, 30), X("fb_overlap_wait", 70, 10, "user_annotation"), X("aten::mm", 80, 20),
        X("PP:3B0", 0, 100, "user_annotation", tid=helper), X(node + "MmBackward0", 0, 30, tid=helper),
        X(node + "_AllToAllBackward", 30, 30, tid=helper),
        X(EP_ALLTOALL, 30, 30, "user_annotation", tid=helper),
        X("c10d::alltoall_base_", 30, 1, tid=helper, Input_Dims=[[512, 64], [512, 64]], Input_type=two),
        X("gloo:all_to_all", 31, 29, "user_annotation", tid=gloo2, Input_Dims=[[512, 64]], **f32),
        X(node + "MmBackward0", 60, 15, tid=helper), X(node + "_AllToAllBackward", 75, 15, tid=helper),
        X("fb_overlap_wait", 75, 15, "user_annotation", tid=helper),
    ]


def test_an_overlapped_backward_computes_beside_the_main_thread(tmp_path):
    """compute 0-30 (both or the helper), 40-75 (the main thread, and the helper until 75), 80-100;
    exposed 30-40 (both sides in their all-to-alls); idle 75-80 (both waiting for a turn); hidden: the
    main thread's all-to-all 20-30 under the helper's compute, the helper's 40-60 under the main's."""
    led = analyze_dir(write_trace(tmp_path / "rank0.json", overlapped_cpu_events()))["ranks"]["0"]
    (s,) = led["steps"]
    assert _parts(s) == (100.0, 85.0, 10.0, 30.0, 5.0)
    assert (s["ep_exposed_ms"], s["ep_hidden_ms"]) == (10.0, 30.0)
    assert (s["forward_ms"], s["backward_ms"]) == (100.0, 100.0)  # the two at once
