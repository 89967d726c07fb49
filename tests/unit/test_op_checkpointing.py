"""Op-level selective activation checkpointing (parallel.activation_checkpointing = "op"): the same
numbers as no checkpointing, exactly the policy's tensors kept, and the planner's count of them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loom.config import load_config, validate
from loom.errors import ConfigError
from loom.models.gpt.config import preset
from loom.models.gpt.model import Block, build_model, rope_tables
from loom.parallel.activation_checkpointing import apply_activation_checkpointing
from loom.plan.candidate import Candidate, Workload
from loom.plan.command import local_cluster
from loom.plan.device import (
    ATTENTION_HEAD_DIMS,
    ATTENTION_SEQS,
    ELEMENTWISE_SIZES,
    LINEAR_ROWS,
    LINEAR_SIZES,
    DeviceProfile,
)
from loom.plan.explain import explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import Plan, estimate
from loom.plan.shapes import (
    activation_bytes_per_layer,
    from_gpt_config,
    from_preset,
    op_saved_bytes_per_layer,
    op_shared_bytes_per_layer,
    residual_bytes,
)


class LiveStorages(TorchDispatchMode):
    """Every storage an op under the mode creates; `alive` those still referenced (by autograd's
    saved tensors or the selective checkpoint's cache) once forward has returned."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[StorageWeakRef, int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default:  # the checkpoint's own (caching), not the block's
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.created.append((StorageWeakRef(s), s.data_ptr(), s.nbytes(), str(func)))
        return out

    def alive(self, exclude: list[torch.Tensor]) -> dict[str, int]:
        """{the op that created it, and which call of that op: bytes} (the block's ops come in the same
        order in every mode's forward; the checkpoint may add its own, as torch 2.11's does)."""
        outside = {t.untyped_storage().data_ptr() for t in exclude}
        kept: dict[int, tuple[str, int]] = {}
        calls: dict[str, int] = {}
        for ref, ptr, n, func in self.created:
            calls[func] = calls.get(func, 0) + 1
            if not ref.expired() and ptr not in outside:
                kept.setdefault(ptr, (f"{func}#{calls[func]}", n))
        return dict(kept.values())


def _block(mode: str, dtype: torch.dtype, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    layers = nn.ModuleList([Block(preset("tiny")).to(dtype)])
    apply_activation_checkpointing(layers, mode)
    return layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_keeps_exactly_the_planned_matmul_and_attention_outputs(dtype):
    cfg, (b, t) = preset("tiny"), (2, 64)
    e = torch.finfo(dtype).bits // 8
    shape = from_gpt_config(cfg, "tiny")
    kept = {}
    for mode in ("none", "op", "full"):
        layers = _block(mode, dtype)
        x = torch.randn(b, t, cfg.d_model, dtype=dtype, requires_grad=True)
        rope = rope_tables(cfg.head_dim, t, cfg.rope_theta).to(dtype)
        live = LiveStorages()
        with live:
            y = layers[0](x, rope)
        # (torch 2.11 also keeps an empty tensor: no bytes, not counted)
        kept[mode] = {op: n for op, n in live.alive([y, rope, *layers.parameters()]).items() if n}
        y.sum().backward()  # the kept tensors are backward's: it runs
    # seven matmuls (wq, wk, wv, wo, w1, w3, w2), attention's output and its log-sum-exp
    assert len(kept["op"]) == 9 and kept["full"] == {}
    planned = op_saved_bytes_per_layer(shape, t, b, e) - residual_bytes(shape, t, b, e)  # x: outside
    assert sum(kept["op"].values()) == pytest.approx(planned, rel=1e-3)
    # what a plain block keeps as well: gate, up, attention's output and log-sum-exp
    shared = sum(n for op, n in kept["op"].items() if op in kept["none"])
    assert shared == pytest.approx(op_shared_bytes_per_layer(shape, t, b, e), rel=1e-3)


def test_op_saved_bytes_split_by_tp_and_sequence_parallel():
    shape = from_gpt_config(preset("small"), "small")
    s, b, h, f, kv = 256, 2, shape.d_model, shape.ffn_hidden, shape.kv_dim
    whole = op_saved_bytes_per_layer(shape, s, b, 2)
    assert whole == s * b * (2 * (4 * h + 2 * kv + 2 * f) + 4 * shape.n_heads) + s * b * h * 2
    rows, block_input = 2 * s * b * h * 2, s * b * h * 2
    tp2 = op_saved_bytes_per_layer(shape, s, b, 2, tp=2)
    assert tp2 == (whole - rows - block_input) / 2 + rows + block_input
    assert op_saved_bytes_per_layer(shape, s, b, 2, tp=2, sequence_parallel=True) == tp2 - block_input / 2
    # autocast: the residual stream (the block's input) stays fp32
    assert op_saved_bytes_per_layer(shape, s, b, 2, autocast=True) == whole + block_input
    # "op" keeps less than a plain block of the small preset in 16-bit, more than "full"
    assert residual_bytes(shape, s, b, 2) < whole < activation_bytes_per_layer(shape, s, b, 2) + block_input


@pytest.mark.parametrize("tied", [False, True])
def test_op_same_loss_and_gradients_as_no_checkpointing(tied):
    cfg = preset("tiny", tie_embeddings=tied)
    plain = build_model(cfg, device="cpu")
    plain.init_weights(0)
    op = copy.deepcopy(plain)
    assert apply_activation_checkpointing(op.layers, "op", every=2) == cfg.n_layers  # ac_every: selective's
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, op):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for p, q in zip(plain.parameters(), op.parameters(), strict=True):  # wrapping keeps the order
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-6)


def test_op_is_a_valid_mode_and_a_bad_one_names_it():
    validate(load_config(None, ["parallel.activation_checkpointing=op"]), 2, cuda_available=False)
    with pytest.raises(ConfigError, match="none, full, selective, op"):
        validate(load_config(None, ["parallel.activation_checkpointing=ops"]), 2, cuda_available=False)


@pytest.fixture(scope="module")
def plan_8b_op():
    """An 8B plan's zero3 × tp2 + SP candidate under none, full and op (the search ranks none and
    full; op is priced here by search.estimate, as `loom plan --explain` reads it)."""
    w, cluster = Workload(from_preset("8b"), 8192, 128), Cluster(lookup("H100-SXM"))
    base = dict(tp=2, sequence_parallel=True, micro_batch=1, grad_accum=4)
    records = [estimate(w, Candidate("zero3", 32, **base, activation_checkpointing=ac), cluster)
               for ac in ("none", "full", "op")]
    return Plan(w, cluster, records, None, "")


def test_op_is_priced_between_full_and_none(plan_8b_op):
    none, full, op = plan_8b_op.candidates
    acts = [r["memory_bytes"]["activations"] for r in (none, full, op)]
    assert acts[1] < acts[2] < acts[0]
    recompute = [r["step_time_breakdown_s"]["recompute"] for r in (none, full, op)]
    assert recompute[0] == 0 < recompute[2] < recompute[1] / 2  # the elementwise part only
    # the recompute's TP collectives: one more reduction per block, as full's
    assert op["comm_bytes_per_step"] == pytest.approx(full["comm_bytes_per_step"])


def test_op_explain_adds_up(plan_8b_op):
    from test_plan_explain import assert_adds_up

    text = explain(plan_8b_op, 2)
    for item in ("kept outputs (op)", "elementwise work again", "all L_s blocks"):
        assert item in text, item
    assert_adds_up(text, plan_8b_op.candidates[2])


def test_op_on_a_measured_device_recomputes_the_elementwise_part():
    """The measured branch (`loom plan --calibrate`'s rates): op reruns the block's elementwise
    work only, and --explain's lines add up to the record."""
    from test_plan_explain import assert_adds_up

    rates = {"linear_flops": {f"{r}x{s}": 1e9 * (1 + r * s / 1e6) for r in LINEAR_ROWS for s in LINEAR_SIZES},
             "attention_flops": {f"{q}x{d}": 5e8 * (1 + q * d / 1e5) for q in ATTENTION_SEQS
                                 for d in ATTENTION_HEAD_DIMS},
             "elementwise_bytes": {str(s): 1e10 / (1 + s / 1e8) for s in ELEMENTWISE_SIZES},
             "block_elementwise_bytes": {str(s): 5e9 / (1 + s / 1e8) for s in ELEMENTWISE_SIZES},
             "op_overhead_s": 5e-6,
             "collectives": {k: {"alpha_s": 1e-4, "bytes_per_s": 2e9, "points": []}
                             for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")}}
    profile = DeviceProfile("cpu", "test", 16, 64 * 2**30, "2", "2026-01-01", {"1": rates, "2": rates})
    w, cluster = Workload(from_preset("small"), 256, 16, "fp32"), local_cluster(profile, 2)
    records = [estimate(w, Candidate("zero3", 2, activation_checkpointing=ac), cluster)
               for ac in ("none", "full", "op")]
    recompute = [r["step_time_breakdown_s"]["recompute"] for r in records]
    assert recompute[0] == 0 < recompute[2] < recompute[1] / 2
    text = explain(Plan(w, cluster, records, None, ""), 2)
    assert "elementwise × in-situ/3" in text
    assert_adds_up(text, records[2])
