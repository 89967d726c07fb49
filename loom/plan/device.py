"""A measured device profile: what `loom plan --calibrate` found this machine does, and lookups the
time model makes in it (pure Python; measuring is loom/observe/calibrate.py).

The profile holds, per number of ranks running at once on the node, rates over grids of shapes;
a lookup interpolates in log space between grid points and clamps at the grid's edges. It lives in
~/.cache/loom/device.json (LOOM_DEVICE_PROFILE names another file).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loom" / "device.json"


def save(profile: DeviceProfile, path: Path | None = None) -> Path:
    path = path or default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(asdict(profile), indent=1).encode())
    return path


def load(path: Path | None = None, required: bool = True) -> DeviceProfile | None:
    path = path or default_path()
    if not path.is_file():
        if not required:
            return None
        raise ConfigError(f"no device profile at {path}; measure this machine first with "
                          f"`loom plan --calibrate` (about a minute)")
    try:
        return DeviceProfile(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"device profile {path} is unreadable ({e}); "
                          f"measure it again with loom plan --calibrate") from None


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
