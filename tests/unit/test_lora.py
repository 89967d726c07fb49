"""LoRA's pieces on one process: the adapted linear and experts against their closed forms, which
linears the targets name, the frozen base's dtype and flags, the adapters' initialization from
(seed, name) alone, the base's fingerprint, the PEFT names; the config reader of lora.targets
under any input (Hypothesis)."""

from __future__ import annotations

import math
import shutil

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from loom.config import Config, load_config, load_config_text, to_toml, validate
from loom.errors import ConfigError, LoomError
from loom.models.gpt.config import preset
from loom.models.gpt.llama_layout import to_halves
from loom.models.gpt.model import build_model
from loom.models.lora import (
    LoRALinear,
    LoRASpec,
    WithAdapters,
    adapter_value,
    add_lora,
    apply_lora,
    blocks_of,
    freeze_base,
    is_adapter,
    merged,
)
from loom.parallel.weights import block
from loom.train import lora_base
from loom.train.export_lora import _owner


def _gpt(name: str = "tiny", **changes) -> nn.Module:
    model = build_model(preset(name, **changes), device="cpu")
    model.init_weights(0)
    return model


def _lora(rank: int = 4, alpha: float = 8.0, targets=("all-linear",), dropout: float = 0.0, **flags):
    cfg = load_config(None, [f"lora.rank={rank}", f"lora.alpha={alpha}", f"lora.dropout={dropout}"])
    cfg.lora.targets = list(targets)
    for k, v in flags.items():
        setattr(cfg.lora, k, v)
    return cfg.lora


def test_adapted_linear_is_the_base_plus_the_scaled_low_rank_update():
    torch.manual_seed(0)
    linear = nn.Linear(8, 6, bias=False)
    x = torch.randn(3, 8)
    base = linear(x)
    holder = nn.Sequential()
    holder.add_module("wq", linear)
    add_lora(holder, [holder], LoRASpec(2, 6.0), ["q"])
    assert isinstance(linear, LoRALinear) and linear.lora_A.shape == (2, 8) and linear.lora_B.shape == (6, 2)
    with torch.no_grad():
        linear.lora_A.normal_()
        linear.lora_B.zero_()
        assert torch.equal(linear(x), base)  # B = 0: the base model exactly
        linear.lora_B.normal_()
    want = base + 3.0 * x @ linear.lora_A.T @ linear.lora_B.T  # alpha / r = 3
    torch.testing.assert_close(linear(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(merged(linear.weight, linear.lora_A, linear.lora_B, 3.0),
                               linear.weight + 3.0 * linear.lora_B @ linear.lora_A)
    # dropout acts on the adapters' input in training only
    linear.lora_dropout = 0.5
    assert not torch.allclose(linear.train()(x), want)
    torch.testing.assert_close(linear.eval()(x), want, rtol=1e-6, atol=1e-6)


def test_the_update_joins_the_base_output_inside_its_matmul():
    """The adapter's second matmul adds into the base output (addmm, the scale as its alpha): no
    separate add or scale over a [tokens, out] tensor, and the same gradients as the closed form."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    holder = nn.Sequential()
    holder.add_module("wq", nn.Linear(8, 6, bias=False))
    add_lora(holder, [holder], LoRASpec(2, 6.0), ["q"])
    linear = holder.wq
    with torch.no_grad():  # (add_lora leaves A and B uninitialized: a run's init_weights fills them)
        linear.lora_A.normal_()
        linear.lora_B.normal_()
    x = torch.randn(2, 3, 8, requires_grad=True)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
            ops.append((func.__name__.split(".")[0], shape))
            return out

    with Ops():
        out = linear(x)
    wide = [o for o in ops if o[0] in ("add", "mul") and o[1][-1:] == (6,)]  # over [tokens, out]
    assert ("addmm", (6, 6)) in ops and not wide, ops
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    a, b = (q.detach().clone().requires_grad_() for q in (linear.lora_A, linear.lora_B))
    (F.linear(xr, linear.weight) + 3.0 * xr @ a.T @ b.T).sum().backward()
    for got, want in ((x.grad, xr.grad), (linear.lora_A.grad, a.grad), (linear.lora_B.grad, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("targets, leaves", [
    (["q", "v"], {"wq", "wv"}),
    (["all-linear"], {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}),
    (["down", "*.attention.wo"], {"w2", "wo"}),
    (["layers.1.attention.wq"], {"wq"}),
])
def test_targets_name_the_block_linears(targets, leaves):
    model = build_model(preset("tiny"), "meta")
    adapted = add_lora(model, blocks_of(model.layers), LoRASpec(4, 8.0), targets)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == leaves
    if targets == ["layers.1.attention.wq"]:
        assert adapted == ["layers.1.attention.wq"]
    assert not any(n.startswith(("output", "tok_embeddings")) for n in adapted)


def test_all_linear_on_moe_adapts_experts_and_shared_but_not_routers():
    model = build_model(preset("tiny-moe", moe_shared_gate=True), "meta")
    adapted = add_lora(model, blocks_of(model.layers), LoRASpec(4, 8.0), ["all-linear"])
    assert not any(n.endswith(("router", "shared_gate")) for n in adapted)
    experts = model.layers[0].feed_forward.experts
    assert experts.w1_lora_A.shape == (8, 4, 64) and experts.w2_lora_B.shape == (8, 64, 4)
    assert any(n.endswith("shared.w2") for n in adapted)
    # "up" alone adapts each expert's w3 only
    model = build_model(preset("tiny-moe"), "meta")
    add_lora(model, blocks_of(model.layers), LoRASpec(4, 8.0), ["up"])
    assert model.layers[0].feed_forward.experts.lora_weights == ("w3",)


def test_adapted_experts_equal_each_expert_as_an_adapted_swiglu():
    torch.manual_seed(0)
    model = _gpt("tiny-moe")
    apply_lora(model, blocks_of(model.layers), _lora(), torch.float32, 0)
    experts = model.layers[0].feed_forward.experts
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    rows, counts = torch.randn(10, 64), [3, 0, 2, 1, 0, 4, 0, 0]
    out = experts(rows, counts)
    s = 2.0
    parts = []
    for e, part in enumerate(rows.split(counts)):
        def lin(x, w, e=e):
            return F.linear(x, getattr(experts, w)[e]) + s * x @ getattr(experts, f"{w}_lora_A")[e].T \
                @ getattr(experts, f"{w}_lora_B")[e].T
        parts.append(lin(F.silu(lin(part, "w1")) * lin(part, "w3"), "w2"))
    torch.testing.assert_close(out, torch.cat(parts), rtol=1e-5, atol=1e-6)


def test_the_base_is_frozen_in_its_dtype_and_only_adapters_train():
    model = _gpt("tiny", tie_embeddings=True)
    apply_lora(model, blocks_of(model.layers), _lora(targets=["q"]), torch.bfloat16, 0)
    for name, p in model.named_parameters():
        assert p.requires_grad == is_adapter(name), name
        assert p.dtype == (torch.float32 if is_adapter(name) else torch.bfloat16), name
    assert model.output.weight is model.tok_embeddings.weight  # a tied weight stays one parameter
    model = _gpt()
    both = _lora(train_norms=True, train_embeddings=True)
    apply_lora(model, blocks_of(model.layers), both, torch.bfloat16, 0)
    trains = {n for n, p in model.named_parameters() if p.requires_grad and not is_adapter(n)}
    assert trains == {"tok_embeddings.weight", "output.weight", "norm.weight",
                      *(f"layers.{i}.{n}.weight" for i in range(2) for n in ("attention_norm", "ffn_norm"))}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)


def test_step_zero_equals_the_base_and_the_gradient_reaches_only_adapters():
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model = _gpt()
    base_logits = model(tokens)
    apply_lora(model, blocks_of(model.layers), _lora(), torch.float32, 0)
    logits = model(tokens)
    assert torch.equal(logits, base_logits)
    logits.square().mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == is_adapter(name), name
    # B = 0 at the start: A's gradient is zero, B's is not (the paper's init)
    assert model.layers[0].attention.wq.lora_A.grad.abs().max() == 0
    assert model.layers[0].attention.wq.lora_B.grad.abs().max() > 0


def test_adapter_init_comes_from_seed_and_name_alone():
    a = adapter_value(3, "layers.0.attention.wq.lora_A", (4, 64))
    assert torch.equal(a, adapter_value(3, "layers.0.attention.wq._orig_mod.lora_A".replace("._orig_mod", ""),
                                        (4, 64)))
    assert not torch.equal(a, adapter_value(4, "layers.0.attention.wq.lora_A", (4, 64)))
    assert a.abs().max() <= 1 / math.sqrt(64) and a.std() > 0.5 / math.sqrt(3 * 64)  # U(±1/√in)
    assert torch.equal(adapter_value(3, "x.lora_B", (64, 4)), torch.zeros(64, 4))
    # a rank's block (a TP or FSDP shard, or its experts under ep) is the whole value's block
    source = WithAdapters(None, 3)
    stacked = source.read("experts.w1_lora_A", (8, 4, 64), (2, 0, 16), (3, 4, 16))
    whole = adapter_value(3, "experts.w1_lora_A", (8, 4, 64))
    assert torch.equal(stacked, block(whole, (2, 0, 16), (3, 4, 16)))
    assert torch.equal(whole[5], adapter_value(3, "experts.w1_lora_A.5", (4, 64)))


def test_the_fingerprint_tells_bases_apart_and_follows_moved_files(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.arange(1000.0)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    first = lora_base.fingerprint(folder)
    shutil.copytree(folder, tmp_path / "moved")
    assert lora_base.fingerprint(tmp_path / "moved") == first
    lora_base.check({"path": str(folder), "fingerprint": first},
                    {"path": str(tmp_path / "moved"), "fingerprint": first}, tmp_path)
    changed = {"w": torch.arange(1000.0) + 1}
    safetensors.torch.save_file(changed, str(tmp_path / "moved" / "model.safetensors"))
    other = lora_base.fingerprint(tmp_path / "moved")
    assert other != first
    with pytest.raises(LoomError, match="trained on the base .* this run's base is"):
        lora_base.check({"path": str(folder), "fingerprint": first},
                        {"path": str(tmp_path / "moved"), "fingerprint": other}, tmp_path)


def test_peft_names_and_the_q_rows_follow_the_weights():
    assert _owner("layers.0.attention.wq.lora_A") == ("layers.0.attention.wq.weight", "lora_A")
    assert _owner("layers.1.feed_forward.experts.w2_lora_B") == ("layers.1.feed_forward.experts.w2", "lora_B")
    # Llama's rotate-half row order applied to B alone reorders the merged update the same way
    b, a = torch.randn(16, 4), torch.randn(4, 8)
    torch.testing.assert_close(to_halves(b @ a, 2, 8), to_halves(b, 2, 8) @ a)


def test_lora_section_round_trips_through_toml():
    cfg = load_config(None, ["lora.rank=8", "lora.alpha=16", 'lora.targets=["q", "v"]',
                             "lora.train_norms=true"])
    assert load_config_text(to_toml(cfg)) == cfg
    assert load_config_text(to_toml(Config())).lora.rank is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(["q", "k", "v", "o", "gate", "up", "down", "all-linear", "*.wq",
                                           "layers.*", "router", "w1"]),
                          st.text(min_size=0, max_size=12)), min_size=0, max_size=4))
def test_any_targets_adapt_something_or_say_why_in_one_line(targets):
    """lora.targets from the command line: a valid config adapts at least one linear per entry, or
    validation / the model check refuses it in one line."""
    try:
        cfg = load_config(None, ["lora.rank=4", f"lora.targets={targets!r}".replace("'", '"')])
        validate(cfg, 1)
        model = build_model(preset("tiny"), "meta")
        adapted = add_lora(model, blocks_of(model.layers), LoRASpec(4, 8.0), cfg.lora.targets)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert adapted and targets


def test_base_dtype_bf16_with_bf16_precision_freezes_in_bf16():
    cfg = load_config(None, ["lora.rank=4", "train.precision=bf16"])
    validate(cfg, 1)
    from loom.config import lora_base_dtype

    assert lora_base_dtype(cfg) == "bf16"
    assert lora_base_dtype(load_config(None, ["lora.rank=4"])) == "fp32"
    freeze_base(_gpt(), torch.bfloat16, False, False)  # runs on a built model too


@pytest.mark.parametrize("rank, targets, refused", [
    (48, ["all-linear"], False),  # above k's and v's rank (32), not q's (64): taken for those that use it
    (64, ["q"], False),
    (65, ["all-linear"], True),
    (33, ["k", "v"], True),
    (40, ["gate"], True),  # tiny-moe's experts: [8, 32, 64]
])
def test_a_rank_above_every_adapted_matrix_is_refused(rank, targets, refused):
    model = build_model(preset("tiny-moe" if targets == ["gate"] else "tiny"), "meta")
    if not refused:
        assert add_lora(model, blocks_of(model.layers), LoRASpec(rank, 8.0), targets)
        return
    with pytest.raises(ConfigError, match=rf"^lora.rank = {rank} is above the rank of every matrix"):
        add_lora(model, blocks_of(model.layers), LoRASpec(rank, 8.0), targets)
