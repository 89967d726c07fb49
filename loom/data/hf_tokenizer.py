"""Hugging Face tokenizers: a tokenizer.json read by the `tokenizers` library, its EOS token and
chat template (from tokenizer_config.json beside it), and which tokenizer `data.tokenizer` names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loom.data.tokenizer import ByteTokenizer, DocumentTokenizer, token_dtype
from loom.errors import ConfigError, LoomError

# Tried in this order when tokenizer_config.json names no eos_token (or is absent).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_WHAT_TO_GIVE = "give the path of a Hugging Face tokenizer.json (or a model folder holding one), or byte"


def resolve_tokenizer(setting: str, model_dir: Path | None = None) -> str | Path:
    """What `data.tokenizer` (or `loom data prepare --tokenizer`) names: "byte", "bpe", or the Path
    of a tokenizer.json. "auto" is the model folder's tokenizer.json when there is one, else byte."""
    if setting == "auto":
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            return Path(model_dir) / "tokenizer.json"
        return "byte"
    if setting in ("byte", "bpe"):
        return setting
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoomError(f"{path} does not parse as JSON ({_first_line(e)}); fix or remove it") from None
    return config if isinstance(config, dict) else {}


def _chat_template(folder: Path, config: dict) -> str | None:
    """Newer tokenizers save the template as chat_template.jinja; older ones inside the config
    (a string, or a list of named templates of which "default" is the chat one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


class HFTokenizer:
    """A tokenizer.json. Special tokens are never added by encoding (no BOS): documents get the
    EOS between them explicitly, and chat templates write their own special tokens as text."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise LoomError(f"tokenizer '{path}' does not exist; {_WHAT_TO_GIVE}")
        tk = _import_tokenizers()
        raw = path.read_bytes()
        try:
            self._tok = tk.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise LoomError(f"tokenizer '{path}' does not parse as a Hugging Face tokenizer.json "
                            f"({_first_line(e)}); {_WHAT_TO_GIVE}") from None
        config = _read_config(path.parent / "tokenizer_config.json")
        self.name = str(path)
        self.eos_token, self.eos_id = self._find_eos(config, path)
        added = self._tok.get_added_tokens_decoder()
        self.vocab_size: int = max(self._tok.get_vocab_size(with_added_tokens=True),
                                   max(added, default=-1) + 1)
        self.chat_template = _chat_template(path.parent, config)
        self.special_tokens = {key: text for key in ("bos_token", "eos_token", "pad_token", "unk_token")
                               if (text := _token_text(config.get(key)))}
        self.special_tokens["eos_token"] = self.eos_token
        self._dtype = token_dtype(self.vocab_size)
        digest = hashlib.sha256(raw)
        digest.update(f"|eos={self.eos_id}|template={self.chat_template or ''}".encode())
        self.fingerprint = "hf-" + digest.hexdigest()[:20]

    def _find_eos(self, config: dict, path: Path) -> tuple[str, int]:
        named = _token_text(config.get("eos_token"))
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
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Many texts at once: the library encodes them on all cores."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self._dtype) for e in encodings]

    def decode(self, ids: Any) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).ravel().tolist(), skip_special_tokens=False)
