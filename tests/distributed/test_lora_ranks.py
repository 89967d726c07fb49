"""LoRA on every layout against the single-process reference, on spawned gloo ranks.

The tiny GPT's every block linear gets rank-4 adapters (alpha 8); the base is frozen. Per-step
losses, gradient norms and final weights equal the plain loop's (the same adapters added to the
plain model) within 1e-5 relative, for ddp, zero1, zero2/zero3 with a unit per block, hsdp, TP
with sequence parallelism, PP, CP and the MoE blocks' experts under ep; the base weights are
bit-identical after training, and a step's gradient collectives carry the adapters alone.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from test_strategies import (
    ACCUM,
    HSDP,
    RTOL,
    STEPS,
    UNITS,
    _run,
    make_config,
    reference_run,
)

from loom.models.gpt.model import build_model
from loom.models.lora import apply_lora, blocks_of, is_adapter
from loom.plan.memory import lora_states
from loom.plan.search import config_candidate, config_workload
from loom.plan.shapes import from_preset
from loom.train import moe_step
from loom.train.task import load_data, model_config

LORA = ("lora.rank=4", "lora.alpha=8")
# B starts at zero: after 4 Adam steps its smallest entries carry the reduction order's last bits
ADAPTER_RTOL = 1e-4
MOE = ("model.preset=tiny-moe", "model.moe_bias_update_rate=0.001", "model.moe_aux_loss_coef=0.1")


def _with_lora(cfg):
    def prepare(model) -> None:
        apply_lora(model, blocks_of(model.layers), cfg.lora, torch.float32, cfg.train.seed)
        moe_step.configure([model], cfg)  # under LoRA the routing is the base's: no aux loss, no bias step

    return prepare


@functools.cache
def lora_reference(corpus: Path, extra: tuple[str, ...] = (), optimizers=None):
    """The plain loop on the plain model with the same adapters: (losses, norms, final state)."""
    cfg = make_config(corpus, "ddp", *LORA, *extra)
    return reference_run(cfg, loss_fn=lambda model, batch: model(batch[:, :-1], batch[:, 1:],
                                                                   loss_chunk=cfg.train.loss_chunk),
                         prepare=_with_lora(cfg), optimizers=optimizers)


@functools.cache
def base_weights(corpus: Path, extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    cfg = make_config(corpus, "ddp", *extra)
    model = build_model(model_config(cfg, load_data(cfg)[1]), device="cpu")
    model.init_weights(cfg.train.seed)
    return model.state_dict()


def assert_lora_matches(results, corpus: Path, extra: tuple[str, ...] = (), optimizers=None) -> None:
    ref_losses, ref_norms, ref_state = lora_reference(corpus, extra, optimizers)
    base = base_weights(corpus, tuple(e for e in extra if e.startswith("model.")))
    assert ref_losses[-1] < ref_losses[0]
    held = set()
    for rank, (losses, state, _, norms) in enumerate(results):
        for got, want, what in ((losses, ref_losses, "losses"), (norms, ref_norms, "grad norms")):
            rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            assert len(got) == STEPS and rel < RTOL, f"rank {rank} {what} {got} vs {want}"
        held |= state.keys()  # a pipeline stage holds its own layers
        for name, got in state.items():
            if is_adapter(name):
                err = (got - ref_state[name]).norm() / ref_state[name].norm().clamp(min=1e-12)
                assert err < ADAPTER_RTOL, f"rank {rank} {name}: relative error {err:.2e}"
            elif name in base:  # frozen: bit-identical to the base (buffers such as expert_bias aside)
                assert torch.equal(got, base[name]), f"rank {rank}: the frozen {name} changed"
        moved = [n for n in state if n.endswith("lora_B") and state[n].abs().max() > 0]
        assert moved, "no adapter trained"
    assert held == ref_state.keys()


def adapter_bytes(corpus: Path, extra: tuple[str, ...] = ()) -> int:
    _, _, state = lora_reference(corpus, extra)
    return sum(v.numel() * 4 for k, v in state.items() if is_adapter(k))


CASES = [("ddp", 2, ()), ("zero1", 2, ()), ("zero2", 2, (UNITS,)),
         ("zero3", 2, (UNITS, "parallel.activation_checkpointing=full")), ("hsdp", 4, (*HSDP, UNITS)),
         ("zero2", 4, ("parallel.tp=2", "parallel.sequence_parallel=true")),
         ("ddp", 2, ("parallel.pp=2",)), ("zero3", 2, ("parallel.cp=2", UNITS))]
IDS = ["ddp", "zero1", "zero2-units", "zero3-units-ac", "hsdp", "zero2-tp2-sp", "pp2", "cp2-zero3"]


def planned_states(cfg, strategy: str, world: int, preset: str = "tiny") -> list[float]:
    """The planner's LoRA model states per rank (plan/memory.lora_states: the base in its dtype, the
    adapters at 16 bytes, each as the strategy shards it), by pipeline stage."""
    p = cfg.parallel
    dp = world // (p.tp * p.pp * p.cp)
    replicate = dp if strategy in ("ddp", "zero1") else p.dp_replicate
    c = config_candidate(cfg, replicate, dp // replicate, p.tp, p.pp)
    w = config_workload(cfg, from_preset(preset))
    by_stage = [sum(s.total for s in lora_states(w, c, stage) if s is not None) for stage in range(p.pp)]
    return [by_stage[rank // (world // p.pp)] for rank in range(world)]


@pytest.mark.parametrize("strategy,world,extra", CASES, ids=IDS)
def test_lora_matches_single_process(corpus, strategy, world, extra):
    results = _run(corpus, strategy, world, (*LORA, *extra))
    assert_lora_matches(results, corpus)
    # Measured model states per rank: the planner's 2·Ψ_base (here fp32: 4) + 16·Ψ_lora, as sharded
    planned = planned_states(make_config(corpus, strategy, *LORA, *extra), strategy, world)
    for rank, m in enumerate(results[0][2]):
        assert m["model_state_bytes"] == pytest.approx(planned[rank], rel=0.01), (rank, m, planned)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_gradient_collectives_carry_the_adapters_alone(corpus, strategy):
    """A step's gradient payload is the adapters' fp32 size: DDP all-reduces it once (+ the loss's
    4 bytes), FSDP2 reduce-scatters it on each micro-step (frozen weights have no gradient)."""
    results = _run(corpus, strategy, 2, (*LORA, *CASES[IDS.index("zero3-units-ac")][2]) if strategy == "zero3"
                   else LORA)  # the runs of the cases above (checkpointing recomputes no collective)
    size = adapter_bytes(corpus)
    for rank, m in enumerate(results[0][2]):
        kinds = m["comm_by_kind"]
        if strategy == "ddp":
            assert kinds["all_reduce"]["payload_bytes"] == size + 4, (rank, kinds)
        else:
            assert kinds["reduce_scatter"]["payload_bytes"] == size * ACCUM, (rank, kinds)


@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_bf16_with_the_base_in_bf16_is_close_to_fp32(corpus, strategy):
    """train.precision = bf16 freezes the base in bf16 (lora.base_dtype auto: 2 bytes per weight):
    FSDP2 computes in its param dtype, DDP under autocast; the adapters stay fp32 and train."""
    results = _run(corpus, strategy, 2, (*LORA, "train.precision=bf16"))
    ref_losses = lora_reference(corpus)[0]
    for losses, state, memory, _ in results:
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 2e-2, (losses, ref_losses)
        assert all(v.dtype == (torch.float32 if is_adapter(k) else torch.bfloat16) for k, v in state.items()
                   if v.is_floating_point()), {k: v.dtype for k, v in state.items()}


def test_moe_experts_adapted_under_ep(corpus):
    """The experts' stacked projections get per-expert adapters, split over ep with their experts;
    the router is frozen and balancing off (the base's routing)."""
    extra = (*MOE, "train.lr=3e-3")
    results = _run(corpus, "zero3", 2, (*LORA, *extra, "parallel.ep=2", UNITS))
    assert any("experts.w1_lora_A" in k for k in results[0][1])
    assert_lora_matches(results, corpus, extra)
    planned = planned_states(make_config(corpus, "zero3", *LORA, *extra, "parallel.ep=2", UNITS), "zero3", 2,
                             "tiny-moe")
    for rank, m in enumerate(results[0][2]):
        assert m["model_state_bytes"] == pytest.approx(planned[rank], rel=0.01), (rank, m, planned)
