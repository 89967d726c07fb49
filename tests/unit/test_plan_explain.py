"""`loom plan --explain N`: the printed arithmetic names the seeds' formulas, and the numbers it
prints add up to the candidate's record (parsed back from the text, not recomputed)."""

from __future__ import annotations

import re

import pytest

from loom.cli import main
from loom.errors import ConfigError
from loom.plan import memory as memory_module
from loom.plan.candidate import Workload
from loom.plan.command import local_cluster
from loom.plan.device import (
    ATTENTION_HEAD_DIMS,
    ATTENTION_SEQS,
    ELEMENTWISE_SIZES,
    LINEAR_ROWS,
    LINEAR_SIZES,
    DeviceProfile,
)
from loom.plan.explain import candidate_of, explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import record_label, search
from loom.plan.shapes import from_params, from_preset

GB = 1e9
NUM = r"-?[\d,]*\.?\d+(?:e[-+]?\d+)?"
PART = re.compile(rf"([a-z][a-z ]*?) ({NUM}) (GB|s)\b")
CHECK = re.compile(rf"^  check: (.*) = ({NUM}) (GB|s); the record: ({NUM}) (GB|s) ✓$")
MOMENT = re.compile(rf"^  ([^:]+): +({NUM}) GB \| ({NUM}) GB = ({NUM}) GB(?:   \(.*\))?(  ← peak)?$")


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def plan_8b():
    return search(Workload(from_preset("8b"), 8192, 128), Cluster(lookup("H100-SXM")))


@pytest.fixture(scope="module")
def plan_1b_two_nodes():  # tied embeddings, hsdp, links across nodes
    return search(Workload(from_preset("1b"), 4096, 64), Cluster(lookup("H100-SXM"), 8, 2))


@pytest.fixture(scope="module")
def plan_params_zero():  # `loom plan --params 70e9 --recipe zero`: model states only
    return search(Workload(from_params(70e9), 4096, 256, recipe="zero"), Cluster(lookup("H100-SXM")))


def find(plan, **want) -> int:
    """Index of the first candidate whose record matches every key (callables are predicates)."""
    for i, r in enumerate(plan.candidates):
        if all(v(r[k]) if callable(v) else r[k] == v for k, v in want.items()):
            return i
    raise AssertionError(f"no candidate with {want}")


def checks(text: str) -> list[tuple[list[tuple[str, float, str]], float, float]]:
    """Each check line: (its parts, its printed sum, the record's value it prints)."""
    found = []
    for line in text.splitlines():
        if line.startswith("  check:"):
            m = CHECK.match(line)
            assert m, f"a check line failed or does not parse: {line}"
            parts = [(name, number(value), unit) for name, value, unit in PART.findall(m.group(1))]
            found.append((parts, number(m.group(2)), number(m.group(4))))
    return found


def result(text: str, what: str, section: str) -> float:
    """The `= X unit` a line `what ...` ends with, the first in the section titled `section`."""
    body = text.split(f"\n{section}", 1)[1]
    for line in body.splitlines():
        if line.startswith(f"  {what:<24} "):  # the explanation's label column
            value = re.findall(rf"= ({NUM}) (?:GB|s)(?:  ← peak)?$", line)
            assert value, line
            return number(value[-1])
    raise AssertionError(f"no line {what!r} in {section!r}")


def assert_moments(text: str, m: dict) -> None:
    """The moments the planner compared, as printed: each sums its activations and buffers, the
    marked peak is the largest, and it carries the record's activations and (but for DeepSpeed's
    gradient partitions, itemised on a `buffers` line) its buffers."""
    memory = text.split("\ncommunication per GPU")[0]
    moments = [MOMENT.match(line) for line in memory.splitlines()]
    moments = [(mm.group(1), number(mm.group(2)), number(mm.group(3)), number(mm.group(4)), bool(mm.group(5)))
               for mm in moments if mm]
    if "moments of the step" not in memory:
        assert not moments and m["activations"] == 0
        return
    assert moments, memory
    for name, act, buf, total, _ in moments:
        assert act + buf == pytest.approx(total, rel=1e-4, abs=1e-4), name
    peaks = [mm for mm in moments if mm[4]]
    assert len(peaks) == 1, moments
    _, act, buf, total, _ = peaks[0]
    assert total == pytest.approx(max(t for _, _, _, t, _ in moments), rel=1e-4)
    assert act == pytest.approx(m["activations"] / GB, rel=1e-4, abs=1e-9)
    if "\n  buffers " in memory:
        assert buf <= result(text, "buffers", "memory") + 1e-9
    else:
        assert buf == pytest.approx(m["buffers"] / GB, rel=1e-4, abs=1e-9)


def assert_adds_up(text: str, record: dict) -> None:
    assert "✗" not in text, "\n".join(line for line in text.splitlines() if "✗" in line)
    memory, comm, time = checks(text)
    expected = (record["memory_bytes"]["total"] / GB, record["comm_bytes_per_step"] / GB,
                record["step_time_s"])
    for (parts, printed, theirs), want in zip((memory, comm, time), expected):
        assert sum(v for _, v, _ in parts) == pytest.approx(want, rel=1e-3, abs=1e-6), parts
        assert printed == pytest.approx(want, rel=1e-4) and theirs == pytest.approx(want, rel=1e-4)
    # the memory parts are the record's own, in its units
    names = [name for name, _, _ in memory[0]]
    assert names == ["params", "grads", "optimizer", "activations", "buffers", "fragmentation"]
    m = record["memory_bytes"]
    for name, value, _ in memory[0]:
        assert value == pytest.approx(m[name] / GB, rel=1e-4, abs=1e-9), name
    assert result(text, "fragmentation", "memory") == pytest.approx(m["fragmentation"] / GB, rel=1e-4)
    assert_moments(text, m)
    # the step's itemised lines carry the same numbers as its check line
    t = record["step_time_breakdown_s"]
    parts = {name: value for name, value, _ in time[0]}
    for key in ("compute", "recompute", "bubble", "comm_exposed", "optimizer", "offload"):
        assert parts[key.replace("_", " ")] == pytest.approx(t[key], rel=1e-4, abs=1e-9), key
    # the kernel-launch floor, when it binds (few tokens per micro-step: e.g. a short sequence split by cp)
    compute = "kernel-launch floor" if "compute = the floor" in text else "compute"
    assert result(text, compute, "step time") == pytest.approx(t["compute"], rel=1e-4)
    assert result(text, "comm exposed", "step time") == pytest.approx(t["comm_exposed"], rel=1e-4, abs=1e-9)
    for key in ("recompute", "bubble", "offload", "optimizer"):
        if t[key]:
            assert result(text, key, "step time") == pytest.approx(t[key], rel=1e-4), key


def test_ddp(plan_8b):
    i = find(plan_8b, strategy="ddp", tp=1, pp=1, activation_checkpointing="none")
    text = explain(plan_8b, i)
    assert text.startswith(f"candidate {i}: ddp")
    for formula in ("4Ψ + 4Ψ + 8Ψ = 16Ψ", "2h² + 2h·kv + 3h·f + 2h", "2(N−1)/N·Φ_g", "6N + 12·L·H·Q·T",
                    "split/tp + norms + linear inputs", "FLOPs / (peak × fraction)", "α × count"):
        assert formula in text, formula
    assert "8,030,261,248" in text and "6·7,504,924,672 + 12·32·32·128·8192 = 57,914,449,920" in text
    # the params line is 4Ψ with Ψ printed: 4 × 8,030,261,248 = 32.121 GB
    assert "4·Ψ = 4 × 8,030,261,248 = 32.121 GB" in text
    assert_adds_up(text, plan_8b.candidates[i])


def test_zero1_and_zero3(plan_8b):
    i = find(plan_8b, strategy="zero1", tp=1, pp=1, offload="none", engine="torch")
    text = explain(plan_8b, i)
    assert "4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N" in text and "broadcast" in text
    assert_adds_up(text, plan_8b.candidates[i])
    i = find(plan_8b, strategy="zero3", tp=1, pp=1, offload="none", engine="torch")
    text = explain(plan_8b, i)
    for formula in ("4Ψ/N + 4Ψ/N + 8Ψ/N = 16Ψ/N", "3Φ against DDP's 2Φ", "k·Φ_p + k·(Φ_p − Φ_kept)",
                    "(N−1)/N·Φ_g", "moments of the step", "← peak"):
        assert formula in text, formula
    assert_adds_up(text, plan_8b.candidates[i])


def test_pipeline_interleaved_and_1f1b(plan_8b):
    # the first stage explained (it peaks): its in-flight rule is the interleaved one
    i = find(plan_8b, pp_schedule="interleaved", activation_checkpointing="selective", memory_stage=0)
    text = explain(plan_8b, i)
    r = plan_8b.candidates[i]
    p, v, m = r["pp"], r["pp_virtual_stages"], r["grad_accum"]
    assert "(p−1)(F+B+W)/v (interleaved)" in text and f"({p}−1)(" in text and f")/{v} = " in text
    assert "bubble time / (m·(F+B+W) + bubble time) = " in text and f" / ({m}·" in text
    assert abs(number(text.split("bubble fraction")[1].split("\n")[0].rsplit("=", 1)[1])
               - (p - 1) / (v * m + p - 1)) < 1e-6  # the interleaved bubble whatever F:B:W is
    assert "min(m·v, (v−1)·R + 2(p−1−r) + 1) warm-up forwards" in text and "⌈L_s/2⌉" in text
    assert "stage 0: " in text and "receive buffers" in text
    assert "2v·m sends" in text and "pipeline ranks priced, each over its stages" in text
    assert_adds_up(text, r)
    j = find(plan_8b, pp_schedule="1f1b", pp=lambda p: p > 1)
    text = explain(plan_8b, j)
    assert "(p−1)(F+B+W) (1f1b)" in text and "min(m, p − r) (1F1B, rank r)" in text
    assert_adds_up(text, plan_8b.candidates[j])


def test_tensor_and_sequence_parallel(plan_8b):
    i = find(plan_8b, tp=lambda t: t > 1, pp=1, sequence_parallel=True, strategy="zero3",
              activation_checkpointing="full")
    text = explain(plan_8b, i)
    for formula in ("(Ψ − R)/tp + R", "(sequence parallel)", "2(tp−1)/tp·Φ_a", "4·L/p + c + 2",
                    "all L_s blocks", "tensor parallel"):
        assert formula in text, formula
    assert_adds_up(text, plan_8b.candidates[i])


def test_offload_and_deepspeed(plan_8b):
    i = find(plan_8b, offload="optimizer", engine="deepspeed")
    text = explain(plan_8b, i)
    for formula in ("(the deepspeed engine's)", "offload optimizer", "host Adam", "(4Ψ + 2Ψ)/host link",
                    "host per node", "DeepSpeed buckets"):
        assert formula in text, formula
    assert_adds_up(text, plan_8b.candidates[i])
    i = find(plan_8b, offload="nvme")
    text = explain(plan_8b, i)
    assert "NVMe per node" in text and "2·12Ψ/(NVMe bandwidth / GPUs per node)" in text
    assert_adds_up(text, plan_8b.candidates[i])
    i = find(plan_8b, offload="optimizer+params", engine="torch")
    assert_adds_up(explain(plan_8b, i), plan_8b.candidates[i])


def test_hsdp_tied_embeddings_across_nodes(plan_1b_two_nodes):
    plan = plan_1b_two_nodes
    i = find(plan, strategy="hsdp")
    text = explain(plan, i)
    assert "2(R−1)/R·Φ_g/N" in text and "replica groups" in text and "inter-node" in text
    assert_adds_up(text, plan.candidates[i])


def test_params_only_zero_recipe(plan_params_zero):
    plan = plan_params_zero
    i = find(plan, strategy="zero1", engine="torch")
    text = explain(plan, i)
    assert "2Ψ + 2Ψ + 12Ψ/N = 4Ψ + 12Ψ/N" in text and "the ZeRO paper's P_os" in text
    assert "6N (attention unknown)" in text and "not modelled" in text and "70,000,000,000" in text
    assert_adds_up(text, plan.candidates[i])
    text = explain(plan, find(plan, strategy="zero2", engine="torch"))
    assert "2Ψ + 2Ψ/N + 12Ψ/N = 2Ψ + 14Ψ/N" in text  # the paper's stage 2 keeps its params whole


def test_every_candidate_adds_up(plan_8b, plan_1b_two_nodes, plan_params_zero):
    """No candidate of three plans shows a ✗ (every section sums to the record)."""
    for plan in (plan_8b, plan_1b_two_nodes, plan_params_zero):
        for i in range(0, len(plan.candidates), 7):
            assert_adds_up(explain(plan, i), plan.candidates[i])


def test_rebuilt_candidate_has_the_records_label(plan_8b, plan_1b_two_nodes):
    for plan in (plan_8b, plan_1b_two_nodes):
        for r in plan.candidates:
            assert record_label(candidate_of(r), r["full_logits"], tuple(r["pp_stage_layers"])) == r["label"]


def test_a_drift_from_the_planner_shows(plan_8b, monkeypatch):
    """The explanation is the planner's record, checked against the plan's: a record that the
    planner no longer makes (here: a term of the loss priced differently since) fails the check."""
    i = find(plan_8b, strategy="zero3", tp=1, pp=1, offload="none", engine="torch")
    monkeypatch.setattr(memory_module, "head_saved_bytes", lambda *a, **k: 1e9)
    text = explain(plan_8b, i)
    assert "✗" in text
    with pytest.raises(AssertionError):
        assert_adds_up(text, plan_8b.candidates[i])


def test_measured_device(monkeypatch):
    """The measured branch: per-layer rates and collectives at α·count + bytes/β, summed to the record."""
    def entry(scale):
        return {"linear_flops": {f"{r}x{s}": scale * 1e9 * (1 + r * s / 1e6) for r in LINEAR_ROWS
                                 for s in LINEAR_SIZES},
                "attention_flops": {f"{q}x{d}": scale * 5e8 * (1 + q * d / 1e5) for q in ATTENTION_SEQS
                                    for d in ATTENTION_HEAD_DIMS},
                "elementwise_bytes": {str(s): 1e10 / (1 + s / 1e8) for s in ELEMENTWISE_SIZES},
                "block_elementwise_bytes": {str(s): 5e9 / (1 + s / 1e8) for s in ELEMENTWISE_SIZES},
                "op_overhead_s": 5e-6,
                "collectives": {k: {"alpha_s": 1e-4, "bytes_per_s": 2e9, "points": []}
                                for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")}}
    profile = DeviceProfile("cpu", "test", 16, 64 * 2**30, "2", "2026-01-01",
                            {"1": entry(1), "4": entry(0.8)})
    plan = search(Workload(from_preset("small"), 256, 16, "fp32"), local_cluster(profile, 4))
    for i, r in enumerate(plan.candidates):
        text = explain(plan, i)
        assert_adds_up(text, r)
    i = find(plan, strategy="zero3", tp=1, pp=1)
    text = explain(plan, i)
    for formula in ("step time on the measured device", "linear gate", "12·(H/tp)·Q·T·tokens / rate",
                    "α·count + payload/β + 2·payload/bandwidth", "block bandwidth"):
        assert formula in text, formula
    # memory priced as the planner prices a CPU's gloo ranks: foreach AdamW's moment is compared
    assert "\n  optimizer:" in text and "sqrt(v)" in text


@pytest.mark.parametrize("index", [-1, 10**6])
def test_out_of_range(plan_8b, index):
    n = len(plan_8b.candidates)
    message = rf"^candidate {index} does not exist; the plan has {n} \(0–{n - 1}\)$"
    with pytest.raises(ConfigError, match=message):
        explain(plan_8b, index)


def test_cli(capsys):
    assert main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--explain", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("candidate 5: ") and out.count("✓") == 3
    assert main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--explain", "999999"]) == 2
    err = capsys.readouterr().err.strip()
    assert "candidate 999999 does not exist; the plan has" in err and len(err.splitlines()) == 1
