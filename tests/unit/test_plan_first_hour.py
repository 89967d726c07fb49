"""A new user's first hour with `loom plan`: the user pages' commands run as written, --emit writes
the job the plan priced, the recommendation is one loom runs with the headroom the planner page promises
and a true reason, a CPU plan speaks of a CPU, and the first calibration says how long it takes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import readme

from loom.cli import main
from loom.config import load_config, validate
from loom.plan.candidate import Workload
from loom.plan.command import model_shape
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import GB, TIGHT, config_candidate, search
from loom.plan.shapes import from_params, from_preset, llama_like

CPU_PROFILE = Path(__file__).parents[1] / "data" / "device_cpu.json"


def plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def readme_plan_commands() -> list[str]:
    return re.findall(r"`(loom plan [^`]*)`", readme.text())


def test_readme_plan_examples_name_the_gpu_and_the_70b_one_runs_verbatim(capsys):
    """Every README `loom plan` example for a model on a cluster names its GPU (without one it
    would plan on this CPU), and the seeds' 70B example prints the figures the README quotes."""
    cluster_examples = [c for c in readme_plan_commands() if "--params" in c or "--gpus-per-node" in c
                        or "--nodes" in c]
    assert cluster_examples
    for command in cluster_examples:
        assert "--gpu " in command, command
    (seeds,) = [c for c in cluster_examples if "--params 70e9" in c]
    assert main(shlex.split(seeds)[1:]) == 0
    out = capsys.readouterr().out
    assert "8 H100-SXM" in out and "on this machine" not in out
    assert "GPU    1120.0" in out and "GPU     140.0" in out and "GPU      17.5   host    122.5" in out


def _emit(tmp_path, capsys, *args) -> tuple[dict, object]:
    out = tmp_path / "run.toml"
    plan = plan_json(capsys, *args, "--gpu", "H100-SXM", "--emit", str(out))
    return plan, load_config(out)


def _check_emitted(plan: dict, cfg, params: float, rel: float = 1e-9) -> None:
    """The emitted config trains the planned model, precision, sequence, batch and layout."""
    assert model_shape(cfg, None, None).num_params == pytest.approx(params, rel=rel)
    best = plan["candidates"][plan["recommended"]]
    assert cfg.train.precision == best["precision"] == "bf16"
    planned = plan["model"]
    assert (cfg.data.seq_len, cfg.train.batch_size) == (planned["seq_len"], planned["global_batch"])
    dims = validate(cfg, best["gpus"], cuda_available=True, this_machine=False)
    again = config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp)
    for key in ("strategy", "dp", "tp", "pp", "micro_batch", "grad_accum", "activation_checkpointing"):
        assert getattr(again, key) == best[key], key
    assert cfg.parallel.engine == ("deepspeed" if best["engine"] == "deepspeed" else "torch")


def test_emit_after_params_writes_a_shape_of_that_many_parameters(tmp_path, capsys):
    plan, cfg = _emit(tmp_path, capsys, "--params", "70e9", "--recipe", "zero")
    _check_emitted(plan, cfg, 70e9, rel=0.01)
    assert cfg.model.d_model == llama_like(70e9).d_model and cfg.model.max_seq_len >= cfg.data.seq_len


def test_emit_after_a_preset_writes_the_preset(tmp_path, capsys):
    plan, cfg = _emit(tmp_path, capsys, "--model", "8b")
    assert cfg.model.preset == "8b"
    _check_emitted(plan, cfg, plan["model"]["num_params"])


def _hf_folder(folder: Path, weights: bool) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "tie_word_embeddings": False}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")  # emit only looks for the file
    return folder / "config.json"


@pytest.mark.parametrize("weights", [True, False])
def test_emit_after_a_config_json_writes_its_folder_or_its_shape(tmp_path, capsys, weights):
    config = _hf_folder(tmp_path / "x", weights)
    plan, cfg = _emit(tmp_path, capsys, "--model", str(config))
    if weights:
        assert cfg.model.init_from == str(config.parent)
    else:
        assert (cfg.model.init_from, cfg.model.d_model, cfg.model.n_kv_heads) == ("", 2048, 4)
    _check_emitted(plan, cfg, plan["model"]["num_params"])


def _ranked_rows(table: str) -> list[int]:
    """Candidate numbers of the table's ranked rows (before the 'not ranked' list)."""
    ranked = table.split("\nfit, but not ranked")[0].split("\n-")[1]
    return [int(m.group(1)) for m in re.finditer(r"^[* ]\s*(\d+) ", ranked, re.M)]


def test_only_what_loom_runs_is_ranked_and_recommended(capsys):
    args = ["--model", "70b", "--gpu", "H100-SXM"]
    plan = plan_json(capsys, *args)
    records = plan["candidates"]
    assert main(["plan", *args]) == 0
    table = capsys.readouterr().out
    rows = _ranked_rows(table)
    assert rows and all(records[i]["runs_in_loom"] for i in rows if records[i]["fits"])
    assert "fit, but not ranked: loom does not run them" in table
    apart = [r for r in records if r["fits"] and not r["runs_in_loom"]]
    fastest_apart = max(apart, key=lambda r: r["tokens_per_s"])
    assert fastest_apart["label"] in table.split("fit, but not ranked")[1]
    assert records[plan["recommended"]]["runs_in_loom"]
    assert all(records[i]["runs_in_loom"] for i in plan["recommendable"])


def test_ties_go_to_the_torch_engine_and_say_so(capsys):
    """70e9 on 8 GPUs: ZeRO-3 with everything on the host (torch) ties with DeepSpeed's
    ZeRO-Offload; the pick is torch's, and the reason does not call it the highest."""
    plan = plan_json(capsys, "--params", "70e9", "--recipe", "zero", "--gpu", "H100-SXM")
    best = plan["candidates"][plan["recommended"]]
    assert best["engine"] == "torch" and best["offload"] == "optimizer+params"
    ties = [r for r in plan["candidates"] if r["fits"] and r["tokens_per_s"] == best["tokens_per_s"]]
    assert len(ties) > 1
    assert "highest predicted throughput" not in plan["reason"]
    assert "ties it in predicted throughput" in plan["reason"] and "the torch engine" in plan["reason"]


def test_deepspeed_pick_gives_its_true_reason(capsys):
    """8b at 64 × 4096 on 8 GPUs, FSDP2 holding unsharded gradients between micro-steps
    (reduce_every_micro_step false): DeepSpeed wins because the same layout on the torch engine does
    not fit, not because of an offload it does not use, and no '0.0% faster'."""
    plan = plan_json(capsys, "--model", "8b", "--gpu", "H100-SXM", "--set", "train.batch_size=64",
                     "--set", "data.seq_len=4096", "--set", "parallel.reduce_every_micro_step=false")
    best = plan["candidates"][plan["recommended"]]
    reason = plan["reason"]
    assert "0.0% faster" not in reason and "optimizer-only" not in reason
    assert best["engine"] == "deepspeed" and best["offload"] == "none"
    same = [r for r in plan["candidates"] if r["engine"] == "torch" and r["strategy"] == best["strategy"]
            and r["tp"] == r["pp"] == r["cp"] == 1 and r["activation_checkpointing"] == "none"]
    torch_same = min(same, key=lambda r: r["memory_bytes"]["total"])
    assert f"needs {torch_same['memory_bytes']['total'] / GB:.3g} GB per GPU" in reason


def test_a_full_offload_keeps_its_staged_layers_on_the_gpu():
    """Everything on the host still leaves the parameters of the layers being computed on the GPU."""
    plan = search(Workload(from_params(70e9), 4096, 256, "bf16", "zero"), Cluster(lookup("H100-SXM"), 8, 1))
    full = next(r for r in plan.candidates if r["offload"] == "optimizer+params" and r["strategy"] == "zero3")
    staged = 2 * 2 * llama_like(70e9).layer_params
    assert full["memory_bytes"]["params"] == 0
    assert full["memory_bytes"]["total"] == pytest.approx(1.1 * staged, rel=1e-6)


@pytest.mark.parametrize("model", ["8b", "70b", "1b"])
def test_the_pick_keeps_the_readmes_headroom(capsys, model):
    """The README promises memory headroom: under 80% of the GPU."""
    assert "memory headroom (under 80% of the GPU)" in " ".join(readme.text().split())
    assert TIGHT == 0.8
    plan = plan_json(capsys, "--model", model, "--gpu", "H100-SXM")
    best = plan["candidates"][plan["recommended"]]
    assert best["memory_bytes"]["total"] <= 0.8 * 80 * GB


def test_a_cpu_plan_speaks_of_a_cpu(capsys, monkeypatch):
    monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(CPU_PROFILE))
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "GPU" not in out
    assert "model states per rank on 2 ranks, MB:" in out and "offload" not in out.split("\n\n")[1]
    assert "ddp                            rank      52.5   (params 13.1 + grads 13.1" in out
    assert not re.search(r"\b0\.0 GB|\d\.\d{4,} GB", out)
    assert re.search(r"\d+(\.\d)? MB of 12\.6 GB per rank", out)


def test_a_cpu_plans_explanation_speaks_of_ranks(capsys, monkeypatch):
    monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(CPU_PROFILE))
    assert main(["plan", "--explain", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    titles = [line for line in lines if line.startswith(("memory", "communication"))]
    assert titles and all(" per rank " in t and "GPU" not in t for t in titles), titles


def test_the_first_calibration_says_how_long_before_it_starts(tmp_path, monkeypatch, capsys):
    """The first `loom plan` on a machine with no profile announces the measurement and its
    duration before measuring, and measures the quick grid."""
    import loom.observe.calibrate as calibrate

    monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(tmp_path / "device.json"))
    seen = {}

    def fake(quick=False, say=print):
        seen["quick"], seen["before"] = quick, capsys.readouterr().err
        from loom.plan.device import load
        return load(CPU_PROFILE)

    monkeypatch.setattr(calibrate, "calibrate", fake)
    assert main(["plan"]) == 0
    assert seen["quick"] and f"about {calibrate.QUICK_BUDGET_S} s" in seen["before"]
    assert calibrate.QUICK_BUDGET_S <= 30


@pytest.mark.parametrize("argv, words", [(["--model", "nope"], "unknown model preset 'nope'"),
                                          (["--set", "train.lr=x"], "train.lr must be float"),
                                          (["--recipe", "nope"], "--recipe 'nope' is not one of")])
def test_a_bad_first_plan_is_told_before_the_calibration(tmp_path, monkeypatch, capsys, argv, words):
    """A first `loom plan` with a bad model, key or recipe says so at once: it does not calibrate
    the machine for minutes (and write its profile) before reading its own arguments."""
    import loom.observe.calibrate as calibrate

    monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(tmp_path / "device.json"))

    def fake(quick=False, say=print):
        raise AssertionError("calibrated before the arguments were checked")

    monkeypatch.setattr(calibrate, "calibrate", fake)
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "calibrating" not in err, err
    assert not (tmp_path / "device.json").exists()


def test_calibration_medians_ride_over_a_burst_of_load():
    """Each probe's windows are one per pass, and its rate is their median: a pass slowed by a burst
    of load from another process moves no rate."""
    import time

    import torch

    from loom.observe.calibrate import PASSES, _in_passes

    calls = {"n": 0}
    burst = 4  # min_time 0: a warm-up call, one call to count, then one call a window: 3, 4, 5

    def probe():
        calls["n"] += 1
        time.sleep(0.1 if calls["n"] == burst else 0.002)

    (seconds,) = _in_passes([probe], 0.0, torch.device("cpu"))
    assert calls["n"] == 5
    assert PASSES == 3 and 0.002 <= seconds < 0.02  # the mean would be over 0.03, the burst 0.1


def test_calibration_drops_later_passes_past_its_deadline():
    import torch

    from loom.observe.calibrate import _in_passes

    calls = {"n": 0}

    def probe():
        calls["n"] += 1

    _in_passes([probe], 0.0, torch.device("cpu"), deadline=0.0)  # long past: one pass only
    one_pass = calls["n"]
    calls["n"] = 0
    _in_passes([probe], 0.0, torch.device("cpu"))
    assert calls["n"] > one_pass


def test_a_near_tie_goes_to_the_torch_engine_before_a_simpler_strategy():
    from loom.plan.search import choose

    def record(strategy: str, engine: str) -> dict:
        return {"label": strategy, "tokens_per_s": 1000.0, "tp": 1, "pp": 1, "offload": "none",
                "activation_checkpointing": "none", "strategy": strategy, "engine": engine,
                "memory_bytes": {"total": 40 * GB}}

    records = [record("zero2", "deepspeed"), record("zero3", "torch")]
    assert choose(records, [0, 1], 80 * GB)[0] == 1


def test_emit_refuses_a_count_too_small_for_a_shape_before_printing(tmp_path, capsys):
    rc = main(["plan", "--params", "1e6", "--gpu", "H100-SXM", "--emit", str(tmp_path / "run.toml")])
    out = capsys.readouterr()
    assert rc != 0 and out.out == "" and not (tmp_path / "run.toml").exists()
    assert "--params 1e+06 is too small for a Llama-style one" in out.err


def test_the_first_calibration_measures_a_thin_grid_holding_the_default_run():
    """The quick grid is a small fraction of the full one's work, and has the default run's shapes
    (8 × 128 tokens through 256-wide linears; attention over 128 tokens, heads of 32)."""
    from loom.observe.calibrate import FULL, QUICK

    def points(grid):
        linear = [6 * r * s * s for r in grid.linear_rows for s in grid.linear_sizes]
        linear = [flops for flops in linear if flops <= grid.max_flops]
        attention = [12 * 8 * q * q * h for q in grid.attention_seqs for h in grid.attention_head_dims]
        return linear, attention

    (linear, attention), (full_linear, full_attention) = points(QUICK), points(FULL)
    assert len(linear) <= 10 and len(QUICK.block_shapes) == len(QUICK.in_situ_shapes) == 1
    assert sum(linear + attention) < 0.1 * sum(full_linear + full_attention)
    assert 1024 in QUICK.linear_rows and 256 in QUICK.linear_sizes
    assert 128 in QUICK.attention_seqs and 32 in QUICK.attention_head_dims


def test_deepspeed_candidates_with_checkpointing_are_not_ranked():
    """loom's deepspeed engine runs no activation checkpointing (config.py refuses it): a plan that
    needs both is shown apart, never recommended (70B at 64 × 4096 picked one before)."""
    plan = search(Workload(from_preset("70b"), 4096, 64, "bf16"), Cluster(lookup("H100-SXM"), 8, 1))
    ds_ac = [r for r in plan.candidates
             if r["engine"] == "deepspeed" and r["activation_checkpointing"] != "none"]
    assert ds_ac and not any(r["runs_in_loom"] for r in ds_ac)
    best = plan.candidates[plan.recommended]
    assert not (best["engine"] == "deepspeed" and best["activation_checkpointing"] != "none")


def test_the_8b_default_plan_runs_fsdp_alone(capsys):
    """Issue 26's goal: the default 8b job on 8 H100s (loss chunked as loom trains it, FSDP2
    reduce-scattering each micro-step) needs neither TP nor PP, and fits with room."""
    plan = plan_json(capsys, "--model", "8b", "--gpu", "H100-SXM")
    best = plan["candidates"][plan["recommended"]]
    assert best["strategy"] in ("zero2", "zero3") and best["tp"] == best["pp"] == 1, best["label"]
    assert best["engine"] == "torch" and best["offload"] == "none"
    assert best["memory_bytes"]["total"] <= TIGHT * 80e9


def test_the_plan_prices_the_loss_as_loom_trains_it(capsys):
    """`loom plan` prices train.loss_chunk for loom's GPT (0 when the config sets 0): the chunked
    run's activations are the smaller by the full logits it does not hold."""
    args = ("--model", "1b", "--gpu", "H100-SXM", "--set", "train.batch_size=8", "--set", "data.seq_len=4096")
    chunked, full = (plan_json(capsys, *args, "--set", f"train.loss_chunk={k}") for k in (512, 0))
    same = lambda plan: {r["label"] + str(r["micro_batch"]): r for r in plan["candidates"]}  # noqa: E731
    a, b = same(chunked), same(full)
    shape = from_preset("1b")
    logits = 4096 * shape.vocab_size * 4  # one sequence's fp32 log-softmax, at the least
    for key in ("zero3" + "1", "ddp" + "1"):
        assert a[key]["memory_bytes"]["activations"] + logits <= b[key]["memory_bytes"]["activations"], key
