"""`loom analyze --compare RUN_A RUN_B` on crafted GPU-style traces with a known difference: B's
backward kernel twice as long, or B's reduce-scatter exposed after backward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_ledger import GPU_PID, X, write_trace

from loom.cli import main
from loom.errors import LoomError
from loom.observe.analyze import analyze
from loom.observe.compare import compare, compare_runs, op_phase, render_compare, render_compare_html

ROOT = Path(__file__).resolve().parents[2]
FWD, BWD, OPT = "ampere_sgemm_128x64_tn", "ampere_sgemm_128x64_nt", "multi_tensor_apply_kernel"
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def step_events(step: int, t0: float, data=5.0, fwd=30.0, bwd=40.0, rs=20.0, exposed=0.0, opt=15.0,
                idle=10.0) -> tuple[list[dict], float]:
    """One step of a GPU rank (ms): loom/data (GPU idle) · forward kernel · backward kernel with a
    reduce-scatter ending `exposed` ms after it (the rest hidden under it) · optimizer kernel · idle."""
    t1 = t0 + data
    t2 = t1 + fwd
    t3 = t2 + bwd + exposed
    end = t3 + opt + idle
    rpc = {"Process_Group_Name": "0", "Group_size": 2}
    return [
        X(f"ProfilerStep#{step}", t0, end - t0, "user_annotation"),
        X("loom/data", t0, data, "user_annotation"),
        X("loom/forward", t1, fwd, "user_annotation"),
        X(FWD, t1, fwd, "kernel", tid=7, pid=GPU_PID),
        X("loom/backward", t2, bwd + exposed, "user_annotation"),
        X("c10d::_reduce_scatter_base_", t2 + 0.5, 1),
        X("record_param_comms", t2 + 0.6, 0.5, Collective_name="_reduce_scatter_base", In_msg_nelems=2**20,
          Out_msg_nelems=2**19, dtype="Float", Seq=step, **rpc),
        X(BWD, t2, bwd, "kernel", tid=7, pid=GPU_PID),
        X(RS, t3 - rs, rs, "kernel", tid=20, pid=GPU_PID),
        X("loom/optimizer", t3, opt, "user_annotation"),
        X(OPT, t3, opt, "kernel", tid=7, pid=GPU_PID),
    ], end


def write_run(folder: Path, steps: int = 2, **shape) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    events, t = [], 0.0
    for n in range(1, steps + 1):
        evs, t = step_events(n, t, **shape)
        events += evs
    write_trace(folder / "rank0.json", events, rank=0, world=2)
    return folder


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    """A as a loom run directory (traces/ inside), the others as bare trace folders."""
    write_run(tmp_path / "a" / "traces")
    return {"a": tmp_path / "a",
            "slow_bwd": write_run(tmp_path / "slow_bwd", bwd=80.0),
            "exposed_rs": write_run(tmp_path / "exposed_rs", rs=50.0, exposed=30.0),
            "same": write_run(tmp_path / "same", steps=3)}


def test_doubled_backward_kernel(runs):
    r = compare_runs(runs["a"], runs["slow_bwd"])
    assert r["warnings"] == []
    assert (r["step"]["a_ms"], r["step"]["b_ms"], r["step"]["ratio"]) == (100.0, 140.0, 1.4)
    assert r["phases"]["backward"]["ratio"] == 2.0
    assert r["phases"]["forward"]["ratio"] == r["phases"]["optimizer"]["ratio"] == 1.0
    assert r["shares"]["compute"] == {"a": 85.0, "b": round(100 * 125 / 140, 2),
                                      "delta": round(100 * 125 / 140 - 85, 2)}
    assert r["shares"]["comm_overlapped"]["a"] == 20.0 and r["shares"]["comm_exposed"]["b"] == 0.0
    first = r["ops"][0]
    assert (first["name"], first["a_ms"], first["b_ms"], first["delta_ms"]) == (BWD, 40.0, 80.0, 40.0)
    assert all(o["delta_ms"] == 0 for o in r["ops"][1:])
    rs = r["collectives"]["reduce_scatter"]
    assert rs["a"] == rs["b"] == {"count": 1.0, "bytes": 4 * 2**20, "ms": 20.0}
    why = r["why"]
    assert why["phase"]["phase"] == "backward" and why["phase"]["fraction"] == 1.0
    assert why["culprit"] == {"type": "op", "name": BWD, "a_ms": 40.0, "b_ms": 80.0, "delta_ms": 40.0}
    assert why["part"]["part"] == "compute"
    text = why["text"]
    assert text.startswith("B's step is 1.40× A's: +40.0 ms per step (100.0 ms → 140.0 ms).")
    assert "100% of the difference is in backward (40.0 ms → 80.0 ms, 2.00×)" in text
    assert f"there {BWD} grew +40.0 ms" in text
    assert why["config_key"] is None  # B's diagnosis finds nothing to fix


def test_exposed_reduce_scatter_names_the_collective_and_the_config_key(runs):
    r = compare_runs(runs["a"], runs["exposed_rs"])
    assert r["step"]["ratio"] == 1.3
    assert r["shares"]["comm_exposed"] == {"a": 0.0, "b": round(3000 / 130, 2), "delta": round(3000 / 130, 2)}
    assert r["parts"]["comm_exposed"]["delta_ms"] == 30.0
    assert r["collectives"]["reduce_scatter"]["delta_ms"] == 30.0
    why = r["why"]
    assert why["compute"]["changed"] and why["part"]["part"] == "comm_exposed"
    assert why["phase"]["phase"] == "backward"
    assert why["culprit"]["type"] == "collective" and why["culprit"]["name"] == "reduce_scatter"
    # diagnose.py's key for sharded collectives: one reduce-scatter a step is one FSDP unit, nothing to
    # prefetch; smaller units (4 MiB now) overlap
    assert why["config_key"] == "parallel.fsdp_unit_mb"
    assert [f["category"] for f in r["findings"]["new_in_b"]] == ["comm"]
    text = why["text"]
    assert "Compute share 85% → 65%: the difference is mostly exposed communication (0% → 23%, +30.0 ms)" \
        in text
    assert "there reduce_scatter time grew +30.0 ms per step (20.0 ms → 50.0 ms; exposed communication " \
           "0% → 23%)" in text
    assert "look at parallel.fsdp_unit_mb = 1  (now unknown: the model is one FSDP unit of 4.0 MiB" in text
    # reversed: B is the faster run, and A's finding is gone in B
    back = compare_runs(runs["exposed_rs"], runs["a"])
    assert back["step"]["delta_ms"] == -30.0 and back["why"]["culprit"]["name"] == "reduce_scatter"
    assert "reduce_scatter time shrank −30.0 ms" in back["why"]["text"]
    assert "(parallel.fsdp_unit_mb) is gone in B" in back["why"]["text"]


def test_same_step_and_json_roundtrip(runs):
    r = compare(analyze(runs["a"]), analyze(runs["same"]))  # 2 vs 3 steps: per step they match
    assert r["step"]["ratio"] == 1.0 and r["why"]["phase"] is None
    assert r["why"]["text"].startswith("B's step matches A's (1.00×")
    assert json.loads(json.dumps(r)) == r
    out = render_compare(r)
    assert "phase (ms per step)" in out and "why: B's step matches" in out
    assert all(len(line) <= 110 for line in out.splitlines()[2:])  # the lines after the runs' paths


def test_render_lists_shares_phases_collectives_and_ops(runs):
    out = render_compare(compare_runs(runs["a"], runs["slow_bwd"]))
    lines = out.splitlines()
    assert any(line.split()[:4] == ["backward", "40.00", "80.00", "2.00×"] for line in lines)
    assert any(line.split()[:3] == ["compute", "85.0%", "89.3%"] for line in lines)
    assert any(line.startswith("reduce_scatter") for line in lines)
    ops = lines.index(next(line for line in lines if line.startswith("ops / kernels changed most")))
    assert lines[ops + 1].split() == [BWD, "40.00", "80.00", "+40.00"]
    html = render_compare_html(compare_runs(runs["a"], runs["slow_bwd"]))
    assert html.startswith("<!DOCTYPE html>") and BWD in html and "<script" not in html


def test_op_phase_from_names():
    assert op_phase("autograd::engine::evaluate_function: AddmmBackward0") == "backward"
    assert op_phase("flash_bwd_kernel") == "backward"
    assert op_phase("Optimizer.zero_grad#AdamW.zero_grad") == "optimizer"
    assert op_phase(OPT) == "optimizer"
    assert op_phase(FWD) is None


def test_cli_compare_table_json_html_and_errors(runs, tmp_path, capsys):
    assert main(["analyze", "--compare", str(runs["a"]), str(runs["slow_bwd"]), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["phases"]["backward"]["ratio"] == 2.0
    assert main(["analyze", "--compare", str(runs["a"]), str(runs["slow_bwd"]), "--format", "html",
                 "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.html").is_file() and (tmp_path / "cmp" / "compare.json").is_file()
    assert not (runs["a"] / "ledger.json").exists()  # comparing writes nothing into the runs
    for argv, needle in (
            (["analyze"], "pass TRACE_DIR or --compare RUN_A RUN_B"),
            (["analyze", str(runs["a"]), "--compare", str(runs["a"]), str(runs["same"])], "not both"),
            (["analyze", "--compare", str(runs["a"]), str(runs["same"]), "--format", "html"], "--out DIR"),
            (["analyze", "--compare", str(tmp_path), str(runs["same"])], "--compare RUN_A: no trace files")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("loom: error: ") and needle in err[0], err


def _loom(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_subprocess_prints_the_comparison(runs):
    p = _loom("analyze", "--compare", str(runs["a"]), str(runs["slow_bwd"]))
    assert p.returncode == 0, p.stderr
    assert "ops / kernels changed most" in p.stdout and "why: B's step is 1.40× A's" in p.stdout
    assert "is in backward" in " ".join(p.stdout.split())  # the why paragraph is wrapped


def test_cli_subprocess_bad_path_is_one_line(tmp_path):
    p = _loom("analyze", "--compare", str(tmp_path / "nope"), str(tmp_path))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == (f"loom: error: --compare RUN_A: {tmp_path / 'nope'} does not exist; pass a "
                                "folder of per-rank Chrome traces or a loom run directory (the one holding "
                                "traces/)")


def test_compare_imports_no_torch():
    code = ("import sys, loom.observe.compare; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_bad_run_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(LoomError, match="--compare RUN_B: .*file is not a directory"):
        compare_runs(tmp_path, tmp_path / "file")


def test_unsized_collectives_and_an_empty_run():
    step = {"step": 1, "wall_ms": 10.0, "compute_ms": 10.0, "comm_exposed_ms": 0.0, "comm_hidden_ms": 0.0,
            "io_ms": 0.0, "idle_ms": 0.0, "forward_ms": 4.0, "backward_ms": 6.0, "optimizer_ms": 0.0,
            "data_ms": 0.0, "shares": {"compute": 100.0, "comm_exposed": 0.0, "io": 0.0, "idle": 0.0}}
    coll = {"step": 1, "kind": "all_reduce", "bytes": None, "duration_ms": 2.0}
    a = {"ranks": {"0": {"kind": "cpu", "steps": [step], "collectives": [coll], "top_ops": []}}}
    r = compare(a, a)
    assert r["collectives"]["all_reduce"]["a"] == {"count": 1.0, "bytes": None, "ms": 2.0}
    assert r["collectives"]["all_reduce"]["delta_bytes"] is None and "—" in render_compare(r)
    empty = compare(a, {"ranks": {}})
    assert empty["warnings"] == ["B has no profiled steps: nothing to compare",
                                 "A has 1 rank(s) and B 0: collectives per rank differ by design"]
    assert empty["why"]["text"].startswith("Nothing to compare: B has no profiled steps")
    render_compare(empty)
