"""The planner's and the analysis' readers under hostile edits (tests/fuzz.py): perturbed device
profiles, `--hw` strings and `--params`/`--gpus-per-node`/`--nodes` values through `loom plan`'s
own code, perturbed trace event lists (plain and gzip JSON files, and their bytes cut or flipped)
and perturbed run records through `loom analyze`. Each gives a result or loom's one-line error,
within the time and memory bounds; and a result is one loom can use: a loaded profile prices a
step in finite, positive seconds, an analysis serializes as strict JSON (no NaN or infinity)."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import math
from pathlib import Path

from analysis_inputs import PROFILE, sample_events, trace_doc, write_run
from fuzz import FUZZ, must_read, perturbed, perturbed_bytes, write_json
from hypothesis import event, given, settings
from hypothesis import strategies as st

from loom.cli import build_parser
from loom.observe.analyze import analyze
from loom.plan import command, device
from loom.plan.candidate import Workload
from loom.plan.hardware import CATALOG, Cluster, with_overrides
from loom.plan.search import search
from loom.plan.shapes import from_params, from_preset

VALID_PROFILE = json.loads(PROFILE.read_text())
FEW = settings(FUZZ, max_examples=40)  # each example plans or analyzes for real: tens of ms


def _strict(value) -> str:
    return json.dumps(value, allow_nan=False)


def _outcome(result):
    event("read" if result is not None else "refused in one line")
    return result


@given(doc=perturbed(VALID_PROFILE))
@FUZZ
def test_perturbed_device_profile(doc, tmp_path_factory):
    path = write_json(tmp_path_factory.mktemp("p") / "device.json", doc)
    profile = _outcome(must_read(lambda: device.load(path), names=["device.json"]))
    if profile is None:
        return
    for ranks in (1, 2, 3, 64):  # every lookup the time model makes, at counts measured or not
        cluster = command.local_cluster(profile, ranks)
        rates = [profile.linear_flops(ranks, 300, 200, 700), profile.attention_flops(ranks, 300, 48),
                 profile.elementwise_bytes(ranks, 1e6), profile.block_elementwise_bytes(ranks, 1e6),
                 profile.block_in_situ(ranks, 1e6), cluster.gpu.bf16_tflops, cluster.gpu.hbm_tbps]
        assert all(math.isfinite(r) and r > 0 for r in rates), rates
        seconds = profile.collective_seconds(ranks, "all_gather", 1e6, 3)
        assert math.isfinite(seconds) and seconds >= 0 and profile.op_overhead(ranks) >= 0


def test_perturbed_profile_is_read_back_unchanged(tmp_path):
    """The valid profile through the checks: the same numbers, and saved again byte for byte."""
    profile = device.load(PROFILE)
    assert profile.by_ranks == VALID_PROFILE["by_ranks"] and profile.cores == VALID_PROFILE["cores"]
    assert profile.peak_flops(2) == max(VALID_PROFILE["by_ranks"]["2"]["linear_flops"].values())
    assert json.loads(device.save(profile, tmp_path / "again.json").read_text()) == VALID_PROFILE


HW_KEYS = ["bf16_tflops", "memory_gb", "hbm_tbps", "intra_node_gbps", "inter_node_gbps", "host_link_gbps",
           "kernel_launch_s", "achievable_fraction", "comm_efficiency", "fragmentation", "host_memory_gb",
           "nvme_gbps", "cpu_adam_params_per_s"]
ODD_KEYS = ["profile", "gpu", "name", "nodes", "", "BF16_TFLOPS"]
HW_VALUES = ["nan", "inf", "-inf", "-1", "0", "1e400", "1e16", "2", "fast", "", " 3 ", "1_0", "0x10",
             "1e-320", "5e-324", "0.5", "0.05", "700", "80", "1e-6", "1e14"]


@given(items=st.lists(st.one_of(
    st.builds("{}={}".format, st.sampled_from(HW_KEYS), st.sampled_from(HW_VALUES)),
    st.builds("{}={}".format, st.sampled_from(HW_KEYS), st.floats(1e-12, 1e16)),
    st.builds("{}={}".format, st.sampled_from(ODD_KEYS), st.sampled_from(HW_VALUES)),
    st.text(max_size=20)), min_size=1, max_size=2))
@FUZZ
def test_hw_overrides(items):
    base = Cluster(CATALOG["H100-SXM"], 8, 1)
    cluster = _outcome(must_read(lambda: with_overrides(base, items), names=["--hw"]))
    if cluster is None:
        return
    numbers = [getattr(cluster.gpu, f) for f in ("bf16_tflops", "memory_gb", "hbm_tbps", "intra_node_gbps")]
    assert all(math.isfinite(v) and v > 0 for v in numbers)
    plan = _outcome(must_read(lambda: search(Workload(from_preset("tiny"), 128, 64, "bf16"), cluster)))
    if plan is not None:
        _strict(plan.to_dict())


@given(count=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70)))
@FUZZ
def test_params_values(count):
    shape = _outcome(must_read(lambda: from_params(count), names=["--params"]))
    if shape is not None:
        assert 1 <= shape.num_params <= 1e15 and math.isfinite(shape.flops_per_token(4096))


NUMBERS = st.one_of(st.integers(-3, 4), st.sampled_from([2**20, 10**9, 65536, 65537, 1025]))


@given(per_node=st.one_of(st.none(), NUMBERS), nodes=st.one_of(st.none(), NUMBERS),
       params=st.one_of(st.none(), st.sampled_from(["nan", "inf", "-1", "0", "1e30", "7e9", "1e9"])),
       gpu=st.sampled_from(["H100-SXM", "local"]))
@FEW
def test_plan_numbers(per_node, nodes, params, gpu):
    """`loom plan`'s numeric flags, parsed by its own parser and planned (the table printed)."""
    argv = ["plan", "--gpu", gpu, "--model", "tiny"] if params is None else ["plan", "--gpu", gpu, "--params",
                                                                             params]
    for flag, value in (("--gpus-per-node", per_node), ("--nodes", nodes)):
        if value is not None:
            argv += [flag, str(value)]
    args = build_parser().parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        result = _outcome(must_read(lambda: command.run(args)))
    if result is not None:
        _strict(result[1].to_dict())


# -- traces through loom analyze ---------------------------------------------------------------

@given(data=st.data(), gz=st.booleans(), header=st.booleans())
@FUZZ
def test_perturbed_trace_events(data, gz, header, tmp_path_factory):
    """The event list perturbed (or, `header`, the whole document: baseTimeNanoseconds,
    distributedInfo, ...), as a plain or gzip file."""
    folder = tmp_path_factory.mktemp("t")
    name = "rank0.json.gz" if gz else "rank0.json"
    doc = data.draw(perturbed(trace_doc())) if header else trace_doc(data.draw(perturbed(sample_events())))
    text = json.dumps(doc).encode()
    (folder / name).write_bytes(gzip.compress(text) if gz else text)
    analysis = _outcome(must_read(lambda: analyze(folder), names=[name]))
    if analysis is not None:
        _strict(analysis)
        for step in analysis["ranks"]["0"]["steps"]:
            assert step["wall_ms"] >= 0 and step["idle_ms"] >= -1e-9


@given(data=st.data(), gz=st.booleans())
@FUZZ
def test_trace_bytes_cut_or_flipped(data, gz, tmp_path_factory):
    folder = tmp_path_factory.mktemp("b")
    text = json.dumps({"baseTimeNanoseconds": 1, "traceEvents": sample_events(), "traceName": "x"}).encode()
    raw = gzip.compress(text) if gz else text
    name = "rank0.json.gz" if gz else "rank0.json"
    (folder / name).write_bytes(data.draw(perturbed_bytes(raw)))
    analysis = _outcome(must_read(lambda: analyze(folder), names=[name]))
    if analysis is not None:
        _strict(analysis)


RECORDS = {"plan.json": None, "summary.json": None}


@given(which=st.sampled_from(sorted(RECORDS)), data=st.data())
@FUZZ
def test_perturbed_run_records(which, data, tmp_path_factory):
    run = write_run(tmp_path_factory.mktemp("r") / "run")
    doc = data.draw(perturbed(json.loads((run / which).read_text())))
    write_json(run / which, doc)
    analysis = _outcome(must_read(lambda: analyze(run), names=[which]))
    if analysis is not None:
        _strict({k: analysis[k] for k in ("plan", "measured_vs_planned", "findings", "run")})


@given(data=st.data())
@FUZZ
def test_run_config_bytes(data, tmp_path_factory):
    run = write_run(tmp_path_factory.mktemp("c") / "run")
    (run / "config.toml").write_bytes(data.draw(perturbed_bytes((run / "config.toml").read_bytes())))
    analysis = _outcome(must_read(lambda: analyze(run), names=["config.toml"]))
    if analysis is not None:
        _strict(analysis["findings"])


def test_args_namespace_is_the_clis():
    """The fuzzed flags go through the same parser as `loom plan` (types, defaults)."""
    args = build_parser().parse_args(["plan", "--params", "7e9", "--nodes", "2"])
    assert isinstance(args, argparse.Namespace) and args.params == 7e9 and args.nodes == 2
    assert Path(device.default_path()).name == "device_cpu.json"
