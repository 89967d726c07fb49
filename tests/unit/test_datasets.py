"""Real datasets for `loom train`: Hugging Face tokenizers, JSONL / Parquet / Arrow records, mixing,
packing, SFT masks, streaming and the bad inputs — all on data made here (no network)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.config import Config
from loom.data.corpus import load_tokens
from loom.data.hf_tokenizer import HFTokenizer, resolve_tokenizer
from loom.data.loader import build_loaders
from loom.data.run_data import build_run_data
from loom.data.stream import TokenStream
from loom.errors import ConfigError, LoomError

WORDS = ("the cat sat on mat a dog ran far away user assistant system hello hi how are you fine thanks "
         "good day to").split()
SPECIALS = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
VOCAB = {w: i for i, w in enumerate(SPECIALS + WORDS)}
EOS = VOCAB["</s>"]


def write_tokenizer(folder: Path, eos: str | None = "</s>", config: bool = True, extra: tuple = ()) -> Path:
    """A word-level tokenizer.json over WORDS (split on whitespace), with special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate((SPECIALS if eos else [t for t in SPECIALS if t != "</s>"]) + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([t for t in SPECIALS[1:] if t in vocab])
    if extra:
        tok.add_tokens(list(extra))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        settings = {"eos_token": eos, "chat_template": CHAT_TEMPLATE}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder / "tokenizer.json"


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def texts(n: int, offset: int = 0) -> list[str]:
    """n documents of 3..9 words."""
    return [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range((i + offset) % 7 + 3)) for i in range(n)]


def stream_of(docs: list[str]) -> list[int]:
    """What tokenizing the texts ourselves gives: each document's ids, then EOS."""
    return [t for d in docs for t in ids(d) + [EOS]]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def config(tmp_path: Path, source: str, tokenizer: Path | str, seq_len: int = 8, **data) -> Config:
    cfg = Config()
    d = cfg.data
    d.source, d.tokenizer, d.seq_len, d.eval_fraction = source, str(tokenizer), seq_len, 0.0
    d.cache_dir = str(tmp_path / "cache")
    d.num_workers = 0
    for key, value in data.items():
        setattr(d, key, value)
    return cfg


def all_tokens(data) -> list[int]:
    return np.asarray(data.train.tokens[0:len(data.train.tokens)], dtype=np.int64).tolist()


def one_line(exc_type: type[Exception], fn, *args) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args)
    message = str(info.value)
    assert message and "\n" not in message
    return message


# ---------------------------------------------------------------- tokenizers


def test_hf_tokenizer_eos_vocab_and_auto(tmp_path: Path, tokenizer_json: Path):
    tok = HFTokenizer(tokenizer_json)
    assert (tok.eos_token, tok.eos_id) == ("</s>", EOS)
    assert tok.encode("the cat sat").tolist() == ids("the cat sat")  # no BOS or EOS added
    assert tok.chat_template == CHAT_TEMPLATE

    # no tokenizer_config.json: EOS from the common names; added tokens count in the vocabulary
    bare = write_tokenizer(tmp_path / "bare", config=False, extra=("zebra", "quagga"))
    other = HFTokenizer(bare)
    assert other.eos_id == EOS and other.chat_template is None
    assert other.vocab_size == len(VOCAB) + 2
    assert other.encode("the zebra").tolist() == [VOCAB["the"], len(VOCAB)]

    model = tmp_path / "model"
    write_tokenizer(model)
    assert resolve_tokenizer("auto", model) == model / "tokenizer.json"
    assert resolve_tokenizer("auto", None) == "byte"
    assert resolve_tokenizer("auto", tmp_path) == "byte"  # a model folder without a tokenizer.json
    assert resolve_tokenizer("bpe", model) == "bpe"
    assert resolve_tokenizer(str(model), None) == model / "tokenizer.json"
    assert "names no file" in one_line(ConfigError, resolve_tokenizer, " ", model)  # never the working dir


def test_hf_vocabulary_is_the_largest_id_plus_one_whatever_the_tokenizer_reports(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "sky": 999}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tok.get_vocab_size() == 4  # what the library reports: a count, not the largest id + 1
    (tmp_path / "gaps").mkdir()
    tok.save(str(tmp_path / "gaps" / "tokenizer.json"))
    gaps = HFTokenizer(tmp_path / "gaps" / "tokenizer.json")
    assert gaps.vocab_size == 1000 and gaps.encode("hello sky").tolist() == [2, 999]
    doc = json.loads((tmp_path / "gaps" / "tokenizer.json").read_text())
    doc["added_tokens"] = [{"id": 1500, "content": "<|im_end|>", "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True}]
    (tmp_path / "gaps" / "tokenizer.json").write_text(json.dumps(doc))  # the library gives it id 4
    added = HFTokenizer(tmp_path / "gaps" / "tokenizer.json")
    assert added.vocab_size == 1000 and added.encode("sky <|im_end|>").tolist() == [999, 4]


def test_tokenizer_files_are_read_through_the_checked_boundary(tmp_path: Path, tokenizer_json: Path):
    folder = tmp_path / "tok"
    path = write_tokenizer(folder)
    for settings, said in (({"eos_token": ["</s>"]}, "eos_token must be a string, got ['</s>'] (list)"),
                           ({"eos_token": {"content": 5}}, "eos_token.content must be a string"),
                           ({"chat_template": 7}, "chat_template must be a string, got 7 (int)"),
                           ({"chat_template": [{"name": "default"}]}, "chat_template[0].template is missing"),
                           ([1, 2], "must be a JSON object (a mapping), got list")):
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
        msg = one_line(LoomError, HFTokenizer, path)
        assert "tokenizer_config.json" in msg and said in msg, msg
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"},
                                                             "chat_template": [{"name": "default",
                                                                                "template": "{{ 1 }}"}]}))
    assert HFTokenizer(path).chat_template == "{{ 1 }}"
    (folder / "chat_template.jinja").write_bytes(b"{{ 1 }}\xff")
    assert "chat_template.jinja is not UTF-8" in one_line(LoomError, HFTokenizer, path)


def test_auto_tokenizer_follows_the_model_folder(tmp_path: Path):
    docs = texts(20)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    write_tokenizer(tmp_path / "model")
    data = build_run_data(config(tmp_path, str(tmp_path / "a.jsonl"), "auto"), model_dir=tmp_path / "model")
    assert data.vocab_size == len(VOCAB)
    assert all_tokens(data)[:len(stream_of(docs))] == stream_of(docs)


# ---------------------------------------------------------------- sources


def test_jsonl_parquet_arrow_and_saved_datasets_give_the_same_stream(tmp_path: Path, tokenizer_json: Path):
    import datasets

    docs = texts(30)
    records = [{"text": t, "id": i} for i, t in enumerate(docs)]
    expected = stream_of(docs)
    window = 9
    write_jsonl(tmp_path / "a.jsonl", records)
    write_parquet(tmp_path / "a.parquet", records)
    folder = tmp_path / "jsonl_folder"  # two files, read in name order
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", records[:12])
    write_jsonl(folder / "part-1.jsonl", records[12:])
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "a.jsonl", tmp_path / "a.parquet", folder, tmp_path / "saved", arrow):
        data = build_run_data(config(tmp_path, str(source), tokenizer_json))
        assert data.vocab_size == len(VOCAB) and data.format == "text" and data.eval is None
        whole = len(expected) // window * window
        assert all_tokens(data) == expected, source
        assert len(data.train) == len(expected) // window
        # packing: windows are the stream cut every seq_len + 1 tokens, across document edges
        cut = [data.train[i].tolist() for i in range(len(data.train))]
        assert cut == [expected[i:i + window] for i in range(0, whole, window)]
        assert data.train[0].dtype == torch.int64 and data.train[0].shape == (window,)


def test_records_are_tokenized_once_then_memory_mapped(tmp_path: Path, tokenizer_json: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(25)])
    cfg = config(tmp_path, str(tmp_path / "a.jsonl"), tokenizer_json, eval_fraction=0.1)
    first = build_run_data(cfg)
    assert first.eval is not None and len(first.eval) >= 1
    assert len(list((tmp_path / "cache" / "tokens").glob("*.tokens.npy"))) == 1

    def no_tokenizing(self, texts):
        raise AssertionError("tokenized again instead of reading the cache")

    monkeypatch.setattr(HFTokenizer, "encode_batch", no_tokenizing)
    again = build_run_data(cfg)
    assert isinstance(again.train.tokens, np.memmap)
    assert all_tokens(again) == all_tokens(first)
    assert [again.eval[i].tolist() for i in range(len(again.eval))] == \
        [first.eval[i].tolist() for i in range(len(first.eval))]
    # the datasets library's Arrow copy lives under data.cache_dir too
    assert (tmp_path / "cache" / "hf-datasets").is_dir()


def test_text_files_with_a_tokenizer_json_end_each_file_with_eos(tmp_path: Path, tokenizer_json: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("dog ran far\naway")
    (tmp_path / "docs" / "a.txt").write_text("the cat sat")
    data = build_run_data(config(tmp_path, str(tmp_path / "docs"), tokenizer_json, seq_len=3))
    assert all_tokens(data) == stream_of(["the cat sat", "dog ran far away"])


def test_default_stdlib_run_is_unchanged():
    cfg = Config()
    data = build_run_data(cfg)
    tokens, vocab = load_tokens("stdlib")
    assert data.vocab_size == vocab == 256 and data.format == "text"
    assert data.train.tokens is not None and len(data.train.tokens) == len(tokens)
    assert torch.equal(data.train[5], torch.from_numpy(tokens[5 * 129:6 * 129].astype(np.int64)))
    assert data.eval is not None and len(data.train) + len(data.eval) == len(tokens) // 129
    assert data.description.startswith("stdlib: ")


# ---------------------------------------------------------------- mixing


def expected_mix(counts: list[int], weights: list[float], seed: int) -> list[tuple[int, int]]:
    """Independently: a source per document ∝ weight from PCG64(seed, 'mix'), each source in order,
    starting over when it runs out; as many documents as the sources hold together."""
    n = sum(counts)
    u = np.random.default_rng([seed, 0x6D6978]).random(4096)[:n]
    cdf = np.cumsum(weights) / sum(weights)
    taken = [0] * len(counts)
    order = []
    for x in u:
        s = int(np.argmax(x < cdf))
        order.append((s, taken[s] % counts[s]))
        taken[s] += 1
    return order


def test_mix_interleaves_documents_by_weight_from_the_seed(tmp_path: Path, tokenizer_json: Path):
    a_docs, b_docs = texts(40), texts(10, offset=3)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in a_docs])
    write_parquet(tmp_path / "b.parquet", [{"body": t} for t in b_docs])  # its own text field
    mix = [{"source": str(tmp_path / "a.jsonl"), "weight": 1},
           {"source": str(tmp_path / "b.parquet"), "weight": 3, "text_field": "body"}]
    for seed in (0, 7):
        cfg = config(tmp_path, "unused", tokenizer_json, mix=mix)
        cfg.train.seed = seed
        data = build_run_data(cfg)
        order = expected_mix([40, 10], [1, 3], seed)
        docs = [(a_docs, b_docs)[s][i] for s, i in order]
        assert all_tokens(data) == stream_of(docs)
        counts = np.bincount([s for s, _ in order], minlength=2)
        assert counts.sum() == 50 and 30 <= counts[1] <= 45  # ~3/4 from b, so b (10 docs) repeats
        assert f"({counts[1]} docs drawn, 10 in it)" in data.description
    assert isinstance(data.train.tokens, TokenStream)


# ---------------------------------------------------------------- SFT


def test_sft_prompt_completion_masks_exactly_the_prompt(tmp_path: Path, tokenizer_json: Path):
    records = [{"prompt": "hello how are you", "completion": "fine thanks"},
               {"prompt": "hi", "completion": "good day to you"},
               {"prompt": None, "completion": "the cat sat"},  # no prompt: all of it is the completion
               {"prompt": "", "completion": "a dog ran"}] * 3
    write_jsonl(tmp_path / "sft.jsonl", records)
    data = build_run_data(config(tmp_path, str(tmp_path / "sft.jsonl"), tokenizer_json, seq_len=6,
                                 format="sft"))
    assert data.format == "sft"
    want_ids, want_labels = [], []
    for r in records:
        p, c = ids(r["prompt"] or ""), ids(r["completion"]) + [EOS]
        want_ids += p + c
        want_labels += [-100] * len(p) + c
    items = [data.train[i] for i in range(len(data.train))]
    assert all(item.shape == (2, 7) and item.dtype == torch.int64 for item in items)
    got = torch.cat(items, dim=1)
    n = got.shape[1]
    assert got[0].tolist() == want_ids[:n]
    assert got[1].tolist() == want_labels[:n]


def test_sft_messages_train_on_the_assistant_turns_only(tmp_path: Path, tokenizer_json: Path):
    chat = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "good day"}]
    write_parquet(tmp_path / "chat.parquet", [{"messages": chat}] * 4)
    data = build_run_data(config(tmp_path, str(tmp_path / "chat.parquet"), tokenizer_json, seq_len=15,
                                 format="sft"))
    start, end = VOCAB["<|im_start|>"], VOCAB["<|im_end|>"]
    one_ids = ([start, *ids("system the cat"), end, start, *ids("user hello"), end, start, VOCAB["assistant"]]
               + [VOCAB["hi"], end]
               + [start, *ids("user how are you"), end, start, VOCAB["assistant"]]
               + [*ids("fine thanks"), end, EOS])  # the last user turn teaches nothing: dropped
    loss = {11, 12, 21, 22, 23, 24}  # hi, <|im_end|>, fine, thanks, <|im_end|>, EOS
    one_labels = [t if i in loss else -100 for i, t in enumerate(one_ids)]
    assert len(one_ids) == 25
    got = torch.cat([data.train[i] for i in range(len(data.train))], dim=1)
    n = got.shape[1]
    assert got[0].tolist() == (one_ids * 4)[:n]
    assert got[1].tolist() == (one_labels * 4)[:n]


def test_sft_items_batch_through_build_loaders(tmp_path: Path, tokenizer_json: Path):
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "hello", "completion": "fine thanks"}] * 40)
    cfg = config(tmp_path, str(tmp_path / "sft.jsonl"), tokenizer_json, seq_len=4, format="sft")
    cfg.train.batch_size, cfg.train.grad_accum, cfg.train.steps = 4, 2, 3
    data = build_run_data(cfg)
    loaders = build_loaders(cfg, data.train, data.eval, 0, 1, False)
    batches = list(loaders.train)
    assert len(batches) == 6 and all(b.shape == (2, 2, 5) for b in batches)


# ---------------------------------------------------------------- streaming


def test_streaming_gives_the_map_style_windows_and_resumes(tmp_path: Path, tokenizer_json: Path):
    docs = texts(60)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs])
    source = str(tmp_path / "a.jsonl")
    mapped = build_run_data(config(tmp_path, source, tokenizer_json))
    windows = [mapped.train[i].tolist() for i in range(len(mapped.train))]
    cfg = config(tmp_path, source, tokenizer_json, streaming=True)
    cfg.train.batch_size, cfg.train.grad_accum, cfg.train.steps = 4, 2, 5
    streamed = build_run_data(cfg)
    assert isinstance(streamed.train, torch.utils.data.IterableDataset) and streamed.eval is None
    first = [w.tolist() for _, w in zip(range(len(windows)), streamed.train)]
    assert first == windows

    def steps(dp_size: int, start_step: int, num_workers: int = 0) -> list[list[list[int]]]:
        """Each step's global batch, gathered from every rank's micro-batches."""
        cfg.data.num_workers = num_workers
        per_rank = []
        for rank in range(dp_size):
            loader = build_loaders(cfg, streamed.train, None, rank, dp_size, False, start_step).train
            assert loader.dataset.micro_batch == 4 // dp_size // 2
            per_rank.append([b.tolist() for b in loader])
        out = []
        for k in range(cfg.train.steps - start_step):
            out.append([w for r in range(dp_size) for m in per_rank[r][2 * k:2 * k + 2] for w in m])
        return out

    # global batch k is windows 4k..4k+3 of the stream (epochs wrap around), whatever the layout
    stream = (windows * 3)[:4 * cfg.train.steps]
    want = [stream[4 * k:4 * k + 4] for k in range(cfg.train.steps)]
    assert steps(1, 0) == want
    assert steps(2, 0) == want
    assert steps(2, 3) == want[3:]  # a resumed run continues the same token stream
    assert steps(1, 1, num_workers=2) == want[1:]  # workers share the micro-batches in order

    # eval: the stream's first eval_batches × batch_size windows, and training starts after them
    cfg.data.eval_fraction, cfg.train.eval_batches = 0.1, 2
    held = build_run_data(cfg)
    assert [held.eval[i].tolist() for i in range(len(held.eval))] == windows[:8]
    assert next(iter(held.train)).tolist() == windows[8]


def test_streaming_sft_and_mix_match_the_map_style_path(tmp_path: Path, tokenizer_json: Path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hello", "completion": t} for t in texts(15)])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "how are you", "completion": t} for t in texts(6, 2)])
    mix = [{"source": str(tmp_path / "a.jsonl"), "weight": 2}, {"source": str(tmp_path / "b.jsonl")}]
    cfg = config(tmp_path, "unused", tokenizer_json, format="sft", mix=mix)
    mapped = build_run_data(cfg)
    cfg.data.streaming = True
    streamed = build_run_data(cfg)
    windows = [mapped.train[i] for i in range(len(mapped.train))]
    got = [w for _, w in zip(windows, streamed.train)]
    assert all(torch.equal(a, b) for a, b in zip(got, windows)) and len(got) == len(windows)


# ---------------------------------------------------------------- bad input, one line each


def test_bad_inputs_are_one_line(tmp_path: Path, tokenizer_json: Path):
    write_jsonl(tmp_path / "a.jsonl", [{"body": "the cat", "id": 1}])
    msg = one_line(ConfigError, build_run_data, config(tmp_path, str(tmp_path / "a.jsonl"), tokenizer_json))
    assert "'text'" in msg and "body, id" in msg and "data.text_field" in msg

    (tmp_path / "empty.jsonl").write_text("")
    msg = one_line(LoomError, build_run_data, config(tmp_path, str(tmp_path / "empty.jsonl"), tokenizer_json))
    assert "empty" in msg
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    msg = one_line(LoomError, build_run_data,
                   config(tmp_path, str(tmp_path / "none.parquet"), tokenizer_json))
    assert "empty" in msg and "no records" in msg

    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "hi", "completion": "fine"}, {"prompt": "hello"}])
    msg = one_line(LoomError, build_run_data,
                   config(tmp_path, str(tmp_path / "sft.jsonl"), tokenizer_json, format="sft"))
    assert "sft.jsonl line 2 has no" in msg and "'completion'" in msg
    write_jsonl(tmp_path / "sft2.jsonl", [{"prompt": "hi"}])
    msg = one_line(ConfigError, build_run_data,
                   config(tmp_path, str(tmp_path / "sft2.jsonl"), tokenizer_json, format="sft"))
    assert "'completion'" in msg and "prompt" in msg

    folder = tmp_path / "records"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"text": "the"}])
    (folder / "notes.md").write_text("hello")
    msg = one_line(LoomError, build_run_data, config(tmp_path, str(folder), tokenizer_json))
    assert "notes.md" in msg and "a.jsonl" in msg

    msg = one_line(ConfigError, build_run_data,
                   config(tmp_path, str(tmp_path / "a.jsonl"), tmp_path / "missing" / "tokenizer.json"))
    assert "does not exist" in msg and "tokenizer.json" in msg
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    msg = one_line(LoomError, build_run_data,
                   config(tmp_path, str(tmp_path / "a.jsonl"), tmp_path / "broken" / "tokenizer.json"))
    assert "does not parse" in msg
    no_eos = write_tokenizer(tmp_path / "no_eos", eos=None, config=False)
    msg = one_line(LoomError, build_run_data, config(tmp_path, str(tmp_path / "a.jsonl"), no_eos))
    assert "no EOS token" in msg and "eos_token" in msg

    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    msg = one_line(LoomError, build_run_data,
                   config(tmp_path, str(tmp_path / "chat.jsonl"), tokenizer_json, format="sft"))
    assert "chat.jsonl line 1" in msg and "assistant" in msg
    msg = one_line(ConfigError, build_run_data, config(tmp_path, str(tmp_path / "a.jsonl"), "bpe"))
    assert "bpe" in msg and "tokenizer.json" in msg
    typo = [{"source": str(tmp_path / "a.jsonl"), "wieght": 2}]
    msg = one_line(ConfigError, build_run_data, config(tmp_path, "x", tokenizer_json, mix=typo))
    assert "wieght" in msg
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    msg = one_line(LoomError, build_run_data, config(tmp_path, "x", tokenizer_json, mix=[
        {"source": str(tmp_path / "t.bin")}, {"source": str(tmp_path / "a.jsonl")}]))
    assert ".bin" in msg and "loom data prepare" in msg
    (tmp_path / "docs.txt").write_text("the cat")
    msg = one_line(ConfigError, build_run_data,
                   config(tmp_path, str(tmp_path / "docs.txt"), tokenizer_json, streaming=True))
    assert "data.streaming" in msg


# ---------------------------------------------------------------- chat templates, in bounds


CHATML = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
          "{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m.content|trim ~ '<|im_end|>' }}"
          "{{ '' if loop.last else '\\n' }}"
          "{% if m.tool_calls is defined %}{{ m.tool_calls|tojson }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant %d' % ns.n }}{% endif %}")
CONVERSATION = [{"role": "user", "content": " hello "},
                {"role": "assistant", "content": "hi", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}]


def test_chat_templates_render_as_jinja_does_within_the_bounds():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from loom.data.chat_template import ChatTemplate

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    plain = env.from_string(CHATML)  # as Hugging Face renders it: tojson keeps the keys' order
    ours = ChatTemplate(CHATML, {"eos_token": "</s>"}, "tokenizer_config.json")
    for gen in (False, True):
        expected = plain.render(messages=CONVERSATION, add_generation_prompt=gen)
        assert ours.render(CONVERSATION, gen, "record 1") == expected
    assert ours.render(CONVERSATION, True, "r").endswith("<|im_start|>assistant 2")


@pytest.mark.parametrize("template, said", [
    ("{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "more than 1,048,576 characters"),
    ("{% set ns = namespace(s='x' * 600000) %}{% set t = ns.s ~ ns.s %}{{ t|length }}",
     "joins a value of more than 1,048,576 characters with ~"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
     "more than 1,048,576 characters"),
    ("{{ ('y' * 1000).replace('', 'x' * 100000) }}", "could make up to 100,000,000 characters"),
    ("{{ 'a'|indent(10**8) }}", "could make up to 100,000,000 characters"),
    ("{{ '%*d' % (10**8, 1) }}", "widths adding up to 100,000,001"),
    ("{{ '{:>99999999}'.format(1) }}", "widths adding up to 100,000,000"),
    ("{{ 10 ** 100000 }}", "computes 10 ** 100000"),
    ("{{ [messages] * 10**6 }}", "repeats a value 1,000,000 times"),
    ("{% for i in range(60000) %}{{ 'abcdefghijklmnopqrst' }}{% endfor %}", "renders more than 1,048,576"),
    ("{{ (range(99999)|map('string')|list)|join('x' * 1000) }}", "could make up to"),
    ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "(RecursionError"),
    ("{{ raise_exception('roles must alternate') }}", "(TemplateError: roles must alternate)"),
    ("{{ ''.__class__.__mro__ }}", "fails on"),  # the sandbox: an unsafe attribute is undefined
    ("{{ messages.append(1) }}", "(SecurityError"),
])
def test_a_template_past_a_bound_is_one_line_naming_its_file_and_the_record(template: str, said: str):
    from loom.data.chat_template import ChatTemplate

    start = time.perf_counter()
    with pytest.raises(LoomError) as info:
        ChatTemplate(template, {}, "/m/tokenizer_config.json").render(CONVERSATION, False,
                                                                      "/d/chat.jsonl line 3")
    message = str(info.value)
    assert message.startswith("/m/tokenizer_config.json: the chat template ") and "\n" not in message
    assert "/d/chat.jsonl line 3" in message and said in message, message
    # refused before the work, not after it (2^40 items would take hours; 5 s leaves room for a loaded host)
    assert time.perf_counter() - start < 5


def test_a_runaway_template_is_stopped_and_a_callers_timer_survives(monkeypatch: pytest.MonkeyPatch):
    import signal

    from loom.data import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.2)
    loop = "{% for i in range(100000) %}{% for c in messages[0].content * 100 %}{% endfor %}{% endfor %}"
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        start = time.perf_counter()
        with pytest.raises(LoomError, match="runs longer than 0.2 s on record 1"):
            chat_template.ChatTemplate(loop, {}, "t.jinja").render(CONVERSATION, False, "record 1")
        assert time.perf_counter() - start < 1.5
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < left <= 30 and not fired  # the caller's timer: put back with what was left of it
        assert signal.getsignal(signal.SIGALRM) is not chat_template._expired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_compile_errors_name_the_template_file(tmp_path: Path):
    from loom.data.chat_template import ChatTemplate

    compile_error = r"^t.jinja: the chat template does not compile \("
    with pytest.raises(LoomError, match=compile_error + "TemplateSyntaxError"):
        ChatTemplate("{% for %}", {}, "t.jinja")
    with pytest.raises(LoomError, match=compile_error):  # nested too deep: RecursionError
        ChatTemplate("{% if 1 %}" * 2000 + "x" + "{% endif %}" * 2000, {}, "t.jinja")


# ---------------------------------------------------------------- the tokenizing cache, damaged


def test_a_damaged_tokenizing_cache_is_one_line_saying_to_delete_it(tmp_path: Path, tokenizer_json: Path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(30)])
    cfg = config(tmp_path, str(tmp_path / "a.jsonl"), tokenizer_json)
    expected = all_tokens(build_run_data(cfg))
    assert all_tokens(build_run_data(cfg)) == expected  # read back from the cache
    (tokens_file,) = (tmp_path / "cache" / "tokens").glob("*.tokens.npy")
    key = tokens_file.name.removesuffix(".tokens.npy")
    good = np.load(tokens_file)
    for damaged, said in ((np.where(good == EOS, len(VOCAB) + 5, good), f"holds token id {len(VOCAB) + 5}"),
                          (good[:-3], "but the arrays beside it hold")):
        np.save(tokens_file, damaged.astype(good.dtype))
        msg = one_line(LoomError, build_run_data, cfg)
        assert said in msg and f"delete {tmp_path / 'cache' / 'tokens' / key}.*" in msg, msg
    np.save(tokens_file, good)
    assert all_tokens(build_run_data(cfg)) == expected


def test_a_bare_null_line_is_one_line_not_a_crash(tmp_path: Path):
    """pyarrow's JSON reader segfaults on a block that starts with `null`: loom finds the line first
    (in a child process, so that a regression crashes it, not the test session)."""
    import subprocess
    import sys

    (tmp_path / "a.jsonl").write_text('\n  null\n{"text": "the cat"}\n')
    code = ("from pathlib import Path; from loom.data.records import open_records; "
            "from loom.data.sources import resolve; from loom.errors import LoomError\n"
            f"try: open_records(resolve({str(tmp_path / 'a.jsonl')!r}), Path({str(tmp_path)!r}))\n"
            "except LoomError as e: print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = f"{tmp_path / 'a.jsonl'} line 2 is null, not a JSON object (a record); fix or remove it"
    assert done.stdout.strip() == said


# ---------------------------------------------------------------- where a record is


def test_a_record_is_named_by_its_file_and_line(tmp_path: Path):
    from loom.data.records import record_places
    from loom.data.sources import resolve

    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "x"}\n\n  \n{"text": "y"}\n')  # blank lines are not records
    (folder / "b.jsonl").write_text('{"text": "z"}\n{"text": "w"}\n')
    place = record_places(resolve(str(folder)))
    assert [place(i) for i in range(4)] == [f"{folder / 'a.jsonl'} line 1", f"{folder / 'a.jsonl'} line 4",
                                            f"{folder / 'b.jsonl'} line 1", f"{folder / 'b.jsonl'} line 2"]
    assert place(9) == f"record 10 of {folder}"
    write_parquet(tmp_path / "p.parquet", [{"text": "a"}] * 3)
    assert record_places(resolve(str(tmp_path / "p.parquet")))(2) == f"row 3 of {tmp_path / 'p.parquet'}"
