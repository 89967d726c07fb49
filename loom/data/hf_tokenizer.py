"""Hugging Face tokenizers: a tokenizer.json read by the `tokenizers` library, its EOS token and
chat template (from tokenizer_config.json beside it), and which tokenizer `data.tokenizer` names.

Its vocabulary size is its largest id + 1 (the model's ids and the added tokens'), whatever it
reports, so the model's embedding is checked against every id it can give before anything runs;
the library's errors and panics are one line naming the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loom.checked import BadFile, Fields, read_json, read_text, translated
from loom.data.tokenizer import ByteTokenizer, DocumentTokenizer, token_dtype
from loom.errors import ConfigError, LoomError
from loom.hf_config import MAX_VOCAB

# Tried in this order when tokenizer_config.json names no eos_token (or is absent).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_MAX_BYTES = 1 << 30  # the largest tokenizer.json files are tens of MB
_MAX_TEMPLATE_BYTES = 1 << 20  # chat templates are a few KB
_WHAT_TO_GIVE = "give the path of a Hugging Face tokenizer.json (or a model folder holding one), or byte"


def resolve_tokenizer(setting: str, model_dir: Path | None = None) -> str | Path:
    """What `data.tokenizer` (or `loom data prepare --tokenizer`) names: "byte", "bpe", or the Path
    of a tokenizer.json. "auto" is the model folder's tokenizer.json when there is one, else byte."""
    if setting == "auto":
        found = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
        if found is None or not (found.exists() or found.is_symlink()):
            return "byte"
        if not found.is_file():  # a folder, or a link to nothing: never silently the byte tokenizer instead
            raise ConfigError(f"{found} is not a file (a folder, or a link to nothing), so data.tokenizer = "
                              f"auto cannot take the model's tokenizer from it; put the model's "
                              f"tokenizer.json there, or set data.tokenizer (to a tokenizer.json, or byte)")
        return found
    if setting in ("byte", "bpe"):
        return setting
    if not setting.strip():  # Path("") is the working directory
        raise ConfigError(f"tokenizer {setting!r} names no file; {_WHAT_TO_GIVE}")
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer '{setting}' does not exist; {_WHAT_TO_GIVE}")
    return path


def load_document_tokenizer(choice: str | Path) -> DocumentTokenizer:
    """The tokenizer for documents: byte, or a tokenizer.json (bpe trains on a corpus: see corpus.py)."""
    if choice == "byte":
        return ByteTokenizer()
    if isinstance(choice, Path):
        return HFTokenizer(choice)
    raise ConfigError(f"data.tokenizer = '{choice}' trains on the text files of a single data.source; for "
                      f"records, data.mix, SFT or streaming {_WHAT_TO_GIVE}")


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise LoomError("a tokenizer.json needs the tokenizers package; run `pip install tokenizers` "
                        "(or `pip install loom[data]`), or use data.tokenizer = 'byte'") from None
    return tokenizers


def _token_text(doc: Fields, key: str) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken's dict."""
    if key not in doc or doc.raw[key] is None:
        return None
    value = doc.section(key).str("content") if isinstance(doc.raw[key], dict) else doc.str(key)
    return value or None


def _read_config(path: Path) -> Fields:
    return Fields(read_json(path, max_bytes=_MAX_BYTES) if path.is_file() else {}, path)


def _chat_template(folder: Path, config: Fields) -> tuple[str | None, str]:
    """(the template, the file it comes from): newer tokenizers save it as chat_template.jinja;
    older ones inside the config (a string, or a list of named templates of which "default" is the
    chat one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return read_text(jinja, max_bytes=_MAX_TEMPLATE_BYTES), str(jinja)
    if config.raw.get("chat_template") is None:
        return None, ""
    if isinstance(config.raw["chat_template"], list):
        named = {}
        for i, raw in enumerate(config.list("chat_template", of=dict)):
            entry = Fields(raw, config.source, f"chat_template[{i}]")
            named[entry.str("name")] = entry.str("template")
        template = named.get("default") or next(iter(named.values()), None)
    else:
        template = config.str("chat_template")
    if template and len(template) > _MAX_TEMPLATE_BYTES:
        raise BadFile(f"{config.source}: chat_template has {len(template):,} characters, more than a chat "
                      f"template can be ({_MAX_TEMPLATE_BYTES:,})")
    return template or None, config.source


class HFTokenizer:
    """A tokenizer.json. Special tokens are never added by encoding (no BOS): documents get the
    EOS between them explicitly, and chat templates write their own special tokens as text."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise LoomError(f"tokenizer '{path}' does not exist; {_WHAT_TO_GIVE}")
        tk = _import_tokenizers()
        text = read_text(path, max_bytes=_MAX_BYTES)
        self._where = f"tokenizer '{path}'"
        with translated(f"{self._where} does not parse as a Hugging Face tokenizer.json", _WHAT_TO_GIVE):
            self._tok = tk.Tokenizer.from_str(text)
            ids = [*self._tok.get_vocab(with_added_tokens=True).values(),
                   *self._tok.get_added_tokens_decoder()]
        config = _read_config(path.parent / "tokenizer_config.json")
        self.name = str(path)
        self.eos_token, self.eos_id = self._find_eos(config, path)
        # Its largest id + 1, not get_vocab_size() (a count: ids may have gaps or lie beyond it).
        self.vocab_size: int = max(ids, default=-1) + 1
        if not 0 < self.vocab_size <= MAX_VOCAB:
            has = f"token ids up to {self.vocab_size - 1:,}" if ids else "no tokens"
            raise LoomError(f"tokenizer '{path}' has {has}, but a model's vocabulary holds at most "
                            f"{MAX_VOCAB:,}; it is damaged or not a text tokenizer: {_WHAT_TO_GIVE}")
        self.chat_template, self.chat_template_file = _chat_template(path.parent, config)
        self.special_tokens = {key: token for key in ("bos_token", "eos_token", "pad_token", "unk_token")
                               if (token := _token_text(config, key))}
        self.special_tokens["eos_token"] = self.eos_token
        self._dtype = token_dtype(self.vocab_size)
        digest = hashlib.sha256(text.encode("utf-8"))
        digest.update(f"|eos={self.eos_id}|template={self.chat_template or ''}".encode())
        self.fingerprint = "hf-" + digest.hexdigest()[:20]

    def token_id(self, token: str | None) -> int | None:
        """The id of a token's text (None: no such token)."""
        return None if token is None else self._tok.token_to_id(token)

    def _find_eos(self, config: Fields, path: Path) -> tuple[str, int]:
        named = _token_text(config, "eos_token")
        if named is not None:
            eos_id = self._tok.token_to_id(named)
            if eos_id is None:
                raise LoomError(f"tokenizer_config.json beside {path} names eos_token '{named}', which is "
                                f"not in the tokenizer's vocabulary; fix eos_token there")
            return named, eos_id
        for candidate in EOS_CANDIDATES:
            eos_id = self._tok.token_to_id(candidate)
            if eos_id is not None:
                return candidate, eos_id
        raise LoomError(f"tokenizer '{path}' has no EOS token (no eos_token in a tokenizer_config.json "
                        f"beside it, and none of {', '.join(EOS_CANDIDATES)} in its vocabulary); add "
                        f'{{"eos_token": "..."}} to tokenizer_config.json beside it')

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Many texts at once: the library encodes them on all cores."""
        with translated(f"{self._where} failed to encode the text", "it is damaged: give another tokenizer"):
            encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self._dtype) for e in encodings]

    def decode(self, ids: Any) -> str:
        with translated(f"{self._where} failed to decode ids", "decode ids this tokenizer gave"):
            return self._tok.decode(np.asarray(ids, dtype=np.int64).ravel().tolist(),
                                    skip_special_tokens=False)
