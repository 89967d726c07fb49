"""A measured device profile: what `loom plan --calibrate` found this machine does, and lookups the
time model makes in it (pure Python; measuring is loom/observe/calibrate.py).

The profile holds, per number of ranks running at once on the node, rates over grids of shapes;
a lookup interpolates in log space between grid points and clamps at the grid's edges. It lives in
~/.cache/loom/device.json (LOOM_DEVICE_PROFILE names another file); `load` takes every value
through loom.checked, so a damaged or hand-edited profile is one line naming the field.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loom.checked import BadFile, Fields, read_json
from loom.errors import ConfigError
from loom.files import atomic_write

LINEAR_ROWS = (128, 512, 2048, 8192)  # tokens of a micro-batch
LINEAR_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # √(in·out) of the weight
ATTENTION_SEQS = (128, 512, 2048)
ATTENTION_HEAD_DIMS = (32, 64, 128)
ELEMENTWISE_SIZES = (2**18, 2**22, 2**26)  # bytes of one tensor: in cache, L3-ish, DRAM
COLLECTIVE_SIZES = (2**12, 2**16, 2**20, 2**24)  # payload bytes


def fit_alpha_beta(points: list[tuple[float, float]]) -> dict:
    """t = α + bytes/β over (bytes, seconds), least squares on relative error (weights 1/t²), so
    the small sizes fix α and the large ones β; α, 1/β ≥ 0."""
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sx = sum(wi * b for wi, (b, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, points))
    sxy = sum(wi * b * t for wi, (b, t) in zip(w, points))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    slope = max(slope, 1e-15)
    alpha = max((sy - slope * sx) / sw, 0.0)
    return {"alpha_s": alpha, "bytes_per_s": 1.0 / slope, "points": points}


@dataclass
class DeviceProfile:
    device: str  # cpu | cuda
    name: str
    cores: int
    memory_bytes: int
    torch_version: str
    date: str
    by_ranks: dict[str, dict] = field(default_factory=dict)  # "2": measurements with 2 ranks at once

    def ranks_entry(self, ranks: int) -> dict:
        """The measurements for `ranks` ranks on the node (the nearest count measured)."""
        counts = sorted(int(k) for k in self.by_ranks)
        near = min(counts, key=lambda c: (abs(math.log(c / ranks)), c))
        return self.by_ranks[str(near)]

    def linear_flops(self, ranks: int, rows: float, fan_in: float, fan_out: float) -> float:
        grid = self.ranks_entry(ranks)["linear_flops"]
        return _interpolate_2d(grid, rows, math.sqrt(fan_in * fan_out))

    def attention_flops(self, ranks: int, seq: float, head_dim: float) -> float:
        return _interpolate_2d(self.ranks_entry(ranks)["attention_flops"], seq, head_dim)

    def elementwise_bytes(self, ranks: int, tensor_bytes: float) -> float:
        table = {int(k): v for k, v in self.ranks_entry(ranks)["elementwise_bytes"].items()}
        return _interpolate_1d(table, tensor_bytes)

    def block_elementwise_bytes(self, ranks: int, tensor_bytes: float) -> float:
        """Bytes/s of a decoder block's elementwise work (broadcasts, strides and per-op costs
        included), by the size of one [tokens, d_model] fp32 tensor."""
        table = {int(k): v for k, v in self.ranks_entry(ranks)["block_elementwise_bytes"].items()}
        return _interpolate_1d(table, tensor_bytes)

    def block_in_situ(self, ranks: int, tensor_bytes: float) -> float:
        """How much slower loom's decoder block runs forward + backward as a whole than the sum of
        its parts timed alone (plan/step.block_seconds): the caches and allocator between kernels,
        autograd. Measured on two blocks, by the size of one [tokens, d_model] fp32 tensor; 1 for
        a profile measured before the factor was."""
        table = self.ranks_entry(ranks).get("block_in_situ")
        if not table:
            return 1.0
        return _interpolate_1d({int(k): v for k, v in table.items()}, tensor_bytes)

    def optimizer_seconds(self, ranks: int, params: float) -> float | None:
        """Clipping + AdamW over `params` parameters at the measured rate (None: not measured)."""
        per_param = self.ranks_entry(ranks).get("optimizer_s_per_param")
        return per_param * params if per_param else None

    def op_overhead(self, ranks: int) -> float:
        return self.ranks_entry(ranks)["op_overhead_s"]

    def collective_seconds(self, ranks: int, kind: str, payload: float, count: int) -> float:
        """`count` collectives of `kind` carrying `payload` bytes in all, within the node."""
        fits = self.ranks_entry(ranks)["collectives"]
        fit = fits.get(kind) or fits.get("all_gather" if kind == "broadcast" else "all_reduce")
        if fit is None or count == 0:
            return 0.0
        return count * fit["alpha_s"] + payload / fit["bytes_per_s"]

    def peak_flops(self, ranks: int) -> float:
        """The best rate measured: what MFU divides by on this device."""
        return max(self.ranks_entry(ranks)["linear_flops"].values())

    def describe(self) -> str:
        return f"{self.device} {self.name} ({self.cores} cores), calibrated {self.date}"


def default_path() -> Path:
    env = os.environ.get("LOOM_DEVICE_PROFILE")
    try:
        return Path(env).expanduser() if env else Path.home() / ".cache" / "loom" / "device.json"
    except RuntimeError:  # ~user of no such user, or no home to expand to
        raise ConfigError(f"LOOM_DEVICE_PROFILE={env!r}: its ~ names no home folder; give a full path, "
                          f"e.g. /tmp/device.json") from None


def check_profile_target(path: Path | None = None) -> None:
    """Before a calibration of minutes: its result can be written to `path`, and replaces nothing but a
    device profile (a damaged one included: it is measured again)."""
    path = path or default_path()
    for above in path.parents:
        if above.exists() and not above.is_dir():
            raise ConfigError(f"the device profile {path} cannot be written: {above} is a file, not a "
                              f"folder; point LOOM_DEVICE_PROFILE at a file in a folder")
    if path.is_dir() or (path.exists() and not path.is_file()):
        what = "a folder" if path.is_dir() else "not a regular file (a pipe or a device)"
        raise ConfigError(f"the device profile {path} is {what}; point LOOM_DEVICE_PROFILE at a file such as "
                          f"{path / 'device.json' if path.is_dir() else '/tmp/device.json'}")
    if path.is_file() and path.stat().st_size and b'"by_ranks"' not in path.read_bytes()[:MAX_PROFILE_BYTES]:
        raise ConfigError(f"{path} holds something other than a device profile, which the calibration would "
                          f"replace; point LOOM_DEVICE_PROFILE at a new file, or move that one aside")


def save(profile: DeviceProfile, path: Path | None = None) -> Path:
    """Write the profile, checked as `load` reads it: a measurement gone wrong (a rate of 0 or NaN)
    is refused before it replaces the profile already there."""
    path = path or default_path()
    checked_profile(asdict(profile), "the measured profile")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(asdict(profile), indent=1).encode())
    return path


MAX_PROFILE_BYTES = 16 << 20  # a measured profile is tens of KB
MAX_RANKS = 4096  # ranks on one node that a profile may describe
MAX_RATE = 1e30  # FLOP/s or bytes/s: far above any device, and finite through every product
MAX_SIZE = 1 << 40  # a grid point's size (tokens, elements, bytes)


def load(path: Path | None = None, required: bool = True) -> DeviceProfile | None:
    path = path or default_path()
    if path.exists() and not path.is_file():  # (a folder or a pipe is no profile to measure again into)
        check_profile_target(path)
    if not path.is_file():
        if not required:
            return None
        raise ConfigError(f"no device profile at {path}; measure this machine first with "
                          f"`loom plan --calibrate` (about two minutes; --quick: about 30 s)")
    try:
        return checked_profile(read_json(path, f"device profile {path}", max_bytes=MAX_PROFILE_BYTES),
                               f"device profile {path}")
    except BadFile as e:
        raise BadFile(f"{e}; measure it again with loom plan --calibrate") from None


def checked_profile(raw, source: str) -> DeviceProfile:
    """A profile's JSON as a DeviceProfile whose every lookup finds what it needs: at least one rank
    count, and for each non-empty tables of finite, positive rates over positive sizes."""
    doc = Fields(raw, source)
    by_ranks = doc.section("by_ranks")
    if not by_ranks.raw:
        raise BadFile(f"{source}: by_ranks is empty; it must hold the measurements of at least one "
                      f"rank count")
    entries = {}
    for key in by_ranks.keys():
        _key(by_ranks, key, 1, MAX_RANKS, 'rank counts such as "2"')
        entries[key] = _checked_entry(by_ranks.section(key))
    return DeviceProfile(device=doc.str("device", choices=("cpu", "cuda")), name=doc.str("name"),
                         cores=doc.int("cores", min=1), memory_bytes=doc.int("memory_bytes", min=1),
                         torch_version=doc.str("torch_version", default=""), date=doc.str("date", default=""),
                         by_ranks=entries)


def _checked_entry(entry: Fields) -> dict:
    """One rank count's measurements (older profiles lack block_in_situ and the optimizer's rate)."""
    grids = {"linear_flops": 2, "attention_flops": 2, "elementwise_bytes": 1, "block_elementwise_bytes": 1}
    out = {key: _rates(entry, key, dims) for key, dims in grids.items()}
    out["op_overhead_s"] = entry.float("op_overhead_s", min=0, max=1)
    if "block_in_situ" in entry:
        out["block_in_situ"] = _rates(entry, "block_in_situ", 1)
    if "optimizer_s_per_param" in entry:
        out["optimizer_s_per_param"] = entry.float("optimizer_s_per_param", min=0, max=1)
    if "threads" in entry:
        out["threads"] = entry.int("threads", min=1)
    fits = entry.section("collectives")
    out["collectives"] = {}
    for kind in fits.keys():
        fit = fits.section(kind)
        out["collectives"][kind] = {
            "alpha_s": fit.float("alpha_s", min=0, max=3600),
            "bytes_per_s": fit.float("bytes_per_s", min=0, min_open=True, max=MAX_RATE),
            "points": fit.list("points", default=[])}
    return out


def _rates(entry: Fields, key: str, dims: int) -> dict[str, float]:
    """A table of rates by size (`SIZE`, or `ROWSxSIZE` for a grid): non-empty, positive, finite."""
    table = entry.section(key)
    if not table.raw:
        raise BadFile(f"{table.source}: {table.prefix} is empty; it must hold at least one measured size")
    for name in table.keys():
        _key(table, name, 1, MAX_SIZE, 'sizes such as "128x512"' if dims == 2 else 'sizes such as "4096"',
             dims)
    return table.items(lambda f, k: f.float(k, min=0, min_open=True, max=MAX_RATE))


def _key(table: Fields, name: str, low: int, high: int, what: str, parts: int = 1) -> None:
    """A mapping's key that names `parts` integers in [low, high], joined by x, written plainly
    (lookups rebuild the key from the number: "02" would not be found)."""
    numbers = name.split("x")
    plain = all(len(n) <= 16 and n.isascii() and n.isdigit() and n == str(int(n)) and low <= int(n) <= high
                for n in numbers)
    if len(numbers) != parts or not plain:
        raise BadFile(f"{table.source}: {table.prefix} has the key {name[:20]!r}; its keys must be {what}")


def _grid(table: dict[str, float]) -> dict[tuple[int, int], float]:
    return {tuple(int(v) for v in key.split("x")): rate for key, rate in table.items()}


def _interpolate_1d(table: dict[int, float], x: float) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    i = bisect.bisect_right(keys, x)
    lo, hi = keys[i - 1], keys[i]
    f = math.log(x / lo) / math.log(hi / lo)
    return math.exp((1 - f) * math.log(table[lo]) + f * math.log(table[hi]))


def _interpolate_2d(table: dict[str, float], x: float, y: float) -> float:
    """Interpolate over x (log) of rows each interpolated over y; rows missing large y (skipped as
    too slow) clamp to their largest measured point."""
    grid = _grid(table)
    rows: dict[int, dict[int, float]] = {}
    for (a, b), rate in grid.items():
        rows.setdefault(a, {})[b] = rate
    return _interpolate_1d({a: _interpolate_1d(cols, y) for a, cols in rows.items()}, x)
