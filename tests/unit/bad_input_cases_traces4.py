"""Bad-input cases: what `loom analyze` is given, fourth pass (docs/bad-input.md, "Planner and
analysis inputs" and "Your files"): a run directory trained without the profiler, a trace with no
events to time (empty, or another tool's), a gzip trace named .json, traces of two runs recorded an
hour apart, and an output folder loom cannot write (a read-only trace folder). Each refusal comes
before anything is written, and the files it was given are unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_inputs import BASE_NS, write_run, write_trace
from bad_input import Ctx, case, cli
from bad_input_cases_user_files import unchanged

from loom.files import RUN_MARKER

INFO = {"backend": "gloo", "rank": 0, "world_size": 2, "pg_count": 1}


def analyze(c: Ctx, *args: str) -> str:
    return cli("analyze", *args, capsys=c.capsys)


def untraced_run(folder: Path) -> Path:
    """A run directory as `loom train` leaves it without the profiler: its records, no traces/."""
    write_run(folder)
    shutil.rmtree(folder / "traces")
    (folder / RUN_MARKER).write_text("a loom run directory\n")
    (folder / "memory.json").write_text(json.dumps({"strategy": "ddp", "ranks": {"0": {"peak_bytes": 1}}}))
    return folder


def as_a_user(c: Ctx, *argv: str) -> str:
    """`loom ARGV`'s one error line where file modes bind: as root (a container's user) in a process
    run without CAP_DAC_OVERRIDE (setpriv), which a read-only folder stops as it stops anyone else."""
    if os.geteuid() != 0:
        return cli(*argv, capsys=c.capsys)
    drop = [shutil.which("setpriv") or "setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    try:
        usable = subprocess.run([*drop, "true"], capture_output=True).returncode == 0
    except OSError:
        usable = False
    if not usable:
        pytest.skip("running as root without setpriv: a read-only folder does not stop root")
    done = subprocess.run([*drop, sys.executable, "-m", "loom.cli", *argv], capture_output=True, text=True,
                          timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("loom: error: "), f"not one error line:\n{done.stderr}"
    return lines[0].removeprefix("loom: error: ")


def read_only(folder: Path) -> Path:
    folder.chmod(0o555)
    return folder


# ---------------------------------------------------------------------------------------------
# a run without traces: said so, not "remove memory.json"


@case("analyze-run-without-traces")
def _(c: Ctx) -> str:
    run = untraced_run(c.tmp / "run")
    with unchanged(run):
        return analyze(c, str(run))


@case("analyze-compare-run-without-traces")
def _(c: Ctx) -> str:
    run = untraced_run(c.tmp / "run")
    profiled = write_run(c.tmp / "profiled")
    with unchanged(run, profiled):
        return analyze(c, "--compare", str(run), str(profiled))


# ---------------------------------------------------------------------------------------------
# a trace with nothing to time: no verdict from no events


@case("analyze-trace-no-events")
def _(c: Ctx) -> str:
    trace = c.tmp / "traces" / "rank0.json"
    trace.parent.mkdir()
    trace.write_text('{"traceEvents": []}')
    return analyze(c, str(trace.parent), "--out", str(c.tmp / "out"))


@case("analyze-trace-no-events-array")
def _(c: Ctx) -> str:
    trace = c.tmp / "traces" / "rank0.json"
    trace.parent.mkdir()
    trace.write_text("[]")
    return analyze(c, str(trace.parent), "--out", str(c.tmp / "out"))


@case("analyze-trace-other-tool")
def _(c: Ctx) -> str:
    # another tool's Chrome trace: begin/end pairs, no torch.profiler step, op or kernel
    events = [{"ph": "B", "name": "frame", "pid": 1, "tid": 1, "ts": 10},
              {"ph": "E", "pid": 1, "tid": 1, "ts": 50}]
    trace = write_trace(c.tmp / "traces" / "rank0.json", events)
    return analyze(c, str(trace.parent), "--out", str(c.tmp / "out"))


# ---------------------------------------------------------------------------------------------
# a gzip trace under a plain name; two runs' ranks in one folder


@case("analyze-trace-gzip-named-json")
def _(c: Ctx) -> str:
    trace = write_trace(c.tmp / "traces" / "rank0.json.gz")
    trace.rename(trace.with_name("rank0.json"))
    return analyze(c, str(trace.parent), "--out", str(c.tmp / "out"))


@case("analyze-trace-runs-apart")
def _(c: Ctx) -> str:
    # the same world size, so only when they ran tells them apart: rank 1's trace is an hour later
    write_trace(c.tmp / "traces" / "rank0.json", distributedInfo=INFO)
    write_trace(c.tmp / "traces" / "rank1.json", distributedInfo=dict(INFO, rank=1),
                baseTimeNanoseconds=BASE_NS + 3600 * 10**9)
    return analyze(c, str(c.tmp / "traces"), "--out", str(c.tmp / "out"))


# ---------------------------------------------------------------------------------------------
# an output folder loom cannot write: said before the analysis, not a traceback after it


@case("analyze-out-read-only")
def _(c: Ctx) -> str:
    shared = write_trace(c.tmp / "shared" / "rank0.json").parent  # a read-only folder of traces
    read_only(shared)
    try:
        with unchanged(shared):
            return as_a_user(c, "analyze", str(shared))
    finally:
        shared.chmod(0o755)


@case("analyze-compare-out-read-only")
def _(c: Ctx) -> str:
    a, b = write_run(c.tmp / "a"), write_run(c.tmp / "b")
    reports = c.tmp / "reports"
    reports.mkdir()
    read_only(reports)
    try:
        with unchanged(a, b):
            return as_a_user(c, "analyze", "--compare", str(a), str(b), "--out", str(reports / "ab"))
    finally:
        reports.chmod(0o755)
