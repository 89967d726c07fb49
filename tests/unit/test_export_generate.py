"""An hf export generates as the model was trained: config.json and generation_config.json carry the
bos/eos/pad ids, so transformers' `generate()` stops at EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from in_process import world_of_one
from optional import TEST_EXTRA, require_module

from loom.config import load_config
from loom.train.driver import train
from loom.train.export import export

# A word-level tokenizer: <unk> 0, <s> 1, </s> 2, <pad> 3, then the words.
WORDS = ["<unk>", "<s>", "</s>", "<pad>", "a", "b", "c", "d"]
BOS, EOS, PAD = 1, 2, 3


def _tokenizer_folder(folder: Path) -> Path:
    tk = require_module("tokenizers", TEST_EXTRA)
    tok = tk.Tokenizer(tk.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    return folder


def _train_here(cfg, run_dir: Path) -> None:
    with world_of_one():
        train(cfg, run_dir, quiet=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny GPT trained on documents "a b c" (each ends with </s>), exported with --layout hf."""
    require_module("datasets", TEST_EXTRA)
    root = tmp_path_factory.mktemp("generate")
    tokenizer = _tokenizer_folder(root / "tokenizer")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "a b c"}) + "\n" for _ in range(400)))
    cfg = load_config(None, ["model.preset=tiny", f'data.source="{data}"', f'data.tokenizer="{tokenizer}"',
                             "data.seq_len=16", "train.steps=40", "train.batch_size=8", "train.lr=1e-2",
                             "train.warmup_steps=0", "train.eval_batches=1", "data.num_workers=0",
                             "parallel.strategy=ddp", "train.device=cpu",
                             f'data.cache_dir="{root / "cache"}"'])
    _train_here(cfg, root / "run")
    out = root / "hf"
    out.mkdir()
    export(root / "run", out / "model.safetensors", layout="hf")
    return out


def test_hf_export_names_the_tokenizers_special_ids(exported):
    generation = json.loads((exported / "generation_config.json").read_text())
    config = json.loads((exported / "config.json").read_text())
    assert generation == {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)


def test_generate_stops_at_eos(exported):
    transformers = require_module("transformers", TEST_EXTRA)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = torch.tensor([[EOS, 4, 5]])  # "</s> a b": the model learned "c </s>" follows
    with torch.no_grad():
        stopped = model.generate(prompt, max_new_tokens=10, do_sample=False)
        # The same model told of no EOS runs on: generation_config's EOS is what stopped it.
        unstopped = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert stopped[0].tolist() == [EOS, 4, 5, 6, EOS]
    assert unstopped.shape[1] == 3 + 10


def test_the_source_models_ids_come_first_and_are_checked(tmp_path):
    """model.init_from's config.json ids, recorded at the run's start, win over the tokenizer's
    (a chat model stops at several EOS ids); a recorded id outside the vocabulary is one line."""
    from loom.checked import BadFile
    from loom.train.export import special_token_ids

    meta = {"model_config": {"gpt": {}, "special_token_ids": {"bos_token_id": 1, "eos_token_id": [5, 6]}}}
    assert special_token_ids(meta, tmp_path, {}, 8, {}) == {"bos_token_id": 1, "eos_token_id": [5, 6]}
    meta["model_config"]["special_token_ids"]["eos_token_id"] = [5, 99]
    with pytest.raises(BadFile, match=r"meta.json: eos_token_id.1 must be an integer in \[0, 7\]"):
        special_token_ids(meta, tmp_path, {}, 8, {})
    hf = {"eos_token_id": 7, "pad_token_id": None}  # a Hugging Face model trained as itself
    assert special_token_ids({"model_config": {"hf_config": hf}}, tmp_path, {}, 8, hf) == {"eos_token_id": 7}
