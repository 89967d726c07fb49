"""Measured vs planned: `loom train` writes plan.json, and on gloo ranks each rank's model-state
bytes (1%) and activation peak (20%) match it, and so do the collectives of a step as observed
(payload bytes and counts per kind; wire bytes are only modelled, so not compared here).

The activation peak is also checked where the first activation model drifted (issue 15: 0.81 of
the plan for 125m in fp32, 0.59 in bf16): 16-bit compute (fp32 norm copies; autocast's per-linear
casts and cached weight copies), a vocabulary-heavy tied model (the root unit kept gathered, the
loss's fp32 tensors, gradients not yet rebuilt at backward's start, the tied root's
reduce-scatter ending backward) and the vocab-parallel loss — tiny shapes, 10%. (bench/activations.py
runs the presets tiny to 1b's shape: 0.96-1.02 of the plan but tiny ddp × tp2 with full checkpointing,
1.18 there; here 1.11 until TP's SwiGLU backward held two f-wide tensors of its own, not three: 1.04.)

Several FSDP2 units (`units`: the tiny preset is one unit at the default fsdp_unit_mb, where zero2 and
zero3 hold the same) make zero3's peak and all-gathers those of resharding: zero3 run as zero2 fails
here.

The plan counts the loop's few-byte collectives (mean loss, gradient norm: all-reduces; DDP's
rebuilt bucket order in step 2: broadcasts; under tensor parallelism the vocabulary-split loss's
statistics) where it knows them (plan.json's comm_loop_by_kind): there every kind must match exactly.
Where it does not (DeepSpeed), all-gather, reduce-scatter,
send and recv must match exactly, all-reduce and broadcast may exceed the plan by those bytes: at most
0.5% of the rank's planned payload.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import run_ranks

from loom.config import load_config
from loom.models.gpt.lean_ops import plain_ops
from loom.parallel.mesh import shutdown
from loom.parallel.pipeline import weight_pass_takes_functions
from loom.train.driver import train

# Several FSDP2 units whose parameters outweigh the activations (the tiny preset is one unit at the
# default fsdp_unit_mb, where zero2 and zero3 hold the same): a unit each for the embedding and the
# head (8 MB: a vocabulary of 8192) and for 4 blocks of 2.4 MB. Between forward and backward zero2
# keeps every unit gathered, zero3 only the head's: their peaks and all-gathers differ.
BLOCKS = ("parallel.fsdp_unit_mb=0", "model.n_layers=4", "model.d_model=256", "model.n_heads=4",
          "model.ffn_hidden=512", "data.seq_len=32", "train.batch_size=4")
UNITS = (*BLOCKS, "model.vocab_size=8192")
# zero2 peaks at the head's reduce-scatter (the other units gathered; the head's weight gradient held
# through it, gloo's copy of its input): 1.39 of the plan before the plan held them. (zero3 with the
# blocks outweighing the head peaks at the top block's all-gather for its backward: the plan's "block
# backward" moment, 1.16 of it.)
# 8 micro-batches of one sequence over 4 layers (a V needs 2 per rank, and m ≥ 2p)
PIPELINE = ("model.n_layers=4", "parallel.microbatches=8")
ZBV = ("parallel.pp=2", "parallel.pp_schedule=zbv", *PIPELINE)
PP_BLOCKS = ("parallel.fsdp_unit_mb=0", "model.n_layers=8", "model.d_model=256", "model.n_heads=4",
             "model.ffn_hidden=768", "parallel.microbatches=8", "parallel.pp=2")
INTERLEAVED = ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", *PIPELINE)
# expert parallelism: the experts' all-to-alls and their units, the experts' norm apart, the router's tally
EXPERTS = ("model.preset=tiny-moe", "parallel.ep=2")
# the experts' all-to-alls carry the rows each rank's routing sends: the ranks' mean is the plan's
ROUTED = "ep_alltoall"
CASES = [
    ("ddp", 2, ()), ("zero1", 2, ()), ("zero2", 2, ()), ("zero3", 2, ("train.grad_accum=2",)),
    ("hsdp", 4, ("parallel.dp_replicate=2", "parallel.dp_shard=2")),
    ("zero3", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    # ddp under TP (FSDP2 replicating the model) all-reduces its gradients on the last micro-step only
    ("ddp", 4, ("parallel.tp=2", "parallel.activation_checkpointing=full", "train.grad_accum=2")),
    ("zero3", 2, ("parallel.pp=2",)),
    # each rank's stages and what torch's pipeline keeps of its micro-batches (loom/plan/in_flight.py):
    # a V (the embedding and the head on rank 0, the cool-down's deferred W's) and a multi-stage schedule
    # (its sends held to the step's end)
    ("zero3", 2, ZBV), ("zero3", 2, INTERLEAVED),
    # a V's rank 0 all-reduces the gradients of both ends and of its blocks, the other rank its blocks'
    ("ddp", 4, (*ZBV, "train.batch_size=16")),
    ("zero2", 2, UNITS), ("zero3", 2, UNITS),
    ("zero3", 2, BLOCKS),
    # a pipeline reduces each stage's units after its last backward, the later units still gathered with
    # their gradients: stage 0 peaks at its embedding's reduce-scatter (1.28 of the plan before it knew),
    # the last stage reduce-scatters no head in its backward (0.78 before)
    ("zero3", 4, (*UNITS, "parallel.pp=2")),
    # on one rank (FSDP2 over one rank): 1F1B's forward between two backwards reshards every unit, so a
    # backward gathers them as it consumes its micro-batch (0.83 of the plan that held both at once, 8
    # blocks); the embedding's new gradient beside the one accumulated (8,192 rows: 1.37 before)
    ("zero3", 2, PP_BLOCKS), ("zero3", 2, (*UNITS, "parallel.pp=2")),
    # GPipe: every forward first, so the last micro-batch's head backward has every unit gathered (1.15)
    ("zero3", 4, (*UNITS, "parallel.pp=2", "parallel.pp_schedule=gpipe")),
    # TP: the embedding's gradient whole over the vocabulary, sliced to its shard at the end of backward
    # (1.26 of the plan before it knew; tied, beside the root's first reduce-scatter: 1.13)
    ("zero3", 4, (*UNITS, "parallel.tp=2", "parallel.sequence_parallel=true")),
    ("zero3", 4, (*UNITS, "parallel.tp=2", "model.tie_embeddings=true")),
    ("zero3", 2, EXPERTS),
    # within a pipeline each stage's loop: the last stage's loss statistics, each stage's tally
    ("zero3", 4, ("model.preset=tiny-moe", "parallel.pp=2", "parallel.tp=2")),
]
IDS = ["ddp", "zero1", "zero2", "zero3-accum2", "hsdp-2x2", "tp2-sp", "tp2xddp-ac-accum2", "pp2", "pp2-zbv",
       "pp2-interleaved", "pp2-zbv-ddp2", "zero2-units", "zero3-units", "zero3-blocks", "pp2-zero3-units",
       "pp2-zero3-blocks-one-rank", "pp2-zero3-units-one-rank", "pp2-gpipe-zero3-units", "tp2-zero3-units",
       "tp2-zero3-units-tied", "ep2-moe", "pp2xtp2-moe"]
# zero3-blocks peaks at 1.11 of the plan (the block-backward moment above); on a loaded 2-core machine
# (CI), once in several runs, 0.79 MB more is live at that peak (1.22): a timing of gloo's collectives,
# not of the model (the same with Python's GC off; never seen on idle cores). Its band is 25%.
LOADED_BAND = {BLOCKS: 0.25}
# the pipeline schedules' memory, within the 10% issue 41 asks of zbv; the layouts whose moments were
# measured (TP's rebuilt block: 1.11 of the plan while its SwiGLU backward held three f-wide tensors)
BAND = {ZBV: 0.10, INTERLEAVED: 0.10, (*UNITS, "parallel.pp=2"): 0.10, PP_BLOCKS: 0.10,
        ("parallel.tp=2", "parallel.activation_checkpointing=full", "train.grad_accum=2"): 0.10,
        (*UNITS, "parallel.pp=2", "parallel.pp_schedule=gpipe"): 0.10,
        (*UNITS, "parallel.tp=2", "parallel.sequence_parallel=true"): 0.10,
        (*UNITS, "parallel.tp=2", "model.tie_embeddings=true"): 0.10}
EXACT = ("all_gather", "reduce_scatter", "send", "recv")  # only the plan's collectives issue these
EXTRA = 0.005  # the unplanned few-byte collectives, as a share of the rank's planned payload


def _rank(cfg, out: str) -> None:
    train(cfg, Path(out), quiet=True)


@pytest.mark.parametrize("strategy,world,extra", CASES, ids=IDS)
def test_measured_matches_plan(corpus, tmp_path, strategy, world, extra):
    cfg = load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=128", "data.num_workers=0",
        "train.steps=2", "train.batch_size=8", "train.eval_batches=1", f"parallel.strategy={strategy}",
        *extra])
    run_ranks(_rank, world, cfg, str(tmp_path))
    plan = json.loads((tmp_path / "plan.json").read_text())
    # (step time: tests/distributed/test_plan_time.py, on the tests' device profile)
    assert plan["strategy"] == strategy and plan["gpus"] == world
    rows = json.loads((tmp_path / "summary.json").read_text())["measured_vs_planned"]
    assert len(rows) == world
    band = LOADED_BAND.get(extra, BAND.get(extra, 0.20))
    routed = [row["comm_by_kind"].pop(ROUTED, None) for row in rows]
    if any(routed):  # then compared apart: in all, and each rank's count
        sent = sum(r["payload_bytes"][0] for r in routed)
        assert sent == pytest.approx(world * routed[0]["payload_bytes"][1]), routed
        assert all(r["count"][0] == r["count"][1] for r in routed), routed
    for row, own in zip(rows, routed):
        for key, part in (("comm_payload_bytes", "payload_bytes"), ("comm_count", "count")):
            if own:  # the rest of the rank's collectives
                row[key] = [a - b if a is not None else None for a, b in zip(row[key], own[part])]
        for key, tolerance in (("model_state_bytes", 0.01), ("activation_peak_bytes", band)):
            measured, planned = row[key]
            assert planned > 0 and measured is not None, (row["rank"], key, row)
            assert abs(measured - planned) <= tolerance * planned, (row["rank"], key, measured, planned)
        seen, planned = row["comm_payload_bytes"]
        assert 0 < planned <= seen <= planned * (1 + EXTRA), (row["rank"], seen, planned)
        loop_planned = plan["comm_loop_by_kind"] is not None  # then every kind is exact (where counted)
        if loop_planned:
            (n_seen, n_planned) = row["comm_count"]
            assert seen == planned and n_planned in (None, n_seen), (row["rank"], row["comm_count"])
        for kind, v in row["comm_by_kind"].items():
            (seen, planned), (n_seen, n_planned) = v["payload_bytes"], v["count"]
            where = (row["rank"], kind, v)
            if kind in EXACT:
                assert seen == pytest.approx(planned, rel=1e-9) and n_seen == n_planned, where
            elif loop_planned:
                assert seen == pytest.approx(planned, rel=1e-9) and n_planned in (None, n_seen), where
            else:
                assert planned * (1 - 1e-9) <= seen <= planned + EXTRA * row["comm_payload_bytes"][1], where
                assert n_planned is None or n_seen >= n_planned, where


# Tiny models where the first activation model missed by 21-110%: a wider tiny (d 256) whose 8192-token
# tied embedding is 64% of its parameters, as in 125m (31%) and 1b (21%); one FSDP2 unit; and tiny with
# that vocabulary under tensor parallelism. Each case names what it catches.
WIDE = ("model.d_model=256", "model.n_heads=4", "model.ffn_hidden=512", "model.vocab_size=8192",
        "model.tie_embeddings=true", "train.batch_size=4", "data.seq_len=64")
DRIFT = [
    # bf16 under FSDP2: fp32 norm copies, the root kept gathered, no gradient yet at backward's
    # start, the end-of-backward reduce-scatter (gloo copies its input): 1.21 of the old plan
    ("zero3", (*WIDE, "train.precision=bf16")),
    # autocast: the residual stream stays fp32, each linear casts its input, the weights' 16-bit
    # copies live until backward ends, the tied weight's three fp32 gradients: 2.10
    ("ddp", (*WIDE, "train.precision=bf16")),
    # checkpointed blocks and a small activation set: the tied embedding's backward (its
    # gradient, the head's, their sum beside the model's unsharded gradients) is the peak: 1.38
    ("zero3", (*WIDE, "parallel.activation_checkpointing=full")),
    # the vocab-parallel loss: three fp32 tensors of the logits' size in its backward: 1.27
    ("zero3", ("model.vocab_size=8192", "train.precision=bf16", "parallel.tp=2",
               "parallel.sequence_parallel=true")),
    # DDP's no_sync micro-steps accumulate into gradients of their own beside its buckets: 1.54 on
    # the small preset with 4 micro-steps (loom bench's memory benchmark)
    ("ddp", ("train.grad_accum=4",)),
    # op-level checkpointing: each block keeps its matmuls' and attention's outputs (plan/shapes.py::
    # op_saved_bytes_per_layer), the topmost rebuilt beside them
    ("zero3", (*WIDE, "parallel.activation_checkpointing=op")),
    ("zero3", (*WIDE, "train.precision=bf16", "parallel.activation_checkpointing=op")),
    ("ddp", (*WIDE, "train.precision=bf16", "parallel.activation_checkpointing=op")),
]
DRIFT_IDS = ["zero3-bf16-vocab", "ddp-autocast-vocab", "zero3-fp32-full-vocab", "tp2-sp-bf16-vocab",
             "ddp-accum4", "zero3-fp32-op-vocab", "zero3-bf16-op-vocab", "ddp-autocast-op-vocab"]


@pytest.mark.parametrize("strategy,extra", DRIFT, ids=DRIFT_IDS)
def test_activation_peak_where_the_model_drifted(corpus, tmp_path, strategy, extra):
    cfg = load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=128", "data.num_workers=0",
        "train.steps=2", "train.batch_size=8", "train.eval_batches=1", f"parallel.strategy={strategy}",
        *extra])
    run_ranks(_rank, 2, cfg, str(tmp_path))
    for row in json.loads((tmp_path / "summary.json").read_text())["measured_vs_planned"]:
        measured, planned = row["activation_peak_bytes"]
        assert abs(measured - planned) <= 0.10 * planned, (row["rank"], measured, planned)


# Pipelines in bf16 (FSDP2's 16-bit weights), where the plan missed by up to 16%. zb and zbv run plain ops
# where torch's weight pass cannot start at a Function (torch 2.11, the GPU machine's): `plain` forces
# that form here, as 2.11 chooses it, plan and run alike. Each case names what it catches.
PIPELINE_16 = [
    # the gradients each stage's W leaves in 16-bit to its next B, the input pass's norm temporaries
    # beside every saved tensor, input gradients only where a send to another rank holds them: 1.10 (plain)
    # and 1.08 of the plan before
    ("zbv", True), ("zbv", False),
    ("zb", False),  # its stages' 16-bit gradients alike: 1.07
    ("1f1b", False),  # a whole backward in its top block: SwiGLU's gradients, then its weights': 1.16
]
PIPELINE_16_IDS = ["zbv-plain", "zbv-lean", "zb-lean", "1f1b"]


def _rank_as_torch_211(cfg, out: str, plain: bool) -> bool:
    if plain:  # the run and its plan take this torch for one whose weight pass takes no Function
        import loom.train.driver as driver
        import loom.train.record as record
        driver.weight_pass_takes_functions = record.weight_pass_takes_functions = lambda: False
    train(cfg, Path(out), quiet=True)
    return plain_ops()  # what the model ran


@pytest.mark.parametrize("schedule,plain", PIPELINE_16, ids=PIPELINE_16_IDS)
def test_pipeline_activation_peak_in_16_bit(corpus, tmp_path, schedule, plain):
    cfg = load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=128", "data.num_workers=0",
        "train.steps=2", "train.batch_size=8", "train.eval_batches=1", "parallel.strategy=zero3",
        "train.precision=bf16", "parallel.pp=2", f"parallel.pp_schedule={schedule}", *PIPELINE,
        *(("parallel.pp_virtual_stages=2",) if schedule == "zb" else ())])
    ran_plain = run_ranks(_rank_as_torch_211, 2, cfg, str(tmp_path), plain)
    functions = weight_pass_takes_functions() or schedule == "1f1b"  # (1F1B runs no split backward)
    assert ran_plain == [plain or not functions] * 2
    for row in json.loads((tmp_path / "summary.json").read_text())["measured_vs_planned"]:
        measured, planned = row["activation_peak_bytes"]
        assert abs(measured - planned) <= 0.06 * planned, (row["rank"], measured, planned)


# One replica a stage (pp 2 on 2 ranks): what the planner missed by up to 17%, each case naming it
ONE_REPLICA = [
    # GPipe's first backward holds every micro-batch and no accumulated gradient, its second one fewer and
    # all of them (0.83-0.92 of the plan before, bf16 1.05-1.08 without the second); a later stage's first
    # block keeps its receive buffer, the final norm its input and rstd only
    ("gpipe", "zero3", "fp32"), ("gpipe", "zero3", "bf16"), ("gpipe", "ddp", "bf16"),
    # zb's first stage keeps no output gradients for its W, which runs the whole backward, and its outputs
    # among the sends held; its last keeps each norm's output gradient for W (0.91 and 1.04 before)
    ("zb", "zero3", "fp32"),
]
# (1F1B's last stage: its output kept and its held send are caught by the 16-bit case above, not by fp32's
# margin here; its top block after the final norm by tests/unit/test_plan_schedules.py)


@pytest.mark.parametrize("schedule,strategy,precision", ONE_REPLICA,
                         ids=["-".join(case) for case in ONE_REPLICA])
def test_pipeline_activation_peak_on_one_replica(corpus, tmp_path, schedule, strategy, precision):
    cfg = load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=128", "data.num_workers=0",
        "train.steps=2", "train.batch_size=8", "train.eval_batches=1", f"parallel.strategy={strategy}",
        f"train.precision={precision}", "parallel.pp=2", f"parallel.pp_schedule={schedule}", *PIPELINE])
    run_ranks(_rank, 2, cfg, str(tmp_path))
    for row in json.loads((tmp_path / "summary.json").read_text())["measured_vs_planned"]:
        measured, planned = row["activation_peak_bytes"]
        assert abs(measured - planned) <= 0.06 * planned, (row["rank"], measured, planned)


def test_summary_prints_measured_beside_planned(corpus, tmp_path, capsys):
    cfg = load_config(None, ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=64",
                             "data.num_workers=0", "train.steps=2", "train.batch_size=4",
                             "train.eval_batches=1", "train.log_every=1"])
    try:
        train(cfg, tmp_path)  # a world of one in this process
    finally:
        shutdown()
    out = capsys.readouterr().out
    assert "measured / planned (MiB)" in out and "collective payload per step (observed)" in out
    assert "wire bytes per step, modelled" in out
    assert (tmp_path / "plan.json").exists()
