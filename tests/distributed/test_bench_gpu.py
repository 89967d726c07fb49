"""`loom bench --gpu`'s benchmark (bench/gpu.py), run small on a CPU: every case, in order, each a
subprocess, and the row each writes. This machine has no GPU, so what this proves is the
benchmark's own code, ready for a GPU (CUDA itself is not exercised: CPU offload is refused here,
and its row says so)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402
import harness  # noqa: E402

SMALL = {"model.preset": "tiny", "train.device": "cpu", "data.seq_len": "64", "train.batch_size": "4",
         "data.num_workers": "0"}


def test_the_gpu_benchmark_runs_its_cases_and_writes_its_rows(tmp_path, monkeypatch):
    workload = [f"{k}={SMALL.get(k, v)}" for k, v in (s.split("=", 1) for s in gpu.WORKLOAD)]
    assert sum(s.startswith(tuple(SMALL)) for s in workload) == len(SMALL)  # every one replaced
    monkeypatch.setattr(gpu, "WORKLOAD", workload)
    monkeypatch.setattr(gpu, "SCRIPTS", {"preset": "tiny", "batch": 4, "seq": 64, "device": "cpu",
                                         "matmul": 256, "small": True})
    monkeypatch.setattr(gpu, "BUDGET_S", 3600.0)
    bench = {"rows": [], "notes": [], "missed": [], "plots": []}
    saved = []
    ctx = harness.Context(True, tmp_path, {"benches": {"gpu": bench}}, harness.Progress(17), tmp_path,
                          save=lambda: saved.append(len(bench["rows"])))
    ctx.bench = "gpu"
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    gpu.gpu(ctx)

    rows = {r["case"]: r for r in bench["rows"]}
    assert list(rows) == ["bf16 matmul 256³", "eager", "CP attention pieces vs one SDPA",
                          "attention kernels (GQA, 1B heads)", "zero3 + CPU offload",
                          "hand-written loop (loom's GPT)",
                          "Hugging Face LlamaForCausalLM", "compile", "full logits", "AC op", "AC full",
                          "fp16", "LoRA rank 16", "Muon",
                          "MoE 8×64 top 2", "loom profile + loom analyze",
                          "async checkpoint from CUDA memory, resumed"]
    assert saved == list(range(1, 18))  # the results written after every case
    assert "accelerator" in rows["zero3 + CPU offload"]["error"]  # refused on a CPU, in one line
    for name in ("eager", "compile", "full logits", "AC op", "AC full", "fp16", "LoRA rank 16",
                 "MoE 8×64 top 2"):
        row = rows[name]
        assert "error" not in row, row
        assert row["measured"] > 0 and row["peak_gib"] > 0 and row["unit"] == "tokens/s", row
        assert row["planned_peak_gib"] > 0 and row["measured_vs_planned"] > 0, row  # measured beside planned
        # allocated beside the plan's allocated; the allocator's reserved (CUDA only) beside its total
        assert row["planned_reserved_gib"] > row["planned_peak_gib"] and row["reserved_gib"] is None, row
        assert list(row)[:4] == ["case", "measured", "planned", "measured_vs_planned"]  # the table's columns
        assert "train.optimizer_impl=fused" in row["command"]
    assert "error" not in rows["Muon"] and rows["Muon"]["measured"] > 0, rows["Muon"]
    assert "train.optimizer=muon" in rows["Muon"]["command"]
    assert "train.precision=bf16" in rows["eager"]["command"]
    assert "train.precision=fp16" in rows["fp16"]["command"]
    assert rows["AC full"]["peak_gib"] < rows["eager"]["peak_gib"]  # full AC frees activations
    assert "dense twin (eager; goal ≥ 0.85)" in rows["MoE 8×64 top 2"]["detail"]
    # issue 39's goals, each as a ratio beside its row
    assert "× eager (goal ≥ 1.15)" in rows["compile"]["detail"]
    assert "× full fine-tuning (goal ≥ 1.3)" in rows["LoRA rank 16"]["detail"]
    assert "× the chunked loss (eager)" in rows["full logits"]["detail"]
    assert "(goal ≥ 1.00×)" in rows["Hugging Face LlamaForCausalLM"]["detail"]
    assert rows["bf16 matmul 256³"]["measured"] > 0
    kernels = rows["attention kernels (GQA, 1B heads)"]
    assert kernels["detail"].startswith("6/6 as planned"), kernels
    assert kernels["measured"] == kernels["planned"], kernels
    cp = rows["CP attention pieces vs one SDPA"]
    assert cp["detail"].startswith("12/12 cases within tolerance") and cp["measured"] <= cp["planned"]
    for name in ("hand-written loop (loom's GPT)", "Hugging Face LlamaForCausalLM"):
        assert rows[name]["measured"] > 0 and "loom eager" in rows[name]["detail"], rows[name]
    profiled = rows["loom profile + loom analyze"]
    assert 0 < profiled["measured"] <= 1 and "compute" in bench["notes"][0]
    resumed = rows["async checkpoint from CUDA memory, resumed"]
    assert resumed["resumed_steps"] == 12 and "error" not in resumed
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # every run folder deleted once read
