"""Muon's exchange in the step ledger and the diagnosis: a synthetic gloo trace where the optimizer
step's all-to-alls run inside `muon_alltoall` ranges (one matrix batch's gather and scatter) beside
an all-to-all outside them, with a known answer; the diagnosis names Muon and the key."""

from __future__ import annotations

from test_ledger import X, write_trace

from loom.observe.diagnose import diagnose
from loom.observe.ledger import MUON_ALLTOALL, analyze_dir

MAIN, GLOO = 11, 12


def test_the_kind_is_the_optimizers():
    """loom/train/muon.py marks its all-to-alls with MUON_ALLTOALL; the ledger (which runs without
    torch) spells the same name."""
    from loom.train.muon import MUON_ALLTOALL as OPTIMIZER_SIDE
    assert MUON_ALLTOALL == OPTIMIZER_SIDE == "muon_alltoall"


def muon_events(ranges: bool = True) -> list[dict]:
    """A 100 ms step: mm 0-50 · the gather issued 50-51 (gloo 51-71) and waited for · mm 71-80 (the
    owner's iteration) · the scatter issued 80-81 (gloo 81-84) · an all-to-all outside any range
    90-91 (gloo 91-93) · mm 93-100."""
    def x(name, start, dur, cat="cpu_op", tid=MAIN, **args):
        return X(name, start, dur, cat, tid=tid, **args)

    two, bf16 = ["c10::BFloat16", "c10::BFloat16"], {"Input_type": ["c10::BFloat16"]}
    events = [x("ProfilerStep#1", 0, 100, "user_annotation"), x("aten::mm", 0, 50),
              x("c10d::alltoall_base_", 50, 1, Input_Dims=[[4096], [4096]], Input_type=two),
              x("gloo:all_to_all", 51, 20, "user_annotation", tid=GLOO, Input_Dims=[[4096]], **bf16),
              x("aten::mm", 71, 9),
              x("c10d::alltoall_base_", 80, 1, Input_Dims=[[8192], [4096]], Input_type=two),
              x("gloo:all_to_all", 81, 3, "user_annotation", tid=GLOO, Input_Dims=[[8192]], **bf16),
              x("c10d::alltoall_base_", 90, 1, Input_Dims=[[100], [100]], Input_type=two),
              x("gloo:all_to_all", 91, 2, "user_annotation", tid=GLOO, Input_Dims=[[100]], **bf16),
              x("aten::mm", 93, 7)]
    if ranges:
        events += [x(MUON_ALLTOALL, 50, 21, "user_annotation"), x(MUON_ALLTOALL, 80, 4, "user_annotation")]
    return events


def test_muon_alltoall_has_its_own_kind(tmp_path):
    led = analyze_dir(write_trace(tmp_path / "rank0.json", muon_events()))["ranks"]["0"]
    kinds = [(c["kind"], c["bytes"]) for c in led["collectives"]]
    assert kinds == [("muon_alltoall", 8192), ("muon_alltoall", 16384), ("all_to_all", 200)]


def test_without_the_ranges_they_are_plain(tmp_path):
    led = analyze_dir(write_trace(tmp_path / "rank0.json", muon_events(ranges=False)))["ranks"]["0"]
    assert [c["kind"] for c in led["collectives"]] == ["all_to_all"] * 3


def test_diagnosis_names_muon_and_the_key(tmp_path):
    """The exposed gather (50-71, a fifth of the step) and scatter (80-84) are Muon's: the finding
    says so and names train.optimizer."""
    led = analyze_dir(write_trace(tmp_path / "rank0.json", muon_events()))
    config = {"train": {"optimizer": "muon"}, "parallel": {"strategy": "zero3"}}
    (found,) = [f for f in diagnose(led, config) if f.get("kind") == MUON_ALLTOALL]
    assert "Muon's optimizer step gathers" in found["cause"]
    assert found["knob"] == "train.optimizer" and found["value"] == "adamw"
