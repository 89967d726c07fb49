"""torch.profiler Chrome traces: find them in a directory and stream their events.

A rank's trace of a long run is hundreds of MB of pretty-printed JSON, so events are decoded one
at a time with `json.JSONDecoder.raw_decode` over a buffer refilled in chunks (plain or gzip):
memory stays at one chunk plus what the consumer keeps. The top-level keys around `traceEvents`
(`baseTimeNanoseconds`, `distributedInfo`, ...) land in `TraceStream.header` as they are read.

Event `ts` are µs relative to `baseTimeNanoseconds` (Kineto's wall-clock base), so
`TraceStream.absolute_us(ts)` lines different ranks' traces up. A file cut short (a run killed
while writing) yields the events before the cut and records a warning instead of failing. A
trace is machine-written, so anything else wrong once its events have begun — bytes that are not
UTF-8, something other than an event between events, a damaged event followed by more trace, a
header value of the wrong type — is damage: `BadTrace`, one line naming the file (and the event).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loom.checked import BadFile, Fields
from loom.errors import LoomError
from loom.files import RUN_ENTRIES, is_loom_run

CHUNK_CHARS = 1 << 20  # text read per refill
MAX_VALUE_CHARS = 64 << 20  # one JSON value (an event, a header entry) larger than this is malformed
# An event that does not decode with this much text after it is damaged, not cut by the file's end
# (events are well under a KB; a cut one is at the end).
DAMAGE_CHARS = 1 << 20
MAX_NS = 1 << 62  # ns (a base, an event's start, its duration): 146 years; start + duration fits int64
_SKIP = re.compile(r"[\s,]*")  # whitespace and the commas between array items / object members
_WS = re.compile(r"\s*")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_DIGITS = re.compile(r"(\d+)")
# The JSON files a run directory holds besides its traces: what loom train and loom analyze write
_OUTPUTS = ("ledger.json", "compare.json")
RUN_RECORDS = frozenset({*(n for n in RUN_ENTRIES if n.endswith(".json")), *_OUTPUTS})


class BadTrace(LoomError):
    """A trace whose events had begun is damaged: refused, not skipped as a file that is no trace."""


def distributed_info(header: dict, source: str | Path) -> dict:
    """`distributedInfo`'s rank, world_size and pg_count (those present), type-checked."""
    try:
        info = Fields(header.get("distributedInfo", {}), source, "distributedInfo")
        return {k: info.int(k, min=low) for k, low in (("rank", 0), ("world_size", 1), ("pg_count", 0))
                if k in info}
    except BadFile as e:
        raise BadTrace(f"{e}; the trace's header is damaged") from None


@dataclass
class TraceFile:
    path: Path
    name_rank: int | None  # from `rank{N}` / `rank_{N}` / `rank-N` in the file name


def rank_from_name(name: str) -> int | None:
    m = _RANK_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def _natural_key(path: Path) -> list:
    # rank2 before rank10 when ranks come from file order
    return [int(t) if t.isdigit() else t for t in _DIGITS.split(path.name)]


def _trace_files(folder: Path) -> list[Path]:
    # loom analyze's own outputs are no traces (a plain folder of traces is its default --out)
    named = [p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")) and p.name not in _OUTPUTS]
    for p in named:
        _own_regular_file(folder, p)
    return sorted((p for p in named if p.is_file()), key=_natural_key)


def _own_regular_file(folder: Path, path: Path) -> None:
    """A trace of the folder is a regular file in it: a link out of it (to /etc/passwd, say) or a
    FIFO or device is refused before anything is read from it (a folder is skipped)."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(folder.resolve()):
            raise LoomError(f"{path} is a symbolic link to {target}, outside {folder}; loom reads only the "
                            f"trace files in the folder itself: copy the trace in, or remove the link")
    mode = path.stat().st_mode if path.exists() else 0
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise LoomError(f"{path} is not a regular file (a FIFO, a device or a broken link); loom reads "
                        f"traces only from regular files: remove it, or analyze a folder of traces alone")


def find_traces(path: str | Path) -> list[TraceFile]:
    """The Chrome trace files in `path` (a directory, not recursive; or one file), natural order.

    A loom run directory stands for its `traces/` (its own JSON files are not traces)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        sub = path / "traces"
        files = (sub.is_dir() and _trace_files(sub)) or _trace_files(path)
        if _untraced_run(path, files):
            held = ("its traces/ folder holds no trace files" if sub.is_dir()
                    else "no traces/ folder: it trained without the profiler")
            raise LoomError(f"{path} is a loom run directory without traces ({held}); record them with "
                            "loom profile (or loom train --set profile.enabled=true) and analyze that run")
        if not files:
            raise LoomError(f"no trace files (*.json, *.json.gz) in {path}: point at the directory "
                            "torch.profiler's on_trace_ready wrote its Chrome traces to")
    else:
        raise LoomError(f"{path} does not exist: give the directory holding the profiler traces")
    return [TraceFile(p, rank_from_name(p.name)) for p in files]


def _untraced_run(folder: Path, files: list[Path]) -> bool:
    """A run directory of loom's (its marker, or the config.toml and summary.json every run writes)
    whose only JSON files are its own records: read as traces, they would be refused one by one
    as "not a trace" with advice to remove them."""
    run = is_loom_run(folder) or ((folder / "config.toml").is_file() and (folder / "summary.json").is_file())
    return run and all(p.parent == folder and p.name in RUN_RECORDS for p in files)


def refuse_copies(files: list[TraceFile]) -> None:
    """Each rank's trace is its own: a file with the same bytes as another is a copy, which would be
    analyzed as one more rank. Only files of equal size are read (traces of real ranks never are)."""
    by_size: dict[int, list[Path]] = {}
    for f in files:
        by_size.setdefault(f.path.stat().st_size, []).append(f.path)
    for same in (paths for paths in by_size.values() if len(paths) > 1):
        seen: dict[str, Path] = {}
        for path in same:
            with path.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest in seen:
                raise LoomError(f"{path} is a copy of {seen[digest]} (the same bytes), not another rank's "
                                "trace; remove the copy and give each rank's own trace")
            seen[digest] = path


class TraceStream:
    """Iterate a Chrome trace's `traceEvents` one dict at a time without loading the file.

    After (or during) iteration: `header` holds the other top-level keys read so far,
    `warnings` what was wrong but survivable (a truncated file), `count` the events yielded.
    Also accepts Chrome's bare-array form (`[{...}, ...]`).
    """

    def __init__(self, path: str | Path, chunk_chars: int = CHUNK_CHARS):
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.header: dict = {}
        self.warnings: list[str] = []
        self.count = 0
        self.truncated = False
        self._events_started = False
        self._decode = json.JSONDecoder().raw_decode

    # -- header values -------------------------------------------------------------------
    @property
    def base_ns(self) -> int:
        try:
            return Fields(self.header, self.path).int("baseTimeNanoseconds", default=0, min=0, max=MAX_NS)
        except BadFile as e:
            raise BadTrace(f"{e}; the trace's header is damaged") from None

    def absolute_us(self, ts: float) -> float:
        """`ts` (µs relative to the trace's base) as µs since the epoch, comparable across ranks."""
        return ts + self.base_ns / 1000

    @property
    def distributed_rank(self) -> int | None:
        return distributed_info(self.header, self.path).get("rank")

    # -- streaming -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        try:
            with _Text(self.path, gz=self.path.name.endswith(".gz")) as f:
                yield from self._events(f)
        except EOFError as e:  # gzip stream cut short
            self._truncated(str(e))
        except _NotUTF8 as e:
            if not self._events_started and not self.path.name.endswith(".gz") and _gzipped(self.path):
                raise LoomError(f"{self.path} is gzip-compressed but not named .gz (a .json.gz trace "
                                f"renamed?): rename it to {self.path.name}.gz") from None
            self._damaged(f"byte {e.offset:,} is not UTF-8 text (after {self.count} events)")
        except zlib.error as e:
            if self._events_started:
                self._damaged(f"its gzip stream is corrupt after {self.count} events ({e})")
            raise LoomError(f"{self.path} is not a gzip file ({e}): rename it to .json if it is plain "
                            "JSON, or give a torch.profiler trace") from None
        except OSError as e:
            raise LoomError(f"cannot read {self.path}: {e}") from None

    def _truncated(self, why: str) -> None:
        if not self._events_started:
            raise LoomError(f"{self.path} ends before its traceEvents ({why}): the file is truncated "
                            "or not a torch.profiler trace")
        self.truncated = True
        self.warnings.append(f"{self.path.name}: truncated after {self.count} events ({why}); "
                             "analyzed the events before the cut")

    def _events(self, f) -> Iterator[dict]:
        self._f, self._buf, self._i, self._eof = f, "", 0, False
        self._events_started = False
        c = self._peek(_WS)
        if c is None:
            raise LoomError(f"{self.path} is empty: give torch.profiler's export_chrome_trace output")
        if c == "[":  # bare array of events
            self._i += 1
            self._events_started = True
            yield from self._array()
            return
        if c != "{":
            raise LoomError(f"{self.path} is not a JSON trace "
                            f"(starts with {self._buf[self._i:self._i + 20]!r}): "
                            "give torch.profiler's export_chrome_trace output")
        self._i += 1
        found = False
        while True:
            c = self._peek(_SKIP)
            if c is None:
                self._truncated("file ends inside the top-level object")
                return
            if c == "}":
                break
            key = self._value()
            if key is _TRUNCATED:
                return
            if not isinstance(key, str):
                self._malformed(f"a top-level key is {type(key).__name__}, not a string")
            if self._peek(_WS) != ":":
                if self._eof and self._i >= len(self._buf):
                    self._truncated("file ends after a key")
                    return
                self._malformed("expected ':' after a key")
            self._i += 1
            if key == "traceEvents":
                found = True
                if self._peek(_WS) != "[":
                    self._malformed("traceEvents is not an array")
                self._i += 1
                self._events_started = True
                yield from self._array()
                if self.truncated:
                    return
            else:
                value = self._value()
                if value is _TRUNCATED:
                    return
                self.header[key] = value
        if not found:
            keys = ", ".join(list(self.header)[:6]) or "none"
            raise LoomError(f"{self.path} is JSON but has no traceEvents (keys: {keys}): not a "
                            "torch.profiler Chrome trace; remove it or point at the trace directory")

    def _array(self) -> Iterator[dict]:
        decode, skip = self._decode, _SKIP.match
        while True:
            buf, i = self._buf, skip(self._buf, self._i).end()
            if i < len(buf) and buf[i] == "]":
                self._i = i + 1
                return
            if i < len(buf) and buf[i] != "{":
                self._i = i
                self._malformed(f"{buf[i:i + 20]!r} where event {self.count} should start")
            if i < len(buf):
                try:
                    ev, j = decode(buf, i)
                    if j < len(buf):  # an object ends at its '}': complete even at the buffer end
                        self._i = j
                        self.count += 1
                        yield ev
                        continue
                except json.JSONDecodeError as e:
                    if len(buf) - e.pos > DAMAGE_CHARS:
                        self._malformed(f"event {self.count} is not valid JSON ({e.msg})")
                except (RecursionError, ValueError) as e:  # absurd nesting; an integer too long to read
                    self._malformed(f"event {self.count} is not JSON loom can read ({type(e).__name__})")
            self._i = i
            if self._eof:
                self._truncated("file ends inside traceEvents" if i >= len(buf) else "last event cut")
                return
            if len(buf) - i > MAX_VALUE_CHARS:
                self._malformed(f"event {self.count} is over 64 MB: not a trace event")
            self._fill()

    def _value(self):
        """Decode one whole JSON value at the cursor, refilling until it is complete."""
        while True:
            self._peek(_WS)
            buf, i = self._buf, self._i
            try:
                value, j = self._decode(buf, i)
                if j < len(buf) or self._eof:  # a number at the buffer end may continue
                    self._i = j
                    return value
            except json.JSONDecodeError as e:
                if self._eof:
                    self._truncated(e.msg)
                    return _TRUNCATED
            except (RecursionError, ValueError) as e:
                self._malformed(f"a top-level value is not JSON loom can read ({type(e).__name__})")
            if len(buf) - i > MAX_VALUE_CHARS:
                self._malformed("a top-level value over 64 MB")
            self._fill()

    def _peek(self, pattern: re.Pattern) -> str | None:
        """Skip `pattern` at the cursor; the next character (None at end of file)."""
        while True:
            self._i = pattern.match(self._buf, self._i).end()
            if self._i < len(self._buf):
                return self._buf[self._i]
            if self._eof:
                return None
            self._fill()

    def _fill(self) -> None:
        chunk = self._f.read(self.chunk_chars)
        self._buf = self._buf[self._i:] + chunk
        self._i = 0
        if not chunk:
            self._eof = True

    def _malformed(self, what: str) -> None:
        if self._events_started:
            self._damaged(what)
        raise LoomError(f"{self.path} is not a valid Chrome trace: {what}")

    def _damaged(self, what: str) -> None:
        if not self._events_started:
            raise LoomError(f"{self.path} is not a torch.profiler trace: {what}")
        raise BadTrace(f"{self.path} is a damaged trace: {what}; profile the run again or remove the file")


_TRUNCATED = object()


def _gzipped(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"  # gzip's magic number


class _NotUTF8(Exception):
    def __init__(self, offset: int):
        self.offset = offset


class _Text:
    """A file's text read incrementally as strict UTF-8, gzip decompressed on the way. A cut gzip
    stream yields everything before the cut, then EOFError (gzip.open would lose its last buffered
    block); a character cut by the end of a file is dropped, so the JSON before it reads as cut."""

    def __init__(self, path: Path, gz: bool):
        self._f = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        self._z = zlib.decompressobj(wbits=31) if gz else None
        self._text = codecs.getincrementaldecoder("utf-8")()
        self._cut = False
        self._bytes = 0  # bytes of text handed to the decoder so far
        self._bad: int | None = None  # the offset of a byte that is not UTF-8, once reached

    def read(self, n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            if self._cut or self._bad is not None:
                if size:
                    break  # hand over what came before the cut or the bad byte; the next read raises
                if self._bad is not None:
                    raise _NotUTF8(self._bad)
                raise EOFError("compressed stream ends early")
            raw = self._f.read(1 << 16)
            if not raw:
                self._cut = self._z is not None and not self._z.eof
                if not self._cut:
                    break
                continue
            data = self._inflate(raw) if self._z is not None else raw
            pending = self._text.getstate()[0]
            try:
                text = self._text.decode(data)
            except UnicodeDecodeError as e:  # the text before it is read first, as a cut is
                self._bad = self._bytes - len(pending) + e.start
                text = (pending + data)[:e.start].decode("utf-8")
            self._bytes += len(data)
            out.append(text)
            size += len(text)
        return "".join(out)

    def _inflate(self, raw: bytes) -> bytes:
        data = self._z.decompress(raw)
        while self._z.eof and self._z.unused_data:  # concatenated gzip members
            rest = self._z.unused_data
            self._z = zlib.decompressobj(wbits=31)
            data += self._z.decompress(rest)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()
