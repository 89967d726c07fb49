"""Mixtures of experts and expert parallelism against the single-process reference, on spawned gloo ranks.

The tiny MoE (8 experts, top 2, one shared expert, both blocks MoE) trains with the auxiliary loss and
aux-loss-free bias balancing both on, so that the routing's every piece must agree: per-step losses,
gradient norms and final weights (expert_bias included) equal the plain loop within 1e-5 relative,
at ep = 1, 2 and 4, with FSDP2 (a unit per block), TP (+SP) on the dense parts, PP, HSDP, activation
checkpointing and accumulation. The all-to-all's observed payload equals its closed form.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from test_strategies import (
    ACCUM,
    BATCH,
    RTOL,
    SEQ,
    STEPS,
    UNITS,
    _rank_train,
    _run,
    make_config,
    reference_run,
)

from loom.models.gpt.moe import moe_modules
from loom.plan.comm import ep_payload_per_step
from loom.plan.memory import expert_state_bytes, model_state_bytes
from loom.plan.search import config_candidate, config_workload
from loom.plan.shapes import from_preset
from loom.train import moe_step

# train.lr 3e-3 (not the dense tests' 1e-2): top-k routing is discontinuous where two experts' scores
# nearly tie, and reduction order differs between layouts in the last bits; a gentler step keeps such
# near-ties rarer over the 4 steps.
MOE = ("model.preset=tiny-moe", "model.moe_bias_update_rate=0.001", "model.moe_aux_loss_coef=0.1",
       "train.lr=3e-3")
WEIGHTS_RTOL = 5e-5  # final weights: the last bits of 4 Adam steps, summed in another order


@functools.cache
def moe_reference(corpus: Path, extra: tuple[str, ...] = (), optimizers=None
                  ) -> tuple[list[float], list[float], dict]:
    """The plain loop (test_strategies.reference_run) with the MoE step's two additions: the aux
    loss weighted per micro-batch, and the bias update after each optimizer step."""
    cfg = make_config(corpus, "ddp", *MOE, *extra)

    def aux_share(model) -> None:  # (loss / grad_accum).backward(): the aux loss's share alike
        for block in moe_modules(model):
            block.aux_weight = block.cfg.moe_aux_loss_coef / cfg.train.grad_accum

    return reference_run(cfg, loss_fn=lambda model, batch: model(batch[:, :-1], batch[:, 1:],
                                                                   loss_chunk=cfg.train.loss_chunk),
                         prepare=aux_share, after_step=lambda model: moe_step.after_step(model, None, 8),
                         optimizers=optimizers)


def test_reference_balances_and_learns(corpus):
    """The reference itself: the bias moved (balancing ran) and the loss fell."""
    losses, _, state = moe_reference(corpus)
    assert losses[-1] < losses[0]
    bias = state["layers.0.feed_forward.expert_bias"]
    steps = bias / 0.001  # each step moves each expert's bias by -rate, 0 or +rate
    assert bias.abs().max() > 0 and torch.allclose(steps, steps.round(), atol=1e-3), bias


def assert_matches(results, ref_losses, ref_norms, ref_state) -> None:
    """Every rank's losses and gradient norms within RTOL of the reference, its weights (the stages'
    together under a pipeline) within WEIGHTS_RTOL, tensor by tensor."""
    for rank, (losses, state, _, norms) in enumerate(results):
        for name, got, want in (("losses", losses, ref_losses), ("grad norms", norms, ref_norms)):
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            assert len(got) == STEPS and rel < RTOL, f"rank {rank} {name} {got} vs {want}"
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            err = (state[name] - ref).norm() / ref.norm()
            assert err < WEIGHTS_RTOL, f"rank {rank} {name}: relative error {err:.2e}"
    assert ref_losses[-1] < ref_losses[0]


EP_CASES = [
    ("zero3", 2, ("parallel.ep=1", UNITS)),
    ("zero3", 2, ("parallel.ep=2", UNITS)),
    ("zero3", 4, ("parallel.ep=4",)),
    ("zero2", 4, ("parallel.ep=2", "parallel.activation_checkpointing=full")),
    ("zero3", 4, ("parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true")),
    ("zero3", 4, ("parallel.ep=2", "parallel.pp=2")),
    ("hsdp", 4, ("parallel.ep=2", "parallel.dp_replicate=2", "parallel.dp_shard=2", UNITS)),
    ("ddp", 2, ("parallel.ep=2", "parallel.activation_checkpointing=op")),
    ("zero3", 2, ("parallel.engine=deepspeed",)),
]
EP_IDS = ["ep1-zero3-units", "ep2-zero3-units", "ep4-zero3", "ep2-zero2-dp4-ac", "ep2xtp2-sp", "ep2xpp2",
          "ep2-hsdp-units", "ep2-ddp-op", "ep1-deepspeed-zero3"]


def _candidate(cfg, strategy: str, world: int, extra: tuple[str, ...]):
    """The planner's candidate for a case's mesh."""
    tp, pp = _value(extra, "tp"), _value(extra, "pp")
    dp = world // (tp * pp)
    replicate = dp if strategy in ("ddp", "zero1") else _value(extra, "dp_replicate")
    return config_candidate(cfg, replicate, dp // replicate, tp, pp)


def _value(extra: tuple[str, ...], key: str, default: int = 1) -> int:
    return int(next((e.split("=")[1] for e in extra if e.startswith(f"parallel.{key}=")), default))


@pytest.mark.parametrize("strategy,world,extra", EP_CASES, ids=EP_IDS)
def test_moe_matches_single_process(corpus, strategy, world, extra):
    if "parallel.engine=deepspeed" in extra:
        from optional import DEEPSPEED, require_module

        require_module("deepspeed", DEEPSPEED)
    ref_losses, ref_norms, ref_state = moe_reference(corpus)
    results = _run(corpus, strategy, world, (*MOE, *extra))
    if _value(extra, "pp") > 1:  # each rank holds its stage: the stages' weights together are the model
        merged = {}
        for _, state, _, _ in results:
            merged.update(state)
        results = [(losses, merged, mem, norms) for losses, _, mem, norms in results]
    assert_matches(results, ref_losses, ref_norms, ref_state)
    ep, tp, pp = _value(extra, "ep"), _value(extra, "tp"), _value(extra, "pp")
    # Per MoE block and forward call: the counts (E int64), dispatch and combine; both token exchanges
    # again in backward, and the forward's once more where checkpointing recomputes the block (full, and
    # op, which keeps matmul outputs but replays the collectives).
    again = any(f"parallel.activation_checkpointing={m}" in extra for m in ("full", "op"))
    calls = ACCUM * (pp if pp > 1 else 1)  # pipeline: its micro-batches (pp of them) per micro-step
    blocks = 2 // pp
    tokens = BATCH // (world // (tp * pp)) // calls * SEQ  # T of one forward call on a rank
    for rank, m in enumerate(results[0][2]):
        seen = m["comm_by_kind"].get("ep_alltoall")
        if ep == 1:
            assert seen is None, (rank, m["comm_by_kind"])
            continue
        assert seen["count"] == blocks * calls * (5 + 3 * again), (rank, seen)
    if ep > 1:
        # Dispatch sends all of the rank's T·k choices (top 2 of d 64, fp32); combine returns what the
        # rank's experts received, so over the ep group each exchange averages T·k rows.
        rows = tokens * 2 * 64 * 4
        per_call = rows * (4 + 2 * again) + 8 * 8 * (1 + again)
        group = [m["comm_by_kind"]["ep_alltoall"]["payload_bytes"] for m in results[0][2]]
        assert sum(group) / len(group) == pytest.approx(blocks * calls * per_call), group
        # ... which is what the planner prices, bytes and calls (the pipeline's one flush per step
        # counted train.grad_accum times: a gap of its pipeline model, older than ep)
        cfg = make_config(corpus, strategy, *MOE, *extra)
        planned, ops = ep_payload_per_step(config_workload(cfg, from_preset("tiny-moe")),
                                           _candidate(cfg, strategy, world, extra))
        flushes = ACCUM if pp > 1 else 1
        assert (sum(group) / len(group), seen["count"]) == pytest.approx((planned * flushes, ops * flushes))
    if tp > 1 or pp > 1 or "parallel.engine=deepspeed" in extra:
        return
    # Model states per rank: the dense part as the strategy shards it (16Ψ/N), the routed experts split
    # over ep first (zero3: 16·P_e/(ep·dp/ep); ddp: 16·P_e/ep), as the planner prices them
    cfg = make_config(corpus, strategy, *MOE, *extra)
    w, c = config_workload(cfg, from_preset("tiny-moe")), _candidate(cfg, strategy, world, extra)
    routed = expert_state_bytes(w, c).total
    dense = w.shape.num_params - w.shape.stage_routed_params(0, 1)
    planned = model_state_bytes(strategy, dense, c.shard_size).total
    for rank, m in enumerate(results[0][2]):
        assert m["model_state_bytes"] == pytest.approx(planned + routed, rel=0.01), (rank, m)


def _rank_train_grouped(cfg):
    """Train with the experts as grouped GEMMs (CUDA's path; torch's CPU form of the product, fp32)."""
    from loom.models.gpt import moe

    moe.grouped_dtype = lambda device, dtype, *widths: torch.float32
    return _rank_train(cfg)


@pytest.mark.parametrize("extra", [("parallel.ep=1", UNITS), ("parallel.ep=2", UNITS)], ids=["ep1", "ep2"])
def test_grouped_experts_match_single_process(corpus, extra):
    """CUDA's grouped experts (sizes on the device at ep 1; the all-to-all's host sizes at ep 2) train
    as the single-process reference's per-expert loop does."""
    ref_losses, ref_norms, ref_state = moe_reference(corpus)
    results = run_ranks(_rank_train_grouped, 2, make_config(corpus, "zero3", *MOE, *extra))
    assert_matches(results, ref_losses, ref_norms, ref_state)


def test_bf16_moe_tracks_the_fp32_reference(corpus):
    """zero3 ep 2 under bf16 (FSDP2's 16-bit compute, fp32 master weights and reductions): the same
    training, within bf16's rounding."""
    ref_losses, _, _ = moe_reference(corpus)
    results = _run(corpus, "zero3", 2, (*MOE, "parallel.ep=2", "train.precision=bf16"))
    for losses, *_ in results:
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 2e-2, (losses, ref_losses)


CKPT_MOE = ["model.preset=tiny-moe", "model.moe_bias_update_rate=0.001"]


def test_resume_at_ep2_is_bit_exact(tmp_path):
    from test_checkpoint import _check_bit_exact, _resume_pairs

    case = [*CKPT_MOE, "parallel.strategy=zero3", "parallel.ep=2", UNITS]
    _check_bit_exact(run_ranks(_resume_pairs, 2, {"ep2": case}, str(tmp_path))[-1])


def test_checkpoints_reshard_across_ep_degrees(tmp_path):
    """A zero3 ep 2 checkpoint read into ep 4, saved again, read into ep 1 (ddp) and saved again: every
    weight, Adam state and expert bias tensor by tensor as saved."""
    from test_checkpoint import _resave, _train_from

    from loom.train import checkpoint

    run_ranks(_train_from, 2, [*CKPT_MOE, "parallel.strategy=zero3", "parallel.ep=2"], str(tmp_path / "a"),
              None, 2)
    source = tmp_path / "a" / "checkpoints" / "step_2"
    run_ranks(_resave, 4, [*CKPT_MOE, "parallel.strategy=zero3", "parallel.ep=4"], str(source),
              str(tmp_path / "b"))
    run_ranks(_resave, 2, [*CKPT_MOE, "parallel.strategy=ddp"],
              str(tmp_path / "b" / "checkpoints" / "step_2"), str(tmp_path / "c"))
    saved = checkpoint.read_tensors(source, "")
    assert any(k.endswith("expert_bias") and saved[k].abs().sum() > 0 for k in saved)
    for held_dir in (tmp_path / "b", tmp_path / "c"):
        held = checkpoint.read_tensors(held_dir / "checkpoints" / "step_2", "")
        assert set(held) == set(saved) and any(k.startswith("optim.") for k in saved)
        for name, tensor in saved.items():
            assert torch.equal(held[name], tensor), (held_dir.name, name)


def _train_mixtral(folder: str, corpus: str, run_dir: str) -> list[float]:
    from loom.config import load_config
    from loom.train.driver import train

    cfg = load_config(None, [f'model.init_from="{folder}"', f'data.source="{corpus}"', "data.seq_len=32",
                             "data.num_workers=0", "train.batch_size=4", "train.steps=2", "train.lr=1e-9",
                             "train.warmup_steps=0", "parallel.strategy=zero3", "parallel.ep=2"])
    return train(cfg, Path(run_dir), quiet=True).losses


def test_mixtral_folder_trains_at_ep2_and_exports_back_unchanged(tmp_path, corpus):
    """model.init_from a Mixtral folder (each ep rank reading its experts), 2 steps at lr 1e-9, then
    `loom export --layout hf`: Mixtral's tensors and config, as they were."""
    from optional import TEST_EXTRA, require_module

    require_module("transformers", TEST_EXTRA)
    from safetensors.torch import load_file
    from test_moe_hf import make_mixtral

    from loom.train.export import export

    folder = tmp_path / "mixtral"
    hf = make_mixtral(folder)
    losses = run_ranks(_train_mixtral, 2, str(folder), str(corpus), str(tmp_path / "run"))[0]
    assert len(losses) == 2
    out = tmp_path / "exported"
    out.mkdir()
    export(tmp_path / "run", out / "model.safetensors", layout="hf")
    stored, exported = load_file(str(folder / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert exported.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-6), name
    import transformers

    again = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.allclose(again(tokens).logits, hf(tokens).logits, atol=1e-4)
