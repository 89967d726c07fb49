"""Bad-input cases of the planner's and the analysis' inputs (docs/bad-input.md, "Planner and
analysis inputs"): `loom plan`'s numbers (--params, --hw, --nodes, --set), device profiles,
profiler traces and a run's records read by `loom analyze` (and `--compare`). The valid inputs
they start from are tests/analysis_inputs.py's."""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

from analysis_inputs import PROFILE, sample_events, write_run, write_trace
from bad_input import Ctx, case, cli


def profile_with(c: Ctx, edit) -> str:
    """`loom plan` on this machine with LOOM_DEVICE_PROFILE naming the test profile as `edit` leaves it."""
    doc = json.loads(PROFILE.read_text())
    edit(doc)
    path = c.tmp / "device.json"
    path.write_text(json.dumps(doc))
    c.monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(path))
    return cli("plan", "--model", "tiny", capsys=c.capsys)


def analyze(c: Ctx, folder: Path) -> str:
    return cli("analyze", str(folder), "--out", str(c.tmp / "out"), capsys=c.capsys)


def trace_with(c: Ctx, index: int, **changes) -> str:
    """`loom analyze` of a trace whose event `index` has `changes` (a value None: the key removed)."""
    events = sample_events()
    for key, value in changes.items():
        if value is None:
            del events[index][key]
        else:
            events[index][key] = value
    return analyze(c, write_trace(c.tmp / "traces" / "rank0.json", events).parent)


def run_with(c: Ctx, name: str, edit) -> Path:
    run = write_run(c.tmp / name)
    path = run / ("plan.json" if edit[0] == "plan" else "summary.json")
    doc = json.loads(path.read_text())
    edit[1](doc)
    path.write_text(json.dumps(doc))
    return run


# ---------------------------------------------------------------------------------------------
# loom plan: numbers on the command line


@case("plan-params-nan")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--params", "nan", capsys=c.capsys)


@case("plan-params-huge")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--params", "1e30", capsys=c.capsys)


@case("plan-hw-nan")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--hw", "bf16_tflops=nan", capsys=c.capsys)


@case("plan-hw-fraction")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--hw", "achievable_fraction=5",
               capsys=c.capsys)


@case("plan-hw-unknown-key")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--hw", "profile=1", capsys=c.capsys)


@case("plan-nodes-huge")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--nodes", "1000000000", capsys=c.capsys)


@case("plan-set-offload-ddp")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--set", "parallel.strategy=ddp",
               "--set", "parallel.offload=cpu", capsys=c.capsys)


@case("plan-set-sp-seq-len")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--set", "parallel.tp=2", "--set",
               "parallel.sequence_parallel=true", "--set", "data.seq_len=33", capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# device profiles (LOOM_DEVICE_PROFILE, loom plan --calibrate's JSON)


@case("plan-device-profile-empty")
def _(c: Ctx) -> str:
    return profile_with(c, lambda d: d.update(by_ranks={}))


@case("plan-device-profile-wrong-type")
def _(c: Ctx) -> str:
    return profile_with(c, lambda d: d["by_ranks"]["2"]["linear_flops"].update({"128x64": "fast"}))


@case("plan-device-profile-nan")
def _(c: Ctx) -> str:
    return profile_with(c, lambda d: d["by_ranks"]["2"].update(op_overhead_s=math.nan))


@case("plan-device-profile-key")
def _(c: Ctx) -> str:
    return profile_with(c, lambda d: d["by_ranks"].update(two=copy.deepcopy(d["by_ranks"]["2"])))


@case("train-device-profile-empty")
def _(c: Ctx) -> str:
    """`loom train` prices its plan.json on the profile: it is read before any rank starts."""
    doc = json.loads(PROFILE.read_text())
    doc.update(by_ranks={})
    path = c.tmp / "device.json"
    path.write_text(json.dumps(doc))
    c.monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(path))
    return c.train(nproc=2)


# ---------------------------------------------------------------------------------------------
# profiler traces (loom analyze)


@case("analyze-out-empty")
def _(c: Ctx) -> str:
    return cli("analyze", str(c.tmp), "--out", "", capsys=c.capsys)


@case("analyze-trace-pid-list")
def _(c: Ctx) -> str:
    return trace_with(c, 2, pid=[1, 2])


@case("analyze-trace-ts-nan")
def _(c: Ctx) -> str:
    return trace_with(c, 2, ts=math.nan)


@case("analyze-trace-ts-string")
def _(c: Ctx) -> str:
    return trace_with(c, 2, ts="1005")


@case("analyze-trace-dur-missing")
def _(c: Ctx) -> str:
    return trace_with(c, 3, dur=None)


@case("analyze-trace-args-not-mapping")
def _(c: Ctx) -> str:
    return trace_with(c, 4, args=[256])


@case("analyze-trace-not-utf8")
def _(c: Ctx) -> str:
    path = write_trace(c.tmp / "traces" / "rank0.json")
    data = path.read_bytes()
    at = data.index(b"aten::mm")
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    return analyze(c, path.parent)


@case("analyze-trace-not-an-event")
def _(c: Ctx) -> str:
    path = write_trace(c.tmp / "traces" / "rank0.json")
    text = path.read_text()
    at = text.rindex("{", 0, text.index('"aten::mm"'))
    path.write_text(text[:at] + "[1, 2], " + text[at:])
    return analyze(c, path.parent)


@case("analyze-trace-truncated")
def _(c: Ctx) -> str:
    path = write_trace(c.tmp / "traces" / "rank0.json.gz")
    text = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(text)[:60])  # a gzip stream cut before traceEvents begins
    return analyze(c, path.parent)


@case("analyze-trace-header")
def _(c: Ctx) -> str:
    return analyze(c, write_trace(c.tmp / "traces" / "rank0.json", baseTimeNanoseconds="soon").parent)


# ---------------------------------------------------------------------------------------------
# a run's records (loom analyze RUN_DIR, --compare)


@case("analyze-summary-wrong-type")
def _(c: Ctx) -> str:
    return analyze(c, run_with(c, "run", ("summary", lambda d: d.update(measured_vs_planned={"rank": 0}))))


@case("analyze-summary-pair-nan")
def _(c: Ctx) -> str:
    return analyze(c, run_with(c, "run", ("summary", lambda d: d["measured_vs_planned"][0].update(
        model_state_bytes=[1.6e6, math.nan]))))


@case("analyze-plan-wrong-type")
def _(c: Ctx) -> str:
    return analyze(c, run_with(c, "run", ("plan", lambda d: d.update(step_time_s="fast"))))


@case("analyze-config-wrong-type")
def _(c: Ctx) -> str:
    run = write_run(c.tmp / "run")
    (run / "config.toml").write_text('[parallel]\nfsdp_prefetch = "2"\n')
    return analyze(c, run)


@case("analyze-compare-wrong-type")
def _(c: Ctx) -> str:
    a = write_run(c.tmp / "a")
    b = run_with(c, "b", ("plan", lambda d: d.update(memory_bytes={"total": [1]})))
    return cli("analyze", "--compare", str(a), str(b), capsys=c.capsys)
