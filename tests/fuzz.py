"""Fuzzing loom's readers (Hypothesis): perturb a valid input, and the reader must give a result or
loom's one-line error — never another exception type, never unbounded time or memory.

    @given(doc=perturbed(VALID))
    def test_reader(doc, tmp_path_factory):
        path = write_json(tmp_path_factory.mktemp("f") / "config.json", doc)
        result = must_read(lambda: read_config(path), names=["config.json"])

`perturbed(value)` edits a JSON-like value (dicts, lists, scalars) in one to three places: a
node replaced by a hostile value (wrong type, nan/inf, huge, negative, empty, a path outside its
folder), a key deleted or added. `perturbed_bytes(data)` truncates, flips, inserts or cuts bytes.
`must_read(read)` runs the reader under a time and an address-space bound and returns its result,
or None when it raised a one-line `LoomError`; any other exception fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import resource
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from loom.errors import LoomError

# Hypothesis settings for reader fuzzing: a few hundred examples a test keeps the suite in minutes;
# no deadline (the bound below is the real one), and function-scoped fixtures are fine (a reader
# writes into a fresh folder from tmp_path_factory).
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

HOSTILE_STRINGS = ["", " ", "8", "1e999", "nan", "-1", "true", "false", "null", "../../x.npy", "/abs/x.npy",
                   "~/.ssh/id_rsa", "a/../../b", "é\u0000", "x" * 5000]
HOSTILE_NUMBERS = [0, -1, 1, 2, -(2**63), 2**63, 2**64 + 1, 10**18, 0.5, -0.0, 1e-300, 1e308,
                   math.inf, -math.inf, math.nan]


def hostile() -> st.SearchStrategy:
    """A value a careless or malicious writer could put anywhere in a JSON or TOML file."""
    return st.one_of(
        st.none(), st.booleans(), st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(HOSTILE_STRINGS),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.just([]), st.just({}), st.lists(st.integers(-3, 10**6), max_size=4),
        st.dictionaries(st.text(max_size=5), st.integers(-2, 2), max_size=2),
    )


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _parent(root: Any, path: tuple) -> Any:
    for key in path[:-1]:
        root = root[key]
    return root


@st.composite
def perturbed(draw, value: Any, max_edits: int = 3) -> Any:
    """`value` (JSON-like) with one to `max_edits` hostile edits."""
    value = copy.deepcopy(value)
    for _ in range(draw(st.integers(1, max_edits))):
        path = draw(st.sampled_from(list(_paths(value))))
        op = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if not path:  # the root itself
            if op == "replace":
                value = draw(hostile())
            elif op == "add" and isinstance(value, dict):
                value[draw(st.text(min_size=1, max_size=8))] = draw(hostile())
            continue
        parent, key = _parent(value, path), path[-1]
        if op == "replace":
            parent[key] = draw(hostile())
        elif op == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(hostile())
        else:
            parent.insert(key, draw(hostile()))
    return value


@st.composite
def perturbed_bytes(draw, data: bytes) -> bytes:
    """`data` truncated, with a byte flipped, bytes inserted, or a range cut out."""
    n = len(data)
    op = draw(st.sampled_from(["truncate", "flip", "insert", "cut"]))
    at = draw(st.integers(0, max(n - 1, 0)))
    if op == "truncate":
        return data[:at]
    if op == "flip" and n:
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    if op == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    return data[:at] + data[at + draw(st.integers(1, 64)):]


def write_json(path: Path, value: Any) -> Path:
    """`value` as JSON text (nan/inf written as JSON's common extensions NaN/Infinity, as Python and
    many tools write them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


class Unbounded(Exception):
    """The reader ran past its time bound."""


@contextlib.contextmanager
def bounded(seconds: float = 10.0, extra_bytes: int = 2 << 30) -> Iterator[None]:
    """Fail a reader that runs longer than `seconds` or maps more than `extra_bytes` beyond what the
    process holds now (an allocation sized from a hostile number raises MemoryError here)."""
    def alarm(signum, frame):
        raise Unbounded(f"the reader ran longer than {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, alarm)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + extra_bytes if hard == resource.RLIM_INFINITY else min(mapped + extra_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def one_line(error: LoomError, names: list[str] = ()) -> str:
    """The error's message, checked: one non-empty line that names each of `names` (the file, the
    field) when given."""
    message = str(error)
    assert message.strip() and "\n" not in message.strip(), f"not one line: {message!r}"
    assert "Traceback" not in message, message
    for name in names:
        assert name in message, f"{name!r} is not named in: {message}"
    return message


def must_read(read: Callable[[], Any], names: list[str] = (), seconds: float = 10.0,
              extra_bytes: int = 2 << 30) -> Any:
    """`read()`'s result, or None when it raised loom's one-line error (naming `names`); any other
    exception, or running past the bounds, fails."""
    try:
        with bounded(seconds, extra_bytes):
            return read()
    except LoomError as e:
        one_line(e, names)
        return None
