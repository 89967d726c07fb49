"""What the planner and the analysis read, checked where it enters (docs/bad-input.md, "Planner and
analysis inputs"; the fuzzing is tests/unit/test_fuzz_plan.py): device profiles, `--hw`, the
config values `loom plan` plans with, profiler traces, and a run's records. Valid input gives the
numbers it held; each kind of damage is refused in one line naming the file and the field."""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

import pytest
from analysis_inputs import PROFILE, sample_events, write_run, write_trace

from loom.checked import BadFile
from loom.config import load_config, validate
from loom.errors import ConfigError, LoomError
from loom.observe.analyze import analyze, run_config
from loom.observe.ledger import analyze_dir
from loom.observe.trace_events import DAMAGE_CHARS, BadTrace
from loom.plan import device
from loom.plan.hardware import CATALOG, Cluster, with_overrides

VALID = json.loads(PROFILE.read_text())


def _profile(tmp_path: Path, edit) -> Path:
    doc = copy.deepcopy(VALID)
    edit(doc)
    path = tmp_path / "device.json"
    path.write_text(json.dumps(doc))
    return path


# -- device profiles ----------------------------------------------------------------------------

@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(by_ranks={}), "by_ranks is empty"),
    (lambda d: d.update(by_ranks=[1]), "by_ranks must be a JSON object"),
    (lambda d: d["by_ranks"].update({"0": d["by_ranks"]["1"]}), "by_ranks has the key '0'"),
    (lambda d: d["by_ranks"].update({"02": d["by_ranks"]["2"]}), "by_ranks has the key '02'"),
    (lambda d: d["by_ranks"]["1"].update(linear_flops={}), "by_ranks.1.linear_flops is empty"),
    (lambda d: d["by_ranks"]["1"]["linear_flops"].update({"128": 1e9}),
     "by_ranks.1.linear_flops has the key '128'"),
    (lambda d: d["by_ranks"]["1"]["elementwise_bytes"].update({"262144": 0}),
     "by_ranks.1.elementwise_bytes.262144 must be a finite number in (0, 1e+30]"),
    (lambda d: d["by_ranks"]["1"]["attention_flops"].update({"128x32": math.inf}),
     "by_ranks.1.attention_flops.128x32 must be a finite number"),
    (lambda d: d["by_ranks"]["2"]["collectives"]["all_reduce"].update(bytes_per_s=-1),
     "by_ranks.2.collectives.all_reduce.bytes_per_s must be a finite number in (0, 1e+30]"),
    (lambda d: d["by_ranks"]["1"].pop("op_overhead_s"), "by_ranks.1.op_overhead_s is missing"),
    (lambda d: d.update(cores=True), "cores must be an integer ≥ 1, got True (bool)"),
    (lambda d: d.update(device="tpu"), "device must be one of 'cpu', 'cuda'"),
])
def test_device_profile_refusals(tmp_path, edit, field):
    path = _profile(tmp_path, edit)
    with pytest.raises(BadFile) as e:
        device.load(path)
    message = str(e.value)
    assert message.startswith(f"device profile {path}: ") and field in message, message
    assert message.endswith("; measure it again with loom plan --calibrate") and "\n" not in message


def test_profile_from_before_the_in_situ_factor_still_prices(tmp_path):
    """A profile measured before block_in_situ and the optimizer's rate: read, and priced as before
    (factor 1, no measured optimizer), with every other number as written."""
    def older(d):
        for entry in d["by_ranks"].values():
            entry.pop("block_in_situ", None)
            entry.pop("optimizer_s_per_param", None)
    profile = device.load(_profile(tmp_path, older))
    assert profile.block_in_situ(2, 1e6) == 1.0 and profile.optimizer_seconds(2, 1e6) is None
    assert profile.linear_flops(1, 128, 64, 64) == VALID["by_ranks"]["1"]["linear_flops"]["128x64"]
    assert profile.peak_flops(4) == max(VALID["by_ranks"]["4"]["linear_flops"].values())


def test_save_refuses_a_bad_measurement_and_keeps_the_profile_there(tmp_path):
    good = device.save(device.load(PROFILE), tmp_path / "device.json")
    before = good.read_bytes()
    broken = device.load(PROFILE)
    broken.by_ranks["2"]["linear_flops"]["128x64"] = math.nan
    with pytest.raises(BadFile, match="the measured profile: by_ranks.2.linear_flops.128x64 must be"):
        device.save(broken, good)
    assert good.read_bytes() == before


# -- --hw and the config values loom plan plans with ---------------------------------------------

def test_hw_values_and_their_bounds():
    base = Cluster(CATALOG["H100-SXM"], 8, 1)
    c = with_overrides(base, ["bf16_tflops=700", "fragmentation=0", "achievable_fraction=1", "nvme_gb=1e-9"])
    assert (c.gpu.bf16_tflops, c.fragmentation, c.achievable_fraction, c.nvme_gb) == (700.0, 0.0, 1.0, 1e-9)
    for item, message in [("bf16_tflops=nan", "--hw bf16_tflops must be a finite number, got nan"),
                          ("memory_gb=1e400", "--hw memory_gb must be a finite number, got inf"),
                          ("achievable_fraction=1.0001", "must be in [1e-09, 1]"),
                          ("comm_efficiency=0", "must be in [1e-09, 1]"),
                          ("hbm_tbps=1e-10", "must be in [1e-09, 1e+15]"),
                          ("fragmentation=-0.1", "must be in [1e-09, 1]"),
                          ("host_memory_gb=2e15", "must be in [1e-09, 1e+15]"),
                          ("profile=1", "must be key=value with key one of"),
                          ("gpus_per_node=4", "must be key=value with key one of")]:
        with pytest.raises(LoomError) as e:
            with_overrides(base, [item])
        assert message in str(e.value), (item, str(e.value))


def _plan(capsys, *argv: str) -> tuple[int, str]:
    """`loom plan --gpu H100-SXM --model tiny ARGV`: its exit code, and its stderr (else stdout)."""
    from loom.cli import main

    capsys.readouterr()
    model = [] if "--params" in argv else ["--model", "tiny"]  # both at once are refused
    rc = main(["plan", "--gpu", "H100-SXM", *model, *argv])
    out = capsys.readouterr()
    return rc, out.err.strip() or out.out


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=3"], ["parallel.strategy=ddp", "parallel.offload=cpu"],
    ["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=33"],
    ["parallel.engine=deepspeed", "parallel.strategy=hsdp"], ["parallel.offload_optimizer=cpu"],
    ["parallel.pp=2", "train.precision=fp16"],
    ["train.device=cpu", "parallel.strategy=zero3", "parallel.offload=cpu"]])
def test_plan_refuses_what_train_refuses(capsys, overrides):
    """Values that load (each one valid) but that `loom train` refuses together: `loom plan` refuses
    them with the same message as config.validate for the same world."""
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), 8, cuda_available=True, this_machine=False)
    rc, err = _plan(capsys, *[arg for o in overrides for arg in ("--set", o)])
    assert rc == 2 and err == f"loom: error: {e.value}"


def test_plan_prices_a_batch_the_world_does_not_divide(capsys):
    """The one rule the plan relaxes: a batch its layouts do not divide is planned (the search keeps
    the layouts that divide it), not refused as `loom train` would for its own world."""
    with pytest.raises(ConfigError, match="not divisible"):
        validate(load_config(None, ["train.batch_size=12"]), 8, cuda_available=True, this_machine=False)
    rc, out = _plan(capsys, "--set", "train.batch_size=12", "--format", "json")
    assert rc == 0, out
    assert {r["dp"] for r in json.loads(out)["candidates"]} <= {1, 2, 4}  # the dp sizes dividing 12


@pytest.mark.parametrize("argv,message", [
    (["--params", "nan"], "--params must be a finite number, got nan"),
    (["--params", "0.5"], "--params 0.5 must be a positive parameter count (1 to 1e+15)"),
    (["--params", "2e15"], "--params 2e+15 must be a positive parameter count (1 to 1e+15)"),
    (["--gpus-per-node", "1025"], "--gpus-per-node 1025 is more than loom plans for (at most 1,024)"),
    (["--nodes", "65537"], "--nodes 65537 is more than loom plans for (at most 65,536)"),
])
def test_plan_numbers_refused(capsys, argv, message):
    rc, err = _plan(capsys, *argv)
    assert rc == 2 and message in err and "\n" not in err, err


def test_largest_planned_cluster_plans(capsys):
    rc, out = _plan(capsys, "--gpus-per-node", "1024", "--nodes", "65536", "--format", "json")
    assert rc == 0, out
    assert json.loads(out)["cluster"]["world_size"] == 1024 * 65536


# -- traces --------------------------------------------------------------------------------------

def test_sample_trace_ledger_is_exact(tmp_path):
    """The checks skip nothing valid: the sample's two steps partition as computed by hand (compute
    mm 30 µs + backward 30 µs; exposed: the 2 µs issue and 11 µs in flight after it; idle the rest)."""
    led = analyze_dir(write_trace(tmp_path / "rank0.json").parent, workers=1)["ranks"]["0"]
    assert led["warnings"] == []
    assert [(s["wall_ms"], s["compute_ms"], s["comm_exposed_ms"], s["idle_ms"]) for s in led["steps"]] == \
        [(0.1, 0.06, 0.013, 0.027)] * 2
    assert [(c["kind"], c["bytes"], c["seq"], c["group_size"]) for c in led["collectives"]] == \
        [("all_reduce", 1024, 0, 2), ("all_reduce", 1024, 1, 2)]


def test_damaged_trace_is_refused_beside_good_ones(tmp_path):
    """A file that is no trace is skipped beside traces; a damaged trace is not analyzed around."""
    write_trace(tmp_path / "rank0.json")
    (tmp_path / "notes.json").write_bytes(b"\xff\xfe not a trace")
    out = analyze_dir(tmp_path, workers=1)
    assert list(out["ranks"]) == ["0"] and "notes.json is not a torch.profiler trace" in out["warnings"][0]
    events = sample_events()
    events[3]["ts"] = math.nan
    write_trace(tmp_path / "rank1.json", events)
    with pytest.raises(BadTrace, match=r"rank1.json: traceEvents\[3\] ts must be a finite number"):
        analyze_dir(tmp_path, workers=1)


def _big_trace(tmp_path: Path) -> tuple[Path, str]:
    events = []
    for k in range(2000):  # ≈ 1.5 MB of events, more than DAMAGE_CHARS after the first
        for ev in sample_events()[1:]:
            events.append(dict(ev, ts=ev["ts"] + 200 * k, name=ev["name"].replace("#1", f"#{2 * k + 1}")
                               .replace("#2", f"#{2 * k + 2}")))
    path = write_trace(tmp_path / "rank0.json", events)
    text = path.read_text()
    assert len(text) > 1.2 * DAMAGE_CHARS
    return path, text


def test_damage_far_from_the_end_is_not_a_cut(tmp_path):
    """An event that does not decode with more trace after it is damage (refused); the same text at
    the end of the file is a cut (a warning, the events before it analyzed)."""
    path, text = _big_trace(tmp_path)
    early = text.index('"ph"', 2000)
    path.write_text(text[:early] + "\x01" + text[early:])
    with pytest.raises(BadTrace, match=r"rank0.json is a damaged trace: event \d+ is not valid JSON"):
        analyze_dir(tmp_path, workers=1)
    late = text.rindex('"ph"')
    path.write_text(text[:late] + "\x01" + text[late:])
    led = analyze_dir(tmp_path, workers=1)["ranks"]["0"]
    assert any("truncated after 19999 events" in w for w in led["warnings"]) and len(led["steps"]) == 4000


@pytest.mark.parametrize("gz", [False, True])
def test_a_character_cut_by_the_end_is_a_cut_not_bad_utf8(tmp_path, gz):
    events = sample_events()
    events[-1]["name"] = "gloo:all_reduce ünïcödé"
    text = json.dumps({"traceEvents": events}, ensure_ascii=False).encode()
    cut = text[: text.index("ü".encode()) + 1]  # inside the two bytes of ü
    name = "rank0.json.gz" if gz else "rank0.json"
    (tmp_path / name).write_bytes(gzip.compress(cut) if gz else cut)
    led = analyze_dir(tmp_path, workers=1)["ranks"]["0"]
    assert any("truncated" in w for w in led["warnings"]) and len(led["steps"]) == 2


def test_bad_utf8_in_a_gzip_trace_names_the_byte(tmp_path):
    text = json.dumps({"traceEvents": sample_events()}).encode()
    at = text.index(b"aten::mm")
    (tmp_path / "rank0.json.gz").write_bytes(gzip.compress(text[:at] + b"\xc3\x28" + text[at + 2:]))
    with pytest.raises(BadTrace, match=f"byte {at:,} is not UTF-8 text"):
        analyze_dir(tmp_path, workers=1)


# -- a run's records -----------------------------------------------------------------------------

def test_run_records_read_as_written(tmp_path):
    run = write_run(tmp_path / "run")
    analysis = analyze(run)
    assert analysis["plan"] == json.loads((run / "plan.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert analysis["measured_vs_planned"] == summary["measured_vs_planned"]
    assert run_config(run / "config.toml") == {"parallel": {"strategy": "ddp", "ddp_bucket_mb": 25.0,
                                                            "fsdp_prefetch": 1}, "data": {"num_workers": 0}}
    assert analysis["run"].items() >= {"name": "run", "strategy": "ddp", "world_size": 1}.items()
    for name in ("plan.json", "summary.json", "config.toml"):
        (run / name).unlink()
    bare = analyze(run)  # traces alone: no records is not an error
    assert bare["plan"] is None and bare["measured_vs_planned"] is None and bare["run"]["strategy"] is None


@pytest.mark.parametrize("line,field", [
    ('[parallel]\nstrategy = 3', "parallel.strategy must be a non-empty string, got 3 (int)"),
    ('[parallel]\nfsdp_prefetch = -1', "parallel.fsdp_prefetch must be an integer in [0, 1024], got -1"),
    ('[parallel]\nddp_bucket_mb = "25"', "parallel.ddp_bucket_mb must be a finite number in (0, 1000000.0]"),
    ('[parallel]\nddp_bucket_mb = nan', "parallel.ddp_bucket_mb must be a finite number in (0, 1000000.0]"),
    ('[data]\nnum_workers = 1.5', "data.num_workers must be an integer in [0, 4096], got 1.5 (float)"),
    ("parallel = 2", "parallel must be a JSON object (a mapping), got 2 (int)"),
])
def test_run_config_wrong_types(tmp_path, line, field):
    run = write_run(tmp_path / "run")
    (run / "config.toml").write_text(line + "\n")
    with pytest.raises(BadFile) as e:
        analyze(run)
    assert str(e.value).startswith(f"{run / 'config.toml'}: {field}"), str(e.value)


def test_config_values_reach_the_findings(tmp_path):
    """The typed config.toml values are the ones a finding names: exposed communication (the
    all-reduce runs 30 µs, 33% of the step) suggests half of the run's own ddp_bucket_mb."""
    run = write_run(tmp_path / "run")
    events = sample_events()
    for ev in events:
        if ev["name"] == "gloo:all_reduce":
            ev["dur"] = 30
    write_trace(run / "traces" / "rank0.json", events)
    (run / "config.toml").write_text("[parallel]\nddp_bucket_mb = 10\n")
    (finding,) = [f for f in analyze(run)["findings"] if f["category"] == "comm"]
    assert (finding["knob"], finding["value"]) == ("parallel.ddp_bucket_mb", 5.0)
    assert finding["note"].startswith("now 10")

