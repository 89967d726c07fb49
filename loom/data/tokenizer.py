"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained on the corpus and cached on disk."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from loom.checked import translated
from loom.data.cache_files import write_cache
from loom.errors import ConfigError, LoomError
from loom.hf_config import MAX_VOCAB

# Bump when the training recipe changes, so stale cached tokenizers are not reused.
_BPE_FORMAT = "loom-bpe-v1"

TextsOrFiles = str | Path | Sequence[str | Path]


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Any) -> str: ...


class DocumentTokenizer(Tokenizer, Protocol):
    """What tokenizing documents (records, SFT examples, `loom data prepare`) needs of a tokenizer."""

    name: str  # for messages and the run's description
    fingerprint: str  # changes whenever the ids it gives could change (keys the token caches)
    eos_id: int  # ends every document, so a window that crosses documents sees where one ends
    chat_template: str | None  # a Jinja chat template (SFT `messages`), or None
    chat_template_file: str  # the file it comes from (for messages), or ""
    special_tokens: dict[str, str]  # bos_token, eos_token, ... for the chat template

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below vocab_size."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def default_cache_dir() -> Path:
    """Where trained tokenizers live when the caller gives no cache_dir."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loom" / "tokenizers"


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no files, vocab of 256.

    It has no EOS token, so documents of records end with the NUL byte (id 0), which text
    does not contain; text files keep being joined by a newline (load_tokens).
    """

    vocab_size = 256
    name = "byte"
    fingerprint = "byte"
    eos_id = 0
    chat_template: str | None = None
    chat_template_file = ""
    special_tokens: dict[str, str] = {}

    def encode(self, text: str) -> np.ndarray:
        # frombuffer avoids a Python-level loop; uint16 leaves room for the shared token dtype.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Any) -> str:
        data = np.asarray(ids, dtype=np.int64).ravel()
        if data.size and (data.min() < 0 or data.max() > 255):
            raise LoomError(f"byte tokenizer got token ids outside 0..255 (min {data.min()}, "
                            f"max {data.max()}); decode ids produced by the byte tokenizer")
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _as_items(texts_or_files: TextsOrFiles) -> list[str | Path]:
    """A Path item is a file to read, a str item is text; a single one is wrapped in a list."""
    if isinstance(texts_or_files, (str, Path)):
        return [texts_or_files]
    return list(texts_or_files)


def _read_text(item: str | Path) -> str:
    if isinstance(item, Path):
        return item.read_text(encoding="utf-8", errors="replace")
    return item


def _cache_key(items: list[str | Path], vocab_size: int) -> str:
    """Files are keyed by path, size and mtime (cheap); texts by their content."""
    h = hashlib.sha256(f"{_BPE_FORMAT}|vocab={vocab_size}".encode())
    for item in items:
        if isinstance(item, Path):
            st = item.stat()
            h.update(f"|file:{item.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        else:
            h.update(b"|text:" + hashlib.sha256(item.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()[:20]


# A lone newline between a visible ASCII char and a letter or '#' is a pre-token of its own, so
# cutting right after it leaves the BPE ids unchanged (merges never cross pre-token boundaries).
_SAFE_CUT = re.compile(r"(?<=[!-~])\n(?=[A-Za-z#])")


def _chunks(text: str, target: int = 1 << 16) -> list[str]:
    """Split text into pieces of about `target` chars at pre-token boundaries."""
    pieces: list[str] = []
    start = 0
    while start < len(text):
        m = _SAFE_CUT.search(text, start + target)
        end = m.end() if m else len(text)
        pieces.append(text[start:end])
        start = end
    return pieces


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise LoomError("data.tokenizer = 'bpe' needs the tokenizers package; "
                        "run `pip install tokenizers` (or `pip install loom[bpe]`), or use "
                        "data.tokenizer = 'byte'") from None
    return tokenizers


class BPETokenizer:
    """Byte-level BPE trained with HF `tokenizers`; the trained model is cached as JSON.

    `loaded_from_cache` tells whether this instance skipped training.
    """

    def __init__(self, texts_or_files: TextsOrFiles, vocab_size: int, cache_dir: Path | None = None) -> None:
        if vocab_size <= 256:
            raise ConfigError(f"data.bpe_vocab_size={vocab_size} is too small for a byte-level BPE "
                              "(256 bytes are the base alphabet); use a value above 256 such as 512, or "
                              "data.tokenizer = 'byte'")
        if vocab_size > MAX_VOCAB:  # the trainer allocates for it up front: Rust aborts on failure
            raise ConfigError(f"data.bpe_vocab_size={vocab_size:,} is more than any model's vocabulary (at "
                              f"most {MAX_VOCAB:,}); use e.g. 32768")
        tk = _import_tokenizers()
        items = _as_items(texts_or_files)
        if not items:
            raise LoomError("BPE tokenizer got no training text; give a corpus with at least one "
                            "non-empty file")
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_path = cache_dir / f"bpe-{vocab_size}-{_cache_key(items, vocab_size)}.json"
        if self.cache_path.exists():
            with translated(f"the cached tokenizer {self.cache_path} does not load",
                            "delete it (loom trains it again)"):
                self._tok = tk.Tokenizer.from_file(str(self.cache_path))
            self.loaded_from_cache = True
        else:
            with translated(f"training the BPE tokenizer (data.bpe_vocab_size={vocab_size}) failed",
                            "use a smaller data.bpe_vocab_size, or data.tokenizer = 'byte'"):
                self._tok = self._train(tk, items, vocab_size)
            write_cache(self.cache_path, self._tok.to_str().encode("utf-8"))
            self.loaded_from_cache = False
        self.vocab_size: int = self._tok.get_vocab_size()

    @staticmethod
    def _train(tk: Any, items: list[str | Path], vocab_size: int) -> Any:
        tok = tk.Tokenizer(tk.models.BPE())
        # add_prefix_space=False keeps decode(encode(text)) == text exactly.
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
            special_tokens=[],
            show_progress=False,
        )
        texts = [_read_text(item) for item in items]
        if not any(texts):
            raise LoomError("BPE tokenizer got only empty text; give a corpus with at least one "
                            "non-empty file")
        tok.train_from_iterator(texts, trainer=trainer)
        return tok

    def encode(self, text: str) -> np.ndarray:
        # One huge string encodes on a single thread; chunks encode in parallel with the same ids.
        encodings = self._tok.encode_batch(_chunks(text))
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        parts = [np.asarray(e.ids, dtype=dtype) for e in encodings]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def decode(self, ids: Any) -> str:
        ids_list = np.asarray(ids, dtype=np.int64).ravel().tolist()
        return self._tok.decode(ids_list, skip_special_tokens=False)


def make_tokenizer(kind: str, texts_or_files: TextsOrFiles, vocab_size: int,
                   cache_dir: Path | None = None) -> ByteTokenizer | BPETokenizer:
    """kind 'byte' ignores the corpus; kind 'bpe' trains on it (or loads the cached result)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(texts_or_files, vocab_size, cache_dir)
    raise ConfigError(f"data.tokenizer '{kind}' is unknown; use 'byte' or 'bpe'")
