"""Context parallelism in the step ledger, the diagnosis, the report and the comparison: synthetic
traces where CP's exchanges run inside their profiler ranges (`cp_ring`, `cp_alltoall`) beside a
pipeline send outside them, with a known answer."""

from __future__ import annotations

import tomllib

import pytest
from test_ledger import GPU_PID, X, write_trace
from test_report import _Rects

from loom.observe.analyze import analyze, run_config
from loom.observe.compare import compare
from loom.observe.diagnose import diagnose, try_text
from loom.observe.ledger import analyze_dir
from loom.observe.report import LEDGER_BAR_W, render_html

MAIN, GLOO = 11, 12


def cp_cpu_events(ring: bool = True, alltoall: bool = True, t0: float = 0.0, step: int = 1) -> list[dict]:
    """One 100 ms gloo step on the main thread (ms after t0), CP's exchanges inside the ops of their
    autograd Functions as torch records them (_RingAttention 20-35, _AllToAll 40-50):
    mm 0-20 · cp_ring 20-22: send 20-21 (gloo span on this thread 20.5-21), recv 21-22 (gloo's thread
    21.5-35) · mm 22-30 under the recv · cp_ring 30-35: its wait · mm 35-39.5 · cp_alltoall 39.5-50:
    the all-to-all 40-42 (gloo 42-50) and its wait · mm 50-60 · the pipeline's send 60-61 (gloo span
    60.5-64, waited for) · mm 64-100. Without the ring or the all-to-all their time is compute (the mm
    stretched over it)."""
    def x(name, start, dur, cat="cpu_op", tid=MAIN, **args):
        return X(name, t0 + start, dur, cat, tid=tid, **args)

    f32 = {"Input_type": ["float"]}
    events = [x(f"ProfilerStep#{step}", 0, 100, "user_annotation"), x("aten::mm", 0, 20),
              x("aten::mm", 35, 4.5), x("aten::mm", 50, 10),
              x("c10d::send", 60, 1, Input_Dims=[[[256]]], Input_type=["TensorList"]),
              x("gloo:send", 60.5, 3.5, "user_annotation", Input_Dims=[[256]], **f32),
              x("aten::mm", 64, 36)]
    if ring:
        events += [x("_RingAttention", 20, 15), x("cp_ring", 20, 2, "user_annotation"),
                   x("cp_ring", 30, 5, "user_annotation"),
                   x("c10d::send", 20, 1, Input_Dims=[[[1024]]], Input_type=["TensorList"]),
                   x("gloo:send", 20.5, 0.5, "user_annotation", Input_Dims=[[1024]], **f32),
                   x("c10d::recv_", 21, 1, Input_Dims=[[[1024]]], Input_type=["TensorList"]),
                   x("gloo:recv", 21.5, 13.5, "user_annotation", tid=GLOO, Input_Dims=[[1024]], **f32),
                   x("aten::mm", 22, 8)]
    else:
        events.append(x("aten::mm", 20, 15))
    if alltoall:
        events += [x("_AllToAll", 39.5, 10.5), x("cp_alltoall", 39.5, 10.5, "user_annotation"),
                   x("c10d::alltoall_base_", 40, 2, Input_Dims=[[512], [512]], Input_type=["float", "float"]),
                   x("gloo:all_to_all", 42, 8, "user_annotation", tid=GLOO, Input_Dims=[[512]], **f32)]
    else:
        events.append(x("aten::mm", 39.5, 10.5))
    return events


def test_cp_exchanges_have_their_own_kinds_and_time(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", cp_cpu_events())
    led = analyze_dir(tmp_path)["ranks"]["0"]
    (s,) = led["steps"]
    # exposed: ring 20-22 + 30-35, all-to-all 39.5-50 (in its range before its op too), pipeline 60-64;
    # hidden: the ring's recv under 22-30
    assert (s["wall_ms"], s["compute_ms"], s["comm_exposed_ms"], s["comm_hidden_ms"], s["idle_ms"]) == (
        100.0, 78.5, 21.5, 8.0, 0.0)
    assert (s["cp_exposed_ms"], s["cp_hidden_ms"]) == (17.5, 8.0)
    kinds = [(c["kind"], c["bytes"], c["start_us"] - c["enqueue_us"], c["duration_ms"])
             for c in led["collectives"]]
    assert kinds == [("cp_ring", 4096, 500.0, 0.5), ("cp_ring", 4096, 500.0, 13.5),
                     ("cp_alltoall", 2048, 2000.0, 8.0), ("send", 1024, 500.0, 3.5)]
    (tmp_path / "ring").mkdir()
    ring_only = analyze_dir(write_trace(tmp_path / "ring" / "rank0.json", cp_cpu_events(alltoall=False)))
    (s,) = ring_only["ranks"]["0"]["steps"]
    assert (s["comm_exposed_ms"], s["cp_exposed_ms"], s["cp_hidden_ms"]) == (11.0, 7.0, 8.0)


def test_without_cp_ranges_the_same_p2p_is_the_pipelines(tmp_path):
    plain = [e for e in cp_cpu_events(alltoall=False) if e["name"] not in ("cp_ring", "_RingAttention")]
    led = analyze_dir(write_trace(tmp_path / "rank0.json", plain))["ranks"]["0"]
    assert [c["kind"] for c in led["collectives"]] == ["send", "recv", "send"]
    assert "cp_exposed_ms" not in led["steps"][0]  # no CP in the run: the step keys are as before
    assert led["steps"][0]["comm_exposed_ms"] == 11.0


def test_gpu_cp_exchange_is_its_kernel(tmp_path):
    """GPU: gemm 0-30, CP's SendRecv kernel 20-40 (issued in cp_ring), gemm 45-50, the pipeline's
    SendRecv 50-60, gemm 60-100."""
    sendrecv = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
    events = [X("ProfilerStep#1", 0, 100, "user_annotation"),
              X("cp_ring", 15, 2, "user_annotation"), X("c10d::send", 15, 1),
              X("c10d::send", 48, 1),
              X("gemm", 0, 30, "kernel", tid=7, pid=GPU_PID), X("gemm", 45, 5, "kernel", tid=7, pid=GPU_PID),
              X("gemm", 60, 40, "kernel", tid=7, pid=GPU_PID),
              X(sendrecv, 20, 20, "kernel", tid=20, pid=GPU_PID),
              X(sendrecv, 50, 10, "kernel", tid=20, pid=GPU_PID)]
    led = analyze_dir(write_trace(tmp_path / "rank0.json", events))["ranks"]["0"]
    (s,) = led["steps"]
    parts = (s["compute_ms"], s["comm_exposed_ms"], s["comm_hidden_ms"], s["idle_ms"])
    assert parts == (75.0, 20.0, 10.0, 5.0)
    assert (s["cp_exposed_ms"], s["cp_hidden_ms"]) == (10.0, 10.0)
    assert [(c["kind"], c["duration_ms"]) for c in led["collectives"]] == [("cp_ring", 20.0), ("send", 10.0)]


# -- the diagnosis --------------------------------------------------------------------------------

def cp_step(cp_exposed: float, other_exposed: float = 2.0, io: float = 0.0, wall: float = 100.0) -> dict:
    """A 100 ms ledger step: CP's exchange exposed `cp_exposed` ms of the exposed comm."""
    exposed = cp_exposed + other_exposed
    compute = wall - exposed - io
    return {"step": 1, "wall_ms": wall, "compute_ms": compute, "comm_exposed_ms": exposed,
            "comm_hidden_ms": 5.0, "cp_exposed_ms": cp_exposed, "cp_hidden_ms": 5.0, "io_ms": io,
            "idle_ms": 0.0, "forward_ms": 30.0, "backward_ms": 50.0, "optimizer_ms": 5.0, "data_ms": io,
            "host_syncs": 0, "shares": {"compute": compute, "comm_exposed": exposed, "io": io, "idle": 0.0}}


def cp_ledger(kind: str, cp_exposed: float = 30.0, io: float = 0.0) -> dict:
    # the all-gathers take longer than CP's exchange, yet CP's measured exposed time decides the split
    calls = [{"step": 1, "kind": kind, "duration_ms": 5.0, "bytes": 1 << 20} for _ in range(4)]
    calls += [{"step": 1, "kind": "all_gather", "duration_ms": 40.0, "bytes": 8 << 20} for _ in range(4)]
    steps = [cp_step(cp_exposed, io=io)]
    return {"ranks": {str(r): {"steps": steps, "collectives": calls} for r in range(2)}, "stragglers": []}


def cp_finding(kind: str, parallel: dict, model: dict | None = None, cp_exposed: float = 30.0) -> dict:
    findings = [f for f in diagnose(cp_ledger(kind, cp_exposed), {"parallel": parallel, "model": model or {}})
                if f.get("kind", "").startswith("cp_")]
    assert len(findings) <= 1, findings
    if not findings:
        return {}
    (f,) = findings
    if f["knob"]:  # the TRY line is TOML
        line = try_text(f).split("  (", 1)[0]
        assert tomllib.loads(line.replace(f["knob"], "k", 1))["k"] == f["value"], line
    return f


@pytest.mark.parametrize("kind, parallel, model, knob, value", [
    # ring, 12 heads (MHA) divide by 4: the all-to-alls move (12 + 12) / (12 · 4) = 0.5× the ring's bytes
    ("cp_ring", {"cp": 4, "cp_mode": "ring"}, {"preset": "125m"}, "parallel.cp_mode", "alltoall"),
    # ring, GQA 32 / 8 heads: 1.25× the ring's bytes over 4 ranks (fewer ranks), 0.625× over 8
    ("cp_ring", {"cp": 4, "cp_mode": "ring"}, {"preset": "1b"}, "parallel.cp", 2),
    ("cp_ring", {"cp": 8, "cp_mode": "ring"}, {"preset": "1b"}, "parallel.cp_mode", "alltoall"),
    # ring, 12 heads do not divide by 8: fewer cp ranks, more attention per hop
    ("cp_ring", {"cp": 8, "cp_mode": "ring"}, {"preset": "125m"}, "parallel.cp", 4),
    # ring over 2 ranks: the all-to-alls would move at least as many bytes
    ("cp_ring", {"cp": 2, "cp_mode": "ring"}, {"preset": "125m"}, "parallel.cp", 1),
    # 8 heads over 4 kv heads that 8 ranks do not divide: repeated to 8, (8 + 8) / (4 · 8) = 0.5×
    ("cp_ring", {"cp": 8, "cp_mode": "ring"}, {"preset": "small"}, "parallel.cp_mode", "alltoall"),
    # 2 kv heads repeated to 8: (8 + 8) / (2 · 8) = 1× the ring's bytes, no gain (not (8 + 2) / 16)
    ("cp_ring", {"cp": 8, "cp_mode": "ring"}, {"preset": "small", "n_kv_heads": 2}, "parallel.cp", 4),
    # 16 heads over the preset's 4 kv heads: 1.25× the ring's bytes over 4 ranks (16 kv heads: 0.5×)
    ("cp_ring", {"cp": 4, "cp_mode": "ring"}, {"preset": "small", "n_heads": 16}, "parallel.cp", 2),
    ("cp_ring", {"cp": 4, "cp_mode": "ring"}, {"preset": "small", "n_heads": 16, "n_kv_heads": 16},
     "parallel.cp_mode", "alltoall"),
    # heads unknown (the shape comes from init_from's folder): fewer cp ranks
    ("cp_ring", {"cp": 4, "cp_mode": "ring"}, {"preset": "125m", "init_from": "/models/x"}, "parallel.cp", 2),
    ("cp_alltoall", {"cp": 4, "cp_mode": "alltoall"}, {"preset": "1b"}, "parallel.cp_mode", "ring"),
])
def test_exposed_cp_exchange_names_the_knob(kind, parallel, model, knob, value):
    f = cp_finding(kind, parallel, model)
    assert (f["category"], f["knob"], f["value"]) == ("comm", knob, value)
    assert f"{kind} exposed: 30% of the step" in f["title"]
    assert f"cp {parallel['cp']} ({parallel['cp_mode']})" in f["evidence"]  # the layout that ran


def test_cp_finding_in_the_experts_order_and_threshold():
    """Compute share first: IO (an input stall) before exposed communication, CP's exchange among
    the kinds of exposed communication, before the phases (the optimizer at 40%)."""
    ledger = cp_ledger("cp_ring", io=20.0)
    for info in ledger["ranks"].values():
        info["steps"][0]["optimizer_ms"] = 40.0
    findings = diagnose(ledger, {"parallel": {"cp": 4}, "model": {"preset": "1b"}})
    assert [(f["category"], f.get("kind")) for f in findings] == [("io", None), ("comm", "cp_ring"),
                                                                  ("optimizer", None)]
    assert cp_finding("cp_ring", {"cp": 4}, {"preset": "1b"}, cp_exposed=5.0) == {}  # 7% exposed: none


# -- the report and the comparison --------------------------------------------------------------

def test_report_shows_cp_exchange_and_the_layout(tmp_path):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    write_trace(run / "traces" / "rank0.json", cp_cpu_events(alltoall=False))
    (run / "config.toml").write_text('[model]\npreset = "1b"\ninit_from = ""\n'
                                     '[parallel]\nstrategy = "zero3"\ncp = 4\ncp_mode = "ring"\n')
    parallel = run_config(run / "config.toml")["parallel"]
    assert (parallel["cp"], parallel["cp_mode"]) == (4, "ring")
    analysis = analyze(run)
    page = render_html(analysis)
    assert "<dt>context parallel</dt><dd>cp 4 · ring</dd>" in page
    bars = _Rects()
    bars.feed(page)  # its own segment in the ledger bar, beside the rest of the exposed comm (ms of 100)
    widths = {part: width for _, part, _, width in bars.segments}
    assert [part for _, part, _, _ in bars.segments] == ["compute", "cp_exposed", "comm_exposed"]  # no IO
    assert (widths["cp_exposed"], widths["comm_exposed"]) == pytest.approx((0.07 * LEDGER_BAR_W,
                                                                           0.04 * LEDGER_BAR_W))
    steps = page[page.index('id="steps"'):page.index('id="phases"')]  # the per-step table and bars
    assert '<th class="n">CP exchange exposed</th><th class="n">CP exchange hidden</th>' in steps
    assert "<td class=\"n\">7.00</td><td class=\"n\">8.00</td>" in steps
    assert "<title>exposed CP exchange 7.0%</title>" in steps
    plain = run.parent / "plain"
    (plain / "traces").mkdir(parents=True)
    write_trace(plain / "traces" / "rank0.json", cp_cpu_events(ring=False, alltoall=False))
    page = render_html(analyze(plain))
    assert "context parallel" not in page and "cp_exposed" not in page and "CP exchange" not in page


def test_compare_names_the_cp_key_that_differs(tmp_path):
    def run(name: str, cp: int, mode: str, ring: bool) -> dict:
        folder = tmp_path / name
        (folder / "traces").mkdir(parents=True)
        write_trace(folder / "traces" / "rank0.json", cp_cpu_events(ring=ring, alltoall=not ring))
        (folder / "config.toml").write_text(f'[parallel]\ncp = {cp}\ncp_mode = "{mode}"\n')
        return analyze(folder)

    ring, alltoall = run("a", 4, "ring", True), run("b", 4, "alltoall", False)
    ring8 = run("c", 8, "ring", True)
    r = compare(ring, alltoall)
    assert r["layout"] == [{"key": "parallel.cp_mode", "a": "ring", "b": "alltoall"}]
    assert r["why"]["config_key"] == "parallel.cp_mode"
    assert 'parallel.cp_mode = "alltoall" in B, "ring" in A' in r["why"]["text"]
    r = compare(ring, ring8)
    assert r["layout"] == [{"key": "parallel.cp", "a": 4, "b": 8}]
    assert compare(ring, ring)["layout"] == []


def test_compare_names_the_stage_split_that_differs(tmp_path):
    """Two runs of one pipeline, their blocks split otherwise: that key is the difference made ([]:
    evenly); another pp, or the same split, is not a split that differs."""
    def run(name: str, pp: int, split: str) -> dict:
        folder = tmp_path / name
        (folder / "traces").mkdir(parents=True)
        write_trace(folder / "traces" / "rank0.json", cp_cpu_events(ring=True, alltoall=False))
        (folder / "config.toml").write_text(f"[parallel]\npp = {pp}\npp_stage_layers = {split}\n")
        return analyze(folder)

    even, balanced = run("a", 2, "[]"), run("b", 2, "[3, 1]")
    r = compare(even, balanced)
    assert r["layout"] == [{"key": "parallel.pp_stage_layers", "a": [], "b": [3, 1]}]
    assert "parallel.pp_stage_layers = [3, 1] in B, [] in A" in r["why"]["text"]
    assert compare(balanced, run("c", 2, "[3, 1]"))["layout"] == []
    assert compare(run("d", 4, "[]"), balanced)["layout"] == []
