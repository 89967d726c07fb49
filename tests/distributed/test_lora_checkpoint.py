"""A LoRA run's checkpoints and exports, on gloo ranks: the checkpoint holds the adapters alone and
resumes bit-exactly; a resume or export against another base is refused in one line; `loom export
--lora adapter` writes a PEFT adapter that `peft` loads onto the Hugging Face base with loom's
logits, and `--lora merged` a model transformers loads alone with the same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from optional import TEST_EXTRA, require_module
from test_checkpoint import BASE, _check_bit_exact, _resume_pairs

from loom.config import load_config
from loom.errors import LoomError
from loom.models.lora import apply_lora, blocks_of, is_adapter
from loom.train import checkpoint
from loom.train.driver import train
from loom.train.export import export
from loom.train.task import config_task

transformers = require_module("transformers", TEST_EXTRA)
peft = require_module("peft", TEST_EXTRA)

LORA = ["lora.rank=4", "lora.alpha=8"]
UNITS = "parallel.fsdp_unit_mb=0"
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False, rms_norm_eps=1e-5)


def test_resume_is_bit_exact_and_the_checkpoint_holds_the_adapters_alone(tmp_path):
    """Stopped at step 3 and resumed, a LoRA run's losses equal the uninterrupted run's, bit for bit,
    on zero3, zero1, ddp, zero2, pp 2 and tp 2."""
    cases = {"zero3": [*LORA, "parallel.strategy=zero3", UNITS], "zero1": [*LORA, "parallel.strategy=zero1"],
             "ddp": [*LORA, "parallel.strategy=ddp"], "zero2": [*LORA, "parallel.strategy=zero2", UNITS],
             "pp2": [*LORA, "parallel.strategy=ddp", "parallel.pp=2"],
             "tp2": [*LORA, "parallel.strategy=zero3", "parallel.tp=2"]}
    _check_bit_exact(run_ranks(_resume_pairs, 2, cases, str(tmp_path))[-1])
    saved = checkpoint.read_tensors(tmp_path / "zero3" / "full" / "checkpoints" / "step_3", "")
    model = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert model and all(is_adapter(k) for k in model), model
    # the optimizer's states too, for the adapters alone (exp_avg, exp_avg_sq, step)
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in saved if k.startswith("optim.")} == set(model)


def _llama(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(folder)
    return folder


def _overrides(corpus: Path, base: Path, *extra: str) -> list[str]:
    return [f'model.init_from="{base}"', f'data.source="{corpus}"', "data.seq_len=32", "data.num_workers=0",
            "train.steps=3", "train.batch_size=4", "train.warmup_steps=1", "train.lr=2e-2",
            "train.eval_batches=0", "parallel.strategy=zero3", *LORA, *extra]


def _train_lora(overrides: list[str], run_dir: str, resume: str | None = None):
    try:
        r = train(load_config(None, overrides), Path(run_dir), return_state=True, quiet=True, resume=resume)
    except LoomError as e:
        return str(e)
    return r.losses, r.state_dict


def _loom_logits(overrides: list[str], state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """loom's own model (the base with the trained adapters) on `tokens`."""
    cfg = load_config(None, overrides)
    model = config_task(cfg).model_fn()
    apply_lora(model, blocks_of(model.layers), cfg.lora, torch.float32, cfg.train.seed)
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    model.rope = model._rope_tables(torch.device("cpu"))
    with torch.no_grad():
        return model.eval()(tokens)


def test_exports_load_in_peft_and_transformers_and_another_base_is_refused(tmp_path, corpus):
    base, other = _llama(tmp_path / "base", 0), _llama(tmp_path / "other", 1)
    overrides = _overrides(corpus, base)
    losses, state = run_ranks(_train_lora, 2, overrides, str(tmp_path / "run"))[0]
    step = tmp_path / "run" / "checkpoints" / "step_3"
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    ours = _loom_logits(overrides, state, tokens)

    written = export(step, tmp_path / "adapter", lora="adapter")
    assert sorted(p.name for p in written) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf(tokens).logits
        adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(tokens).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters did train: the comparisons below can fail
    assert torch.allclose(adapted, ours, atol=1e-5, rtol=1e-5), (adapted - ours).abs().max()

    (tmp_path / "merged").mkdir()
    export(step, tmp_path / "merged" / "model.safetensors", layout="hf", lora="merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        alone = merged.eval()(tokens).logits
    assert torch.allclose(alone, ours, atol=1e-5, rtol=1e-5), (alone - ours).abs().max()

    # One line, before anything is read or written: no --lora for adapters, --lora for a full model.
    with pytest.raises(LoomError, match="holds LoRA adapters alone.*--lora adapter"):
        export(step, tmp_path / "full.safetensors")
    # Another base: a resume and a merged export are refused (another model now at the recorded path too).
    said = run_ranks(_train_lora, 1, _overrides(corpus, other, "train.steps=5"), str(tmp_path / "again"),
                     str(step))[0]
    assert isinstance(said, str) and "trained on the base" in said and str(base) in said, said
    shutil.move(base, tmp_path / "moved")
    shutil.copytree(other, base)
    with pytest.raises(LoomError, match="trained on the base"):
        export(step, tmp_path / "merged2.safetensors", lora="merged")


def test_a_hugging_face_decoder_run_as_itself_exports_an_adapter_peft_loads(tmp_path, corpus):
    """Qwen2 (q/k/v biases: loom runs transformers' own modules) with adapters on q, v (column-split)
    and o, down (row-split) under tp 2: the adapter's names are the model's own, and peft's logits
    equal loom's model's."""
    torch.manual_seed(1)
    base = tmp_path / "qwen2"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA)).save_pretrained(base)
    overrides = _overrides(corpus, base, 'lora.targets=["q", "v", "o", "down"]', "parallel.strategy=zero2",
                           "parallel.tp=2")
    _, state = run_ranks(_train_lora, 2, overrides, str(tmp_path / "run"))[0]
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    cfg = load_config(None, overrides)
    ours = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    apply_lora(ours, blocks_of(ours.model.layers), cfg.lora, torch.float32, cfg.train.seed)
    ours.load_state_dict(state)
    export(tmp_path / "run" / "checkpoints" / "step_3", tmp_path / "adapter", lora="adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == [
        "down_proj", "o_proj", "q_proj", "v_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf(tokens).logits
        want = ours.eval()(tokens).logits
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(tokens).logits
    assert (want - plain).abs().max() > 1e-3
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def _first_losses(overrides: list[str], root: str):
    """A full fine-tune's checkpoint, then a full and a LoRA run from it (model.init_from)."""
    full = _train_lora([*BASE, "parallel.strategy=zero3", "train.steps=2"], f"{root}/source")
    assert not isinstance(full, str), full
    start = f'model.init_from="{root}/source/checkpoints/step_2"'
    plain = _train_lora([*BASE, start, *overrides], f"{root}/plain")
    lora = _train_lora([*BASE, start, *overrides, *LORA], f"{root}/lora")
    return plain[0], lora[0]


def test_lora_from_a_loom_checkpoint_starts_from_its_weights(tmp_path):
    """DCP reads the base from the checkpoint (the adapters keep their own init): step 1's loss is the
    full run's from the same weights, and then they part."""
    plain, lora = run_ranks(_first_losses, 2, ["parallel.strategy=zero3", "train.steps=3", UNITS],
                            str(tmp_path))[0]
    assert lora[0] == pytest.approx(plain[0], rel=1e-6) and lora[1] != plain[1], (plain, lora)
