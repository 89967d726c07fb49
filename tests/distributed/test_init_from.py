"""`model.init_from`: a Hugging Face Llama saved with `save_pretrained` in several safetensors
files starts every layout from its weights — the first forward's logits equal
`LlamaForCausalLM`'s within 1e-5 — trains, and exports back to a folder transformers loads. A
decoder loom's GPT cannot express (Qwen2: biases) runs as the Hugging Face model itself, and a
loom checkpoint or export starts a run too. Each rank reads only the bytes of its shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from optional import DEEPSPEED, TEST_EXTRA, require_module

from loom.config import load_config, validate
from loom.data.loader import GlobalBatchSampler
from loom.errors import LoomError
from loom.train.driver import build_training, train
from loom.train.task import config_task

transformers = require_module("transformers", TEST_EXTRA)

SEQ, BATCH = 32, 4
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False, rms_norm_eps=1e-5)


def _save(model, path: Path, shard: str = "40KB") -> Path:
    model.save_pretrained(path, max_shard_size=shard)
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded, with its index
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
                 tmp_path_factory.mktemp("llama") / "tiny-llama")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**LLAMA)  # q/k/v with biases: loom's GPT has none
    return _save(transformers.Qwen2ForCausalLM(config), tmp_path_factory.mktemp("qwen") / "tiny-qwen2")


def _config(corpus: Path, model: Path, *extra: str):
    return load_config(None, [
        f'model.init_from="{model}"', f'data.source="{corpus}"', f"data.seq_len={SEQ}", "data.num_workers=0",
        "data.eval_fraction=0.05", "train.steps=3", f"train.batch_size={BATCH}", "train.seed=3",
        "train.eval_batches=1", "train.warmup_steps=1", *extra])


def _hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


def _first_batch(cfg) -> torch.Tensor:
    task = config_task(cfg)
    sampler = GlobalBatchSampler(len(task.train_data), BATCH, 0, 1, 1, cfg.train.seed)
    return torch.stack([task.train_data[i] for i in sampler.global_batch_indices(0)])


def _rank_logits(cfg, tokens: torch.Tensor):
    """This layout's model right after loading: logits of `tokens` (whole), and the bytes read."""
    from torch.distributed.tensor import DTensor

    from loom.parallel.mesh import init_distributed

    d = init_distributed(lambda world: validate(cfg, world), "cpu")
    task = config_task(cfg)
    built = build_training(cfg, d, task)
    with torch.no_grad():
        out = built.model(tokens)
    logits = getattr(out, "logits", out)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits, getattr(task.weights, "bytes_read", None)


LAYOUTS = [("ddp", 2, ()), ("zero3", 2, ()), ("hsdp", 4, ("parallel.dp_replicate=2",)),
           ("zero3", 2, ("parallel.tp=2",)), ("zero3", 4, ("parallel.tp=2",)),
           ("zero3", 2, ("parallel.engine=deepspeed",))]


@pytest.mark.parametrize("strategy,world,extra", LAYOUTS,
                         ids=["ddp", "zero3", "hsdp-2x2", "tp2", "tp2xzero3-dp2", "deepspeed-zero3"])
def test_llama_logits_equal_transformers(corpus, llama_dir, strategy, world, extra):
    if "parallel.engine=deepspeed" in extra:
        require_module("deepspeed", DEEPSPEED)
    cfg = _config(corpus, llama_dir, f"parallel.strategy={strategy}", *extra)
    tokens = _first_batch(cfg)[:, :-1]
    expected = _hf_logits(llama_dir, tokens)
    for logits, _ in run_ranks(_rank_logits, world, cfg, tokens):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _rank_train(cfg, run_dir):
    r = train(cfg, Path(run_dir) if run_dir else None, quiet=True)
    return r.losses


def test_pipeline_starts_from_the_weights(corpus, llama_dir):
    """pp=2: each stage reads its layers; the first step's loss is transformers' on that batch."""
    cfg = _config(corpus, llama_dir, "parallel.strategy=zero3", "parallel.pp=2")
    batch = _first_batch(cfg)
    logits = _hf_logits(llama_dir, batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    losses = run_ranks(_rank_train, 2, cfg, None)[0]
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def test_qwen2_runs_as_the_hugging_face_model(corpus, qwen_dir):
    """Biases: loom's GPT cannot express it, so the Hugging Face decoder is built on the meta device
    and each rank fills its shards (zero3, and TP with the biases split by columns)."""
    from loom.train.task import resolve_model

    assert resolve_model(_config(corpus, qwen_dir), 256).gpt is None
    for extra in ((), ("parallel.tp=2",)):
        cfg = _config(corpus, qwen_dir, "parallel.strategy=zero3", *extra)
        tokens = _first_batch(cfg)[:, :-1]
        expected = _hf_logits(qwen_dir, tokens)
        for logits, _ in run_ranks(_rank_logits, 2, cfg, tokens):
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_qwen2_exports_under_its_own_names(corpus, qwen_dir, tmp_path):
    from loom.train.export import export

    run = tmp_path / "run"
    run_ranks(_rank_train, 2, _config(corpus, qwen_dir, "parallel.strategy=zero3"), str(run))
    out = tmp_path / "hf" / "model.safetensors"
    out.parent.mkdir()
    export(run, out, layout="hf")
    assert json.loads((out.parent / "config.json").read_text())["model_type"] == "qwen2"
    tokens = torch.arange(40).reshape(2, 20) % 256
    trained = _hf_logits(out.parent, tokens)  # transformers loads it (strictly: no missing weights)
    assert not torch.allclose(trained, _hf_logits(qwen_dir, tokens), atol=1e-3)
    (logits, _), = run_ranks(_rank_logits, 1, _config(corpus, out.parent, "parallel.strategy=ddp"), tokens)
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)


def test_trained_model_exports_back_to_transformers(corpus, llama_dir, tmp_path):
    """Fine-tune, export with --layout hf: transformers loads it, and its logits are the trained
    model's (loom's own export read back by model.init_from gives the same ones)."""
    from loom.train.export import export

    run = tmp_path / "run"
    run_ranks(_rank_train, 2, _config(corpus, llama_dir, "parallel.strategy=zero3"), str(run))
    out = tmp_path / "hf" / "model.safetensors"
    out.parent.mkdir()
    export(run, out, layout="hf")
    tokens = torch.arange(40).reshape(2, 20) % 256
    trained = _hf_logits(out.parent, tokens)
    assert not torch.allclose(trained, _hf_logits(llama_dir, tokens), atol=1e-3)  # it did train
    loom_export = tmp_path / "loom.safetensors"
    export(run, loom_export, layout="loom")
    for source in (out.parent, loom_export, run / "checkpoints" / "step_3"):
        cfg = _config(corpus, source, "parallel.strategy=ddp")
        (logits, _), = run_ranks(_rank_logits, 1, cfg, tokens)
        torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)


def _rank_load_memory(cfg):
    """Bytes this rank read from the files, and the peak of its anonymous memory while it built
    and loaded its shards, above what it held before (MiB, sampled every millisecond)."""
    import threading
    import time

    from loom.parallel.mesh import init_distributed

    d = init_distributed(lambda world: validate(cfg, world), "cpu")
    task = config_task(cfg)
    before, peak, done = _anon_mib(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        build_training(cfg, d, task)
    finally:
        done.set()
        sampler.join()
    return task.weights.bytes_read, max(peak[0], _anon_mib()) - before


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_each_rank_reads_only_its_shards(corpus, tmp_path):
    """A 69M-parameter Llama (277 MB in fp32, 5 files): under zero3 on 2 ranks each rank reads
    half of the bytes (together: each byte once) and holds about half of the model afterwards —
    no rank ever materializes the whole model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    weights = {name: torch.randn(p.shape) * 0.02 for name, p in meta.named_parameters()}
    model_dir = tmp_path / "llama-69m"
    model_dir.mkdir()
    import safetensors.torch

    names, files, index = list(weights), 5, {}
    for i in range(files):
        part = {n: weights[n] for n in names[i::files]}
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        safetensors.torch.save_file(part, str(model_dir / file))
        index.update({n: file for n in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (model_dir / "config.json").write_text(config.to_json_string())
    total = sum(t.numel() * 4 for t in weights.values())
    del weights
    cfg = _config(corpus, model_dir, "parallel.strategy=zero3", "parallel.fsdp_unit_mb=0")
    results = run_ranks(_rank_load_memory, 2, cfg, timeout=600)
    assert sum(r[0] for r in results) == total
    for bytes_read, peak_mib in results:
        assert bytes_read == pytest.approx(total / 2, rel=0.02)
        # Half of the fp32 model (132 MiB), never the whole (264 MiB): the shard, the optimizer's
        # first buffers and one parameter's block in flight.
        assert peak_mib < 0.7 * total / 2**20, (peak_mib, total / 2**20)


def test_mismatched_weights_name_the_first_tensor(corpus, llama_dir, tmp_path):
    import shutil

    import safetensors.torch

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoomError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \[.*\], "
                                        r"the model's layers\.0\.feed_forward\.w\d\.weight needs"):
        config_task(_config(corpus, broken))
    # A tensor the model has no parameter for.
    extra = tmp_path / "extra"
    shutil.copytree(llama_dir, extra)
    safetensors.torch.save_file({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)},
                                str(extra / "model-extra.safetensors"))
    (extra / "model.safetensors.index.json").unlink()
    with pytest.raises(LoomError, match="holds tensor model.layers.9.mlp.up_proj.weight, which the model"):
        config_task(_config(corpus, extra))


def _rank_own_task_hint(cfg, run_dir):
    import contextlib
    import io

    from loom.data.loader import split_train_eval
    from loom.train.task import Task, load_data, next_token_loss

    tokens, _ = load_data(cfg)
    train_set, _ = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    llama = transformers.LlamaConfig(**LLAMA)
    task = Task(model_fn=lambda: transformers.LlamaForCausalLM(llama), loss_fn=next_token_loss,
                train_data=train_set, tokens_per_sample=cfg.data.seq_len)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(cfg, Path(run_dir), task=task)
    return out.getvalue()


def test_own_model_run_hints_its_script_not_loom_train(corpus, tmp_path):
    """A bring-your-own-model run (examples/hf_llama.py) is continued by its script: `loom train
    --resume` would train loom's GPT instead."""
    cfg = load_config(None, [f'data.source="{corpus}"', f"data.seq_len={SEQ}", "data.num_workers=0",
                             "train.steps=2", f"train.batch_size={BATCH}", "parallel.strategy=ddp"])
    printed = run_ranks(_rank_own_task_hint, 1, cfg, str(tmp_path / "run"))[0]
    hint = next(line for line in printed.splitlines() if line.startswith("checkpoint: "))
    assert "run your script again with train(" in hint and "resume='auto'" in hint, hint
    assert "loom train --resume" not in printed
