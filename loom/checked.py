"""The checked boundary: what loom reads from a file becomes typed, range-checked values here, or
one line naming the file and the field.

Every reader of a file someone else may have written (configs, model folders, checkpoint
metadata, data indexes, traces, device profiles) parses it with `read_json`/`read_toml`/
`read_text` and takes its values through `Fields`, so that a wrong type, a non-finite or
out-of-range number, a missing key or a path that leaves its folder is refused the same way
everywhere, before anything is sized or allocated from it:

    doc = Fields(read_json(path), source=path)
    layers = doc.int("num_hidden_layers", min=1, max=MAX_LAYERS)
    eps = doc.float("rms_norm_eps", default=1e-5, min=0, min_open=True, max=1)
    shard = inside(folder, doc.str("file"), source=path, field="file")

Messages look like `…/config.json: num_hidden_layers must be an integer ≥ 1, got '8' (str)`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loom.errors import LoomError

_MISSING: Any = object()


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kind(value: Any) -> str:
    return type(value).__name__


class BadFile(LoomError):
    """A file's content (its syntax, or a field's type or range) is not what loom can read."""


def read_text(path: Path, source: str | Path | None = None, max_bytes: int | None = None) -> str:
    """A file's text as strict UTF-8; a missing, unreadable, oversized or undecodable file is one line."""
    path = Path(path)
    source = source or path
    try:
        if max_bytes is not None and path.stat().st_size > max_bytes:
            raise BadFile(f"{source} is {path.stat().st_size:,} bytes, more than the {max_bytes:,} a "
                          f"file of this kind can be; it is not the file loom expects")
        data = path.read_bytes()
    except BadFile:
        raise
    except OSError as e:
        raise BadFile(f"{source} could not be read ({e.strerror or type(e).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"{source} is not UTF-8 text (byte {e.start}); it is damaged or not the file "
                      f"loom expects") from None


def parse_json(text: str, source: str | Path) -> Any:
    """JSON text as Python values (NaN/Infinity are read, and refused later where a field must be
    finite); a syntax error or absurd nesting is one line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadFile(f"{source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                      f"it is damaged or not the file loom expects") from None
    except (RecursionError, ValueError) as e:  # nesting too deep; an integer too long to parse
        raise BadFile(f"{source} is not JSON loom can read ({type(e).__name__}); it is damaged or not "
                      f"the file loom expects") from None


def read_json(path: Path, source: str | Path | None = None, max_bytes: int | None = None) -> Any:
    return parse_json(read_text(path, source, max_bytes), source or path)


def read_toml(path: Path, source: str | Path | None = None) -> dict:
    source = source or path
    try:
        return tomllib.loads(read_text(path, source))
    except tomllib.TOMLDecodeError as e:
        raise BadFile(f"{source} is not valid TOML ({e}); fix the syntax at that position") from None


class Fields:
    """A mapping read from `source`, whose values come out only through typed, checked getters.

    `prefix` names where the mapping sits in its file (`weight_map`, `layers[3]`), so that a
    message says `…/x.json: weight_map.w must be …`.
    """

    def __init__(self, raw: Any, source: str | Path, prefix: str = ""):
        self.source, self.prefix = str(source), prefix
        if not isinstance(raw, dict):
            where = f"{prefix} " if prefix else ""
            raise BadFile(f"{self.source}: {where}must be a JSON object (a mapping), got {_kind(raw)}")
        self.raw = raw

    # -- errors -------------------------------------------------------------------------------
    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, must: str, value: Any = _MISSING, fix: str = "") -> BadFile:
        got = "" if value is _MISSING else f", got {_shown(value)} ({_kind(value)})"
        return BadFile(f"{self.source}: {self.name(key)} must be {must}{got}" + (f"; {fix}" if fix else ""))

    def _get(self, key: str, default: Any, must: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if default is _MISSING:
            raise BadFile(f"{self.source}: {self.name(key)} is missing; it must be {must}")
        return default

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def keys(self) -> Iterator[str]:
        return iter(self.raw)

    # -- scalars ------------------------------------------------------------------------------
    def int(self, key: str, default: Any = _MISSING, min: int | None = None, max: int | None = None,
            fix: str = "") -> int:
        must = "an integer" + _range(min, max)
        value = self._get(key, default, must)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, must, value, fix)
        if (min is not None and value < min) or (max is not None and value > max):
            raise self.error(key, must, value, fix)
        return value

    def float(self, key: str, default: Any = _MISSING, min: float | None = None, max: float | None = None,
              min_open: bool = False, fix: str = "") -> float:
        """A finite number (ints are accepted as floats); `min_open` makes `min` exclusive."""
        must = "a finite number" + _range(min, max, min_open)
        value = self._get(key, default, must)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, must, value, fix)
        try:
            number = float(value)
        except OverflowError:
            raise self.error(key, must, value, fix) from None
        if not math.isfinite(number) or (min is not None and (number <= min if min_open else number < min)) \
                or (max is not None and number > max):
            raise self.error(key, must, value, fix)
        return number

    def bool(self, key: str, default: Any = _MISSING, fix: str = "") -> bool:
        must = "true or false"
        value = self._get(key, default, must)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self.error(key, must, value, fix)
        return value

    def str(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] | None = None,
            nonempty: bool = False, fix: str = "") -> str:
        must = ("one of " + ", ".join(map(repr, choices))) if choices else \
            ("a non-empty string" if nonempty else "a string")
        value = self._get(key, default, must)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or (choices and value not in choices) or (nonempty and not value):
            raise self.error(key, must, value, fix)
        return value

    # -- containers ---------------------------------------------------------------------------
    def section(self, key: str, default: Any = _MISSING) -> Fields:
        value = self._get(key, default, "a JSON object (a mapping)")
        if not isinstance(value, dict):
            raise self.error(key, "a JSON object (a mapping)", value)
        return Fields(value, self.source, self.name(key))

    def list(self, key: str, default: Any = _MISSING, of: type | tuple[type, ...] | None = None,
             max_len: int | None = None) -> list:
        must = "a list" + (f" of {_type_names(of)}" if of else "")
        value = self._get(key, default, must)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or (max_len is not None and len(value) > max_len):
            raise self.error(key, must + (f" of at most {max_len} items" if max_len else ""), value)
        if of is not None:
            for item in value:
                if isinstance(item, bool) and bool not in _types(of) or not isinstance(item, of):
                    raise self.error(key, must, value)
        return value

    def items(self, of: Callable[[Fields, str], Any]) -> dict[str, Any]:
        """Every key's value through `of(self, key)` (e.g. `lambda f, k: f.str(k)`)."""
        return {key: of(self, key) for key in self.raw}


def _types(of: type | tuple[type, ...]) -> tuple[type, ...]:
    return of if isinstance(of, tuple) else (of,)


def _type_names(of: type | tuple[type, ...]) -> str:
    names = {"str": "strings", "int": "integers", "float": "numbers", "dict": "objects", "list": "lists"}
    return " or ".join(names.get(t.__name__, t.__name__) for t in _types(of))


def _range(min: float | None, max: float | None, min_open: bool = False) -> str:
    if min is not None and max is not None:
        return f" in {'(' if min_open else '['}{min}, {max}]"
    if min is not None:
        return f" {'>' if min_open else '≥'} {min}"
    if max is not None:
        return f" ≤ {max}"
    return ""


def finite(value: Any, what: str, fix: str = "") -> float:
    """A value that must be a finite number (a CLI flag, a computed field): one line otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise LoomError(f"{what} must be a finite number, got {_shown(value)}" + (f"; {fix}" if fix else ""))
    return float(value)


def inside(folder: Path, name: Any, source: str | Path, field: str, root: Path | None = None) -> Path:
    """`folder / name` for a relative path `name` read from `source`'s `field`: no absolute path, no
    `..`, no `~`, and, symlinks followed, still inside `root` (by default `folder` itself).

    A caller that trusts links within a wider tree passes it as `root`: a Hugging Face cache
    snapshot's files are links into the repository's `blobs/`, two levels up."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise BadFile(f"{source}: {field} must be a file name inside {folder}, got {_shown(name)}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or name.startswith("~"):
        raise BadFile(f"{source}: {field} = {_shown(name)} points outside {folder}; a file it names must "
                      f"be a plain relative name inside that folder")
    path = Path(folder) / rel
    bound = Path(os.path.realpath(root if root is not None else folder))
    if not Path(os.path.realpath(path)).is_relative_to(bound):
        raise BadFile(f"{source}: {field} = {_shown(name)} links outside {folder}; a file it names must "
                      f"stay inside that folder")
    return path


def cause(error: BaseException) -> str:
    """The first line of what went wrong, from the innermost exception a library wrapped, with its
    type (`ZeroDivisionError: division by zero`; a bare Exception's message alone)."""
    for _ in range(32):  # a chain is short; never loop on a cyclic one
        if error.__cause__ is None and error.__context__ is None:
            break
        error = error.__cause__ or error.__context__
    text = (str(error).strip().splitlines() or [""])[0]
    kind = type(error).__name__
    return text if kind == "Exception" and text else f"{kind}: {text}" if text else kind


@contextlib.contextmanager
def translated(what: str, fix: str) -> Iterator[None]:
    """A third-party library's exceptions as one line, `what (cause); fix`, where they enter loom.
    A Rust panic (pyo3's PanicException: tokenizers, safetensors) is a BaseException: caught too."""
    try:
        yield
    except LoomError:
        raise
    except Exception as e:
        raise LoomError(f"{what} ({cause(e)}); {fix}") from None
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit
        raise LoomError(f"{what} (the library panicked: {cause(e)}); {fix}") from None
