"""`loom export`: a (sharded) checkpoint as one safetensors file, in loom's names or as a Hugging Face
Llama whose logits equal loom's GPT's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from in_process import world_of_one
from optional import TEST_EXTRA, require_module
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from loom.cli import main
from loom.config import load_config
from loom.errors import LoomError
from loom.models.gpt.config import GPTConfig, preset
from loom.models.gpt.model import build_model
from loom.train import export as export_module
from loom.train.driver import train
from loom.train.export import export, hf_config, hf_state_dict
from loom.train.task import Task, load_data

STEPS = 2


def _config(corpus: Path, strategy: str, *extra: str):
    return load_config(None, ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=32",
                              f"train.steps={STEPS}", "train.batch_size=4", "train.eval_batches=1",
                              "data.num_workers=0", f"parallel.strategy={strategy}", "train.device=cpu",
                              *extra])


def _rank_train(cfg, run_dir: str):
    return train(cfg, Path(run_dir), quiet=True, return_state=True).state_dict


def _train_here(cfg, run_dir: Path, task: Task | None = None) -> dict[str, torch.Tensor]:
    with world_of_one():
        return train(cfg, run_dir, quiet=True, return_state=True, task=task).state_dict


@pytest.fixture(scope="module")
def zero3_run(corpus, tmp_path_factory):
    """2 ranks, ZeRO-3: every parameter is sharded in the checkpoint; untied, GQA (4 heads, 2 KV)."""
    run_dir = tmp_path_factory.mktemp("zero3")
    state = run_ranks(_rank_train, 2, _config(corpus, "zero3"), str(run_dir))[0]
    return run_dir, state


@pytest.fixture(scope="module")
def tied_run(corpus, tmp_path_factory):
    """A world of one in this process, ZeRO-3, tied embeddings."""
    run_dir = tmp_path_factory.mktemp("tied")
    return run_dir, _train_here(_config(corpus, "zero3", "model.tie_embeddings=true"), run_dir)


class _MLPLM(nn.Module):
    """Not loom's GPT: an embedding, two hidden layers, a head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def _mlp_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


@pytest.fixture(scope="module")
def mlp_run(corpus, tmp_path_factory):
    from loom.data.loader import split_train_eval

    cfg = _config(corpus, "ddp")
    tokens, vocab = load_data(cfg)
    train_set, eval_set = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    task = Task(model_fn=lambda: _MLPLM(vocab), loss_fn=_mlp_loss, train_data=train_set, eval_data=eval_set,
                tokens_per_sample=cfg.data.seq_len, description="MLP LM")
    run_dir = tmp_path_factory.mktemp("mlp")
    return run_dir, _train_here(cfg, run_dir, task)


def _step_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{STEPS}"


def _assert_same(loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(state)
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


# ---------------------------------------------------------------------------------------------
# Layout "loom": the checkpoint's tensors, whole


def test_sharded_checkpoint_round_trips_exactly(zero3_run, tmp_path):
    run_dir, state = zero3_run
    out = tmp_path / "model.safetensors"
    assert export(_step_dir(run_dir), out, "loom") == [out]
    _assert_same(load_file(out), state)
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    model = json.loads(metadata.pop("loom_model"))  # what model.init_from rebuilds the model from
    assert metadata == {"format": "pt", "loom_step": str(STEPS), "loom_layout": "loom"}
    assert (model["n_layers"], model["d_model"], model["vocab_size"]) == (2, 64, 256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left behind


def test_cli_exports_a_run_directorys_latest_checkpoint(zero3_run, tmp_path, capsys):
    run_dir, state = zero3_run
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an older export")  # replaced whole, as --overwrite asks (without it: refused)
    assert main(["export", str(run_dir), str(out)]) == 2
    assert out.read_bytes() == b"an older export"
    assert main(["export", str(run_dir), str(out), "--overwrite"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _assert_same(load_file(out), state)


def test_tied_embeddings_round_trip(tied_run, tmp_path):
    run_dir, state = tied_run
    out = tmp_path / "model.safetensors"
    assert main(["export", str(_step_dir(run_dir)), str(out)]) == 0
    loaded = load_file(out)
    _assert_same(loaded, state)
    assert torch.equal(loaded["output.weight"], loaded["tok_embeddings.weight"])


def test_any_model_exports_in_its_own_names(mlp_run, tmp_path):
    run_dir, state = mlp_run
    out = tmp_path / "mlp.safetensors"
    export(run_dir, out, "loom")
    _assert_same(load_file(out), state)


ZBV = ("parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4", "parallel.microbatches=4")


@pytest.mark.parametrize("extra", [("parallel.tp=2",), ("parallel.pp=2",), ZBV],
                         ids=["zero3xtp2", "zero3xpp2", "zero3xpp2-zbv"])
def test_tensor_and_pipeline_parallel_checkpoints_export_whole(corpus, tmp_path, extra):
    """TP shards every matrix by rows or columns, PP puts each stage's layers on another rank (a V
    two stages each, the first and last on rank 0): the export is the whole model, tensor by tensor
    equal to what the ranks trained."""
    states = run_ranks(_rank_train, 2, _config(corpus, "zero3", *extra), str(tmp_path / "run"))
    trained = {}
    for state in states:  # pipeline ranks each return their stage's weights
        trained.update(state)
    n_layers = 4 if extra == ZBV else 2
    assert set(trained) == set(build_model(preset("tiny", n_layers=n_layers), "meta").state_dict())
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    _assert_same(load_file(out), trained)


def test_a_failed_write_leaves_the_previous_output(zero3_run, tmp_path, monkeypatch):
    import safetensors.torch

    run_dir, _ = zero3_run
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous")

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a fi")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export(run_dir, out, "loom", overwrite=True)
    assert out.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Layout "hf": a Hugging Face Llama with loom's logits


def _loom_logits(state: dict[str, torch.Tensor], gpt: GPTConfig, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(gpt, "cpu")
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("fixture", ["zero3_run", "tied_run"])
def test_hf_layout_gives_loom_logits(fixture, request, tmp_path):
    transformers = require_module("transformers", TEST_EXTRA)
    run_dir, state = request.getfixturevalue(fixture)
    tied = fixture == "tied_run"
    out = tmp_path / "model.safetensors"
    assert main(["export", str(_step_dir(run_dir)), str(out), "--layout", "hf"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tied
    assert config["vocab_size"] == state["tok_embeddings.weight"].shape[0]
    assert ("lm_head.weight" in load_file(out)) is not tied

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    gpt = preset("tiny", tie_embeddings=tied)
    tokens = torch.randint(0, gpt.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    torch.testing.assert_close(hf_logits, _loom_logits(state, gpt, tokens), atol=1e-5, rtol=0)


def test_hf_conversion_keeps_rope_theta_and_grouped_heads():
    """Beyond the trained presets: RoPE θ 500000 over 64 positions, 4 query heads sharing 1 KV head."""
    transformers = require_module("transformers", TEST_EXTRA)
    gpt = GPTConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_hidden=96,
                    max_seq_len=64, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True)
    model = build_model(gpt, "cpu")
    model.init_weights(seed=5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = hf_config(gpt)
    assert (config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6
            and config["tie_word_embeddings"])
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(state, gpt), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: lm_head is the embedding
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, gpt.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    torch.testing.assert_close(hf_logits, _loom_logits(state, gpt, tokens), atol=1e-5, rtol=0)


def test_hf_layout_exports_a_lost_tie_as_the_untied_model_that_was_trained(tied_run):
    """Configured tied but holding two different matrices: lm_head is written, the config untied."""
    transformers = require_module("transformers", TEST_EXTRA)
    from loom.train.checkpoint import read_meta

    run_dir, state = tied_run
    step = _step_dir(run_dir)
    tensors = dict(state, **{"output.weight": state["output.weight"] + 0.01})
    gpt = export_module.gpt_config(read_meta(step), {k: tuple(v.shape) for k, v in tensors.items()}, step)
    gpt = export_module.untie_if_trained_apart(gpt, tensors)
    assert gpt == preset("tiny", tie_embeddings=False)
    hf_tensors = hf_state_dict(tensors, gpt)
    assert torch.equal(hf_tensors["lm_head.weight"], tensors["output.weight"])
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(hf_config(gpt))).eval()
    hf.load_state_dict(hf_tensors, strict=True)
    tokens = torch.randint(0, gpt.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    torch.testing.assert_close(hf_logits, _loom_logits(tensors, gpt, tokens), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Errors: one line, what is wrong and how to fix it


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_missing_checkpoint(tmp_path):
    with pytest.raises(LoomError) as e:
        export(tmp_path / "nope" / "step_5", tmp_path / "m.safetensors", "loom")
    assert "does not exist; pass RUN_DIR/checkpoints/step_N" in _one_line(e)


def test_unfinished_checkpoint(zero3_run, tmp_path):
    run_dir, _ = zero3_run
    unfinished = tmp_path / "checkpoints" / f".tmp-step_{STEPS}"
    shutil.copytree(_step_dir(run_dir), unfinished)
    with pytest.raises(LoomError) as e:
        export(unfinished, tmp_path / "m.safetensors", "loom")
    assert "is an unfinished checkpoint" in _one_line(e)


def test_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(LoomError) as e:
        export(tmp_path / "step_3", tmp_path / "m.safetensors", "loom")
    assert "is not a complete loom checkpoint (no meta.json or .metadata)" in _one_line(e)


def test_run_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(LoomError) as e:
        export(tmp_path / "run", tmp_path / "m.safetensors", "loom")
    assert "has no complete checkpoint yet" in _one_line(e)


def test_output_folder_missing(zero3_run, tmp_path, capsys):
    run_dir, _ = zero3_run
    out = tmp_path / "exports" / "model.safetensors"
    with pytest.raises(LoomError) as e:
        export(run_dir, out, "loom")
    assert f"its folder {out.parent} does not exist; create it (mkdir -p {out.parent})" in _one_line(e)
    assert main(["export", str(run_dir), str(out)]) == 2  # the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("loom: error: cannot write") and err.count("\n") == 1


def test_output_is_a_folder(zero3_run, tmp_path):
    run_dir, _ = zero3_run
    with pytest.raises(LoomError) as e:
        export(run_dir, tmp_path, "loom")
    assert "is a folder; pass a file path such as" in _one_line(e)


def test_hf_layout_refuses_a_model_other_than_loom_gpt(mlp_run, tmp_path):
    run_dir, _ = mlp_run
    with pytest.raises(LoomError) as e:
        export(run_dir, tmp_path / "model.safetensors", "hf")
    assert "holds a model other than loom's GPT" in _one_line(e) and "--layout loom" in str(e.value)
    assert not list(tmp_path.iterdir())


def test_hf_layout_refuses_tensors_its_config_does_not_describe(zero3_run, tmp_path):
    """A checkpoint whose meta.json config no longer matches its tensors (edited, or another preset)."""
    run_dir, _ = zero3_run
    step = tmp_path / "checkpoints" / f"step_{STEPS}"
    shutil.copytree(_step_dir(run_dir), step)
    meta = json.loads((step / "meta.json").read_text())
    meta["config"] = meta["config"].replace('preset = "tiny"', 'preset = "small"')
    meta["model_config"]["gpt"] = dataclasses.asdict(preset("small"))  # the shape the run resolved
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LoomError) as e:
        export(step, tmp_path / "model.safetensors", "hf")
    assert ("holds 'model.tok_embeddings.weight' as float32 [256, 64] where this model has float32 "
            "[256, 256]; refusing to load it") in _one_line(e)


def test_unknown_layout(zero3_run, tmp_path):
    with pytest.raises(LoomError, match="unknown export layout 'gguf'; choose one of: loom, hf"):
        export(zero3_run[0], tmp_path / "m.safetensors", "gguf")
    assert export_module.LAYOUTS == ("loom", "hf")
