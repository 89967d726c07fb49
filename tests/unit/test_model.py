"""loom.models.gpt: shapes, parameter counts, causality, deterministic layout-independent init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.errors import ConfigError
from loom.launch import free_port
from loom.models.gpt.config import PRESETS, GPTConfig, preset, validate
from loom.models.gpt.model import GPT, build_model


def _tiny_model(seed: int = 0, **overrides: object) -> GPT:
    model = build_model(preset("tiny", **overrides), device="cpu")
    model.init_weights(seed)
    return model


def _tokens(cfg: GPTConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _state(model: GPT) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_num_params_matches_model(tied: bool) -> None:
    cfg = preset("tiny", tie_embeddings=tied)
    model = build_model(cfg, device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == counted
    assert counted < 1_000_000
    # Tying removes exactly one vocab x d_model matrix.
    untied = preset("tiny", tie_embeddings=False).num_params()
    assert untied - preset("tiny", tie_embeddings=True).num_params() == cfg.vocab_size * cfg.d_model


def test_small_preset_counts() -> None:
    cfg = preset("small")
    model = build_model(cfg, device="meta")
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert 1e6 < cfg.num_params() < 10e6


@pytest.mark.parametrize(("name", "expected", "tol"),
                         [("70b", 70.6e9, 0.02), ("8b", 8.03e9, 0.02), ("1b", 1.24e9, 0.03)])
def test_big_presets_num_params(name: str, expected: float, tol: float) -> None:
    assert abs(PRESETS[name].num_params() - expected) / expected < tol


def test_125m_preset_size() -> None:
    assert abs(PRESETS["125m"].num_params() - 125e6) / 125e6 < 0.05


def test_all_presets_validate() -> None:
    for cfg in PRESETS.values():
        validate(cfg)


def test_output_shape() -> None:
    model = _tiny_model()
    tokens = _tokens(model.cfg, batch=3, seq=20)
    assert model(tokens).shape == (3, 20, model.cfg.vocab_size)
    full = _tokens(model.cfg, batch=1, seq=model.cfg.max_seq_len)
    assert model(full).shape == (1, model.cfg.max_seq_len, model.cfg.vocab_size)


def test_too_long_sequence_raises() -> None:
    model = _tiny_model()
    with pytest.raises(ConfigError, match="max_seq_len"):
        model(_tokens(model.cfg, batch=1, seq=model.cfg.max_seq_len + 1))


def test_causal() -> None:
    model = _tiny_model()
    tokens = _tokens(model.cfg, batch=1, seq=16)
    t = 7
    changed = tokens.clone()
    changed[0, t + 1] = (changed[0, t + 1] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_init_same_seed_identical_different_seed_differs() -> None:
    a, b, c = _state(_tiny_model(1)), _state(_tiny_model(1)), _state(_tiny_model(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))


def test_init_stds() -> None:
    model = build_model(preset("small"), device="cpu")
    model.init_weights(0)
    residual = 0.02 / (2 * model.cfg.n_layers) ** 0.5
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(residual, rel=0.02)
    assert model.layers[1].attention.wo.weight.std().item() == pytest.approx(residual, rel=0.02)


def test_meta_to_empty_matches_cpu() -> None:
    cfg = preset("tiny")
    ref = build_model(cfg, device="cpu")
    ref.init_weights(3)
    meta = build_model(cfg, device="meta")
    assert meta.rope.is_meta
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    ref_state, meta_state = _state(ref), _state(meta)
    assert ref_state.keys() == meta_state.keys()
    assert all(torch.equal(ref_state[k], meta_state[k]) for k in ref_state)
    assert torch.equal(ref.rope, meta.rope)
    tokens = _tokens(cfg)
    with torch.no_grad():
        assert torch.equal(ref(tokens), meta(tokens))


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_offload_keeps_buffers_on_the_compute_device(name) -> None:
    """Under CPU offload the parameters live in host memory (FSDP2 copies each unit in), but forward
    reads the buffers (RoPE tables, MoE routing biases) as they are: they belong on the compute
    device, else a GPU's first step mixes cuda and cpu tensors. The meta device stands in for a GPU."""
    from loom.parallel.apply import materialize

    model = build_model(preset(name), device="meta")
    materialize(model, torch.device("meta"), offload=True)
    model.init_weights(3)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    buffers = dict(model.named_buffers())
    assert "rope" in buffers and (name == "tiny" or any(k.endswith("expert_bias") for k in buffers))
    assert {n: b.device.type for n, b in buffers.items()} == {n: "meta" for n in buffers}
    materialize(model := build_model(preset(name), device="meta"), torch.device("meta"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_tied_embeddings() -> None:
    model = _tiny_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model(_tokens(model.cfg)).shape[-1] == model.cfg.vocab_size
    untied = _tiny_model(tie_embeddings=False)
    assert model.output.weight is not untied.tok_embeddings.weight


def test_init_ignores_wrapper_name_segments() -> None:
    from loom.parallel.weights import plain_name as _plain_name

    assert (_plain_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
            == "layers.0.attention.wq.weight")
    assert _plain_name("layers.1._orig_mod.feed_forward.w2.weight") == "layers.1.feed_forward.w2.weight"




def test_init_dtensor_layout_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        cfg = preset("tiny")
        plain = build_model(cfg, device="cpu")
        plain.init_weights(5)

        sharded = build_model(cfg, device="cpu")
        for module in sharded.modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
                module.register_parameter(pname, torch.nn.Parameter(dt))
        sharded.init_weights(5)

        plain_params = dict(plain.named_parameters())
        for name, p in sharded.named_parameters():
            assert isinstance(p, DTensor)
            assert torch.equal(p.full_tensor(), plain_params[name]), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_gqa_variants_run(n_kv_heads: int) -> None:
    model = _tiny_model(n_kv_heads=n_kv_heads)
    assert model.layers[0].attention.wk.weight.shape == (n_kv_heads * model.cfg.head_dim, model.cfg.d_model)
    out = model(_tokens(model.cfg))
    assert out.shape == (2, 16, model.cfg.vocab_size)
    assert torch.isfinite(out).all()


def test_gqa_equals_mha_with_repeated_kv() -> None:
    # A GQA model is an MHA model whose k/v projections repeat each kv head n_heads/n_kv_heads times.
    gqa = _tiny_model(n_kv_heads=2)
    mha = build_model(preset("tiny", n_kv_heads=4), device="cpu")
    hd, rep = gqa.cfg.head_dim, gqa.cfg.n_heads // gqa.cfg.n_kv_heads
    state = _state(gqa)
    for key in list(state):
        if key.endswith(("wk.weight", "wv.weight")):
            state[key] = (state[key].view(-1, hd, gqa.cfg.d_model).repeat_interleave(rep, dim=0)
                          .reshape(-1, gqa.cfg.d_model))
    mha.load_state_dict(state)
    tokens = _tokens(gqa.cfg)
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 66}, "divisible by model.n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "multiple of model.n_kv_heads"),
        ({"n_kv_heads": 8}, "multiple of model.n_kv_heads"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"norm_eps": -1.0}, "norm_eps must be a positive number"),
        ({"d_model": 12, "n_heads": 4}, "must be even for RoPE"),
        ({"not_a_field": 1}, "unknown model field"),
    ],
)
def test_bad_configs_raise(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        preset("tiny", **overrides)


def test_bad_config_rejected_by_model() -> None:
    with pytest.raises(ConfigError):
        GPT(GPTConfig(d_model=65))


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(ConfigError) as info:
        preset("nope")
    for name in ("tiny", "small", "125m", "1b", "8b", "70b"):
        assert name in str(info.value)


def test_preset_returns_copy() -> None:
    cfg = preset("tiny")
    cfg.d_model = 128
    assert PRESETS["tiny"].d_model == 64


def test_bf16_autocast_forward() -> None:
    model = _tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(_tokens(model.cfg))
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    model.to(torch.bfloat16)
    assert model(_tokens(model.cfg)).dtype == torch.bfloat16


def test_loss_goes_down() -> None:
    torch.manual_seed(0)
    model = _tiny_model(seed=0)
    tokens = _tokens(model.cfg, batch=4, seq=32, seed=1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Starts near ln(256) = 5.55 (uniform prediction); memorizing one batch drives it far down.
    assert losses[0] == pytest.approx(5.55, abs=0.1)
    assert losses[-1] < 1.5, losses  # measured 5.57 -> 0.53
