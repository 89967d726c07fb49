"""Context parallelism against the single-process reference, on spawned gloo ranks.

Each sequence of SEQ = 32 tokens is split into 2·cp chunks (two per rank: a front chunk and its
mirror), so every rank's attention spans several k/v blocks and the causal balance matters. Per-step
losses, gradient norms and final weights must equal the plain loop within 1e-5 relative, under both
exchanges and with FSDP2 (a unit per block), DDP, ZeRO-1, HSDP, TP (+SP), PP, activation checkpointing
and a 3-D + cp layout. The exchange's observed payload must equal the planner's, zero3's model states
must be sharded over dp × cp, and the activation peak must fall with cp.
"""

from __future__ import annotations

import pytest
from test_strategies import (
    ACCUM,
    UNITS,
    _reference,
    _reference_norms,
    _run,
    assert_matches_reference,
)

from loom.config import load_config
from loom.plan.comm import comm_per_step
from loom.plan.memory import model_state_bytes
from loom.plan.search import config_candidate, config_workload
from loom.plan.shapes import from_preset

RING, A2A = "parallel.cp_mode=ring", "parallel.cp_mode=alltoall"
CP_CASES = [
    ("zero3", 2, ("parallel.cp=2", RING, UNITS)),
    ("zero3", 2, ("parallel.cp=2", A2A, UNITS)),
    ("zero3", 4, ("parallel.cp=4", RING)),
    ("zero3", 4, ("parallel.cp=4", A2A)),
    ("ddp", 4, ("parallel.cp=2", RING, "parallel.activation_checkpointing=full")),
    ("zero1", 4, ("parallel.cp=2", A2A)),
    ("hsdp", 4, ("parallel.cp=2", RING, "parallel.dp_replicate=2", "parallel.dp_shard=1",
                 "parallel.activation_checkpointing=op")),
    ("zero3", 4, ("parallel.cp=2", RING, "parallel.tp=2", "parallel.sequence_parallel=true")),
    ("zero3", 4, ("parallel.cp=2", A2A, "parallel.pp=2")),
    ("zero3", 8, ("parallel.cp=2", RING, "parallel.pp=2", "parallel.tp=2")),
]
CP_IDS = ["cp2-ring-units", "cp2-a2a-units", "cp4-ring", "cp4-a2a", "cp2xddp-dp2-ac", "cp2xzero1-a2a",
          "cp2xhsdp-op", "cp2xtp2-sp", "cp2xpp2-a2a", "cp2xpp2xtp2"]


def _extra_value(extra: tuple[str, ...], key: str, default: int = 1) -> int:
    return int(next((e.split("=")[1] for e in extra if e.startswith(f"parallel.{key}=")), default))


@pytest.mark.parametrize("strategy,world,extra", CP_CASES, ids=CP_IDS)
def test_context_parallel_matches_single_process(corpus, strategy, world, extra):
    ref_losses, ref_state = _reference(corpus)
    results = _run(corpus, strategy, world, extra)
    pp = _extra_value(extra, "pp")
    if pp > 1:  # each rank holds its stage: the stages' weights together are the model
        merged = {}
        for _, state, _, _ in results:
            merged.update(state)
        results = [(losses, merged, mem, norms) for losses, _, mem, norms in results]
    assert_matches_reference(results, ref_losses, ref_state, _reference_norms(corpus))
    cp, tp = _extra_value(extra, "cp"), _extra_value(extra, "tp")
    kind = "cp_alltoall" if A2A in extra else "cp_ring"
    # The exchange each rank issued in step 2 is what the planner prices, byte for byte.
    from test_strategies import make_config

    cfg = make_config(corpus, strategy, *extra)
    dp = world // (cp * tp * pp)
    replicate = dp if strategy in ("ddp", "zero1") else _extra_value(extra, "dp_replicate")
    candidate = config_candidate(cfg, replicate, dp // replicate, tp, pp)
    planned = comm_per_step(config_workload(cfg, from_preset("tiny")), candidate, 8)[0].payload_dict()
    for rank, m in enumerate(results[0][2]):
        seen = m["comm_by_kind"][kind]
        # (under a pipeline the planner's candidate runs one flush of micro-batches per step, not
        # train.grad_accum of them: a gap of its pipeline model, older than cp; its sends have it too)
        flushes = ACCUM if pp > 1 else 1
        want = (planned["payload_bytes_by_kind"][kind] * flushes, planned["count_by_kind"][kind] * flushes)
        assert (seen["payload_bytes"], seen["count"]) == pytest.approx(want), (rank, seen, planned)
        assert set(m["comm_by_kind"]) & {"cp_ring", "cp_alltoall"} == {kind}, m["comm_by_kind"]
        # the pipeline's own sends stay its own
        assert ("send" in m["comm_by_kind"]) == (pp > 1), m["comm_by_kind"]
        if strategy == "zero3" and tp == pp == 1:  # sharded over dp_shard × cp: all `world` ranks
            expected = model_state_bytes("zero3", m["num_params"], world).total
            assert abs(m["model_state_bytes"] - expected) <= 0.01 * expected, (rank, m, expected)


def test_cp_config_refused_before_launch():
    from loom.config import validate
    from loom.errors import ConfigError

    cfg = load_config(None, ["parallel.cp=2", "data.seq_len=30"])
    with pytest.raises(ConfigError, match="not divisible by 4"):
        validate(cfg, 2, cuda_available=False, this_machine=False)


def _rank_packed_documents(world: int) -> dict:
    """On each cp rank: loom's GPT with documents packed into each window, loss and gradients under
    both exchanges (its share of the tokens), beside the single-process model with the same mask."""
    import torch
    import torch.distributed as dist

    from loom.models.gpt.config import GPTConfig
    from loom.models.gpt.model import build_model
    from loom.parallel.context_parallel import ContextGroup, SequenceSplit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=64)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 32, (2, 33), generator=g)
    tokens[0, [4, 5, 19, 27]] = 1  # EOS: documents of 5, 1, 14, 8, ... tokens; the second row one more
    tokens[1, [15]] = 1
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for mode in ("ring", "alltoall", None):
        model = build_model(cfg, device="cpu")
        model.init_weights(3)
        cp = ContextGroup(dist.group.WORLD, world, rank, mode) if mode else None
        model.sequence_split = SequenceSplit(cp, eos=1)
        loss = model(inputs, targets, loss_chunk=8)
        loss.backward()
        # the mean over all tokens: each rank's mean over its half, averaged over the ranks
        if mode:
            dist.all_reduce(loss.detach())
            for p in model.parameters():
                dist.all_reduce(p.grad)
        scale = world if mode else 1
        out[mode] = (float(loss) / scale, {n: p.grad / scale for n, p in model.named_parameters()})
    return out


def test_packed_documents_under_cp_equal_one_rank():
    from distributed import run_ranks

    for result in run_ranks(_rank_packed_documents, 2, 2):
        ref_loss, ref_grads = result[None]
        for mode in ("ring", "alltoall"):
            loss, grads = result[mode]
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (mode, loss, ref_loss)
            for name, g in grads.items():
                err = (g - ref_grads[name]).norm() / ref_grads[name].norm()
                assert err < 1e-5, (mode, name, float(err))


def _rank_run(cfg, out: str) -> None:
    from pathlib import Path

    from loom.train.driver import train

    train(cfg, Path(out), quiet=True)


def _activation_rows(corpus, tmp_path, name: str, world: int, *extra: str) -> list[tuple[float, float]]:
    import json

    from distributed import run_ranks

    cfg = load_config(None, [
        "model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=1024", "model.max_seq_len=1024",
        "data.num_workers=0", "train.steps=2", "train.batch_size=2", "train.eval_batches=0",
        "parallel.strategy=zero3", *extra])
    run_ranks(_rank_run, world, cfg, str(tmp_path / name))
    rows = json.loads((tmp_path / name / "summary.json").read_text())["measured_vs_planned"]
    return [tuple(row["activation_peak_bytes"]) for row in rows]


def test_activation_peak_falls_with_cp_as_planned(corpus, tmp_path):
    """Long sequences (1024 tokens), activations well above the tiny model's states: one rank
    holding whole sequences, then cp = 2 (each rank half of each, same global batch) under both
    exchanges. Every rank's measured peak is the plan's within ±10%, and cp halves it."""
    whole = _activation_rows(corpus, tmp_path, "cp1", 1)
    for mode in ("ring", "alltoall"):
        split = _activation_rows(corpus, tmp_path, mode, 2, "parallel.cp=2", f"parallel.cp_mode={mode}")
        for measured, planned in whole + split:
            assert abs(measured - planned) <= 0.10 * planned, (mode, measured, planned)
        assert all(m < 0.6 * whole[0][0] for m, _ in split), (mode, split, whole)


def _rank_losses(cfg):
    from loom.train.driver import train

    r = train(cfg, None, quiet=True)
    return r.losses, r.eval_loss


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_cp_eval_and_precision_match_one_rank(corpus, precision, rtol):
    """Training and held-out losses of cp = 2 (ring) against one rank holding whole sequences, in
    fp32 (exact) and bf16 (the rounding of a different reduction order)."""
    from distributed import run_ranks
    from test_strategies import make_config

    base = ("train.eval_every=2", f"train.precision={precision}")
    one = run_ranks(_rank_losses, 1, make_config(corpus, "zero3", *base))[0]
    split = run_ranks(_rank_losses, 2, make_config(corpus, "zero3", *base, "parallel.cp=2", RING))[0]
    for a, b in zip(split[0] + [split[1]], one[0] + [one[1]]):
        assert abs(a - b) <= rtol * abs(b), (precision, split, one)
