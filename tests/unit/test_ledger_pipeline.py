"""Pipeline schedules in the step ledger, `loom analyze` and the diagnosis: a synthetic gloo step of
a zero-bubble stage with a known answer — its bubble (the p2p wait for the neighbour stage and the
idle gaps inside the schedule), its B and W phases, and the measured bubble beside the planned one."""

from __future__ import annotations

import json

import pytest
from test_ledger import X, write_trace

from loom.observe.analyze import analyze, render_table
from loom.observe.ledger import _pipeline_classes, analyze_dir

GLOO = 12


def zb_events() -> list[dict]:
    """One 100 ms step (ms): PP:0F0 0-20 (mm) · the recv of the gradient 20-32 (c10d::recv_ and its
    gloo span on this thread: the wait for the next stage) · idle 32-35 · PP:0I0 35-55 (mm) · PP:0W0
    55-70 (mm) · an all-reduce 70-75 (gloo's thread runs it 70.5-74) · idle 75-80 · optimizer 80-100."""
    f32 = {"Input_type": ["float"]}
    return [X("ProfilerStep#1", 0, 100, "user_annotation"),
            X("PP:0F0", 0, 20, "user_annotation"), X("aten::mm", 0, 20),
            X("c10d::recv_", 20, 12, Input_Dims=[[[256]]], Input_type=["TensorList"]),
            X("gloo:recv", 20.5, 11.5, "user_annotation", Input_Dims=[[256]], **f32),
            X("PP:0I0", 35, 20, "user_annotation"), X("aten::mm", 35, 20),
            X("PP:0W0", 55, 15, "user_annotation"), X("aten::mm", 55, 15),
            X("c10d::allreduce_", 70, 5, Input_Dims=[[[64]]], Input_type=["TensorList"]),
            X("gloo:all_reduce", 70.5, 3.5, "user_annotation", tid=GLOO, Input_Dims=[[64]], **f32),
            X("Optimizer.step#AdamW.step", 80, 20, "user_annotation"), X("aten::add_", 80, 20)]


def test_bubble_is_its_own_share_apart_from_other_idle_and_comm(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", zb_events())
    step = analyze_dir(tmp_path)["ranks"]["0"]["steps"][0]
    assert step["bubble_comm_ms"] == pytest.approx(12.0)  # the recv: waiting for stage 1
    assert step["bubble_idle_ms"] == pytest.approx(3.0)  # the gap before PP:0I0, inside the schedule
    assert step["bubble_ms"] == pytest.approx(15.0)
    assert step["shares"]["bubble"] == pytest.approx(15.0)
    # the four still add up to the wall; the all-reduce and the gap after the schedule are not bubble
    assert step["comm_exposed_ms"] == pytest.approx(17.0)
    assert step["idle_ms"] == pytest.approx(8.0)
    assert step["comm_exposed_ms"] - step["bubble_comm_ms"] == pytest.approx(5.0)


def test_b_and_w_are_their_own_phases(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", zb_events())
    step = analyze_dir(tmp_path)["ranks"]["0"]["steps"][0]
    assert step["forward_ms"] == pytest.approx(20.0)
    assert step["backward_input_ms"] == pytest.approx(20.0)
    assert step["backward_weight_ms"] == pytest.approx(15.0)
    assert "overlap_f_b_ms" not in step  # no DualPipeV action in this trace


def test_a_step_without_pipeline_ranges_has_no_bubble(tmp_path):
    events = [e for e in zb_events() if not e["name"].startswith("PP:")]
    write_trace(tmp_path / "trace_rank0.json", events)
    step = analyze_dir(tmp_path)["ranks"]["0"]["steps"][0]
    assert "bubble_ms" not in step and "bubble" not in step["shares"]


def test_1f1b_without_action_ranges_takes_its_span_from_loom_pipeline(tmp_path):
    """torch's Schedule1F1B records no action: loom's range around the schedule marks the span."""
    events = [e for e in zb_events() if not e["name"].startswith("PP:")]
    write_trace(tmp_path / "trace_rank0.json", events + [X("loom/pipeline", 0, 70, "user_annotation")])
    step = analyze_dir(tmp_path)["ranks"]["0"]["steps"][0]
    assert (step["bubble_comm_ms"], step["bubble_idle_ms"]) == pytest.approx((12.0, 3.0))
    assert "backward_input_ms" not in step


@pytest.mark.parametrize("name, classes", [
    ("PP:0F3", ("pp:action", "pp:forward")), ("PP:1I2", ("pp:action", "pp:backward_input")),
    ("PP:1W2", ("pp:action", "pp:backward_weight")), ("PP:12B10", ("pp:action", "pp:backward")),
    ("PP:(0F1;3I0)OVERLAP_F_B", ("pp:action", "pp:overlap_f_b")), ("PP:0SEND_F1", ("pp:action",)),
    ("Forward 3", ("pp:action", "pp:forward")), ("Backward 0", ("pp:action", "pp:backward")),
    ("loom/pipeline", ("pp:action",)), ("aten::mm", ()), ("Forward", ())])
def test_schedule_ranges_are_read_by_name(name, classes):
    assert _pipeline_classes(name) == classes


def run_dir(tmp_path, parallel: str, model: str = "n_layers = 8") -> object:
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    write_trace(run / "traces" / "trace_rank0.json", zb_events(), world=1)
    (run / "plan.json").write_text(json.dumps({"label": "pp2", "pipeline_bubble": 0.05}))
    (run / "config.toml").write_text(f"[parallel]\npp = 2\n{parallel}\n[model]\n{model}\n")
    return run


def test_analyze_puts_the_measured_bubble_beside_the_planned(tmp_path):
    analysis = analyze(run_dir(tmp_path, 'pp_schedule = "1f1b"\nmicrobatches = 8') / "traces")
    assert analysis["pipeline_bubble"] == [{"rank": 0, "measured": 0.15, "planned": 0.05, "ratio": 3.0}]
    assert "rank 0: measured 0.150  planned 0.050  ratio 3.00×" in render_table(analysis)


def _schedule_finding(analysis: dict) -> dict:
    return next(f for f in analysis["findings"] if f.get("kind", "").startswith("recv"))


def test_exposed_bubble_suggests_zbv_where_the_layout_allows(tmp_path):
    f = _schedule_finding(analyze(run_dir(tmp_path, 'pp_schedule = "1f1b"\nmicrobatches = 8') / "traces"))
    assert (f["knob"], f["value"]) == ("parallel.pp_schedule", "zbv")
    assert "planned bubble 0.05" in f["note"]


def test_exposed_bubble_under_experts_suggests_dualpipev(tmp_path):
    run = run_dir(tmp_path, 'pp_schedule = "1f1b"\nmicrobatches = 8\nep = 2', "n_layers = 8\nmoe_experts = 4")
    f = _schedule_finding(analyze(run / "traces"))
    assert (f["knob"], f["value"]) == ("parallel.pp_schedule", "dualpipev")


def test_gpipe_with_too_few_microbatches_for_zbv_gets_1f1b_and_what_zbv_needs(tmp_path):
    f = _schedule_finding(analyze(run_dir(tmp_path, 'pp_schedule = "gpipe"\nmicrobatches = 2') / "traces"))
    assert (f["knob"], f["value"]) == ("parallel.pp_schedule", "1f1b")
    assert "parallel.microbatches ≥ 4 (now 2)" in f["note"]


def test_1f1b_with_too_few_layers_for_zbv_asks_for_more_microbatches(tmp_path):
    run = run_dir(tmp_path, 'pp_schedule = "1f1b"\nmicrobatches = 4', "n_layers = 3")
    f = _schedule_finding(analyze(run / "traces"))
    assert (f["knob"], f["value"]) == ("parallel.microbatches", 8)
    assert "model.n_layers ≥ 4 (now 3)" in f["note"]
