"""Progress on rank 0: a one-line bar (loss, tokens/s, ETA, phase shares), the per-step metrics
file, and the always-on phase timer behind both."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import torch

from loom.checked import BadFile, read_text
from loom.errors import LoomError
from loom.files import atomic_write, open_append


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Redraws one line on a terminal; prints a line every `log_every` steps otherwise (CI, logs)."""

    def __init__(self, total_steps: int, log_every: int, enabled: bool, stream: IO[str] | None = None):
        stream = stream or sys.stderr  # looked up now: sys.stderr may have been replaced since import
        self.total, self.log_every, self.enabled, self.stream = total_steps, log_every, enabled, stream
        self.tty = enabled and stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total - step) if step else 0.0
        width = 24
        filled = int(width * step / self.total)
        bar = "█" * filled + "·" * (width - filled)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} |{bar}| loss {loss:.4f} "
                f"| {tokens_per_s:,.0f} tok/s | ETA {format_duration(eta)}{extra}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")  # erased to its end: a shorter line leaves no tail
            if step == self.total:
                self.stream.write("\n")
        elif step % self.log_every == 0 or step == self.total or step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()


class MetricsFile:
    """RUN_DIR/metrics.jsonl: one JSON object per optimizer step (rank 0 writes it)."""

    def __init__(self, path: Path | None, keep_through_step: int = 0):
        """A resumed run keeps the records up to its checkpoint's step and appends after them
        (a killed run may have logged steps past its last checkpoint: they are trained again)."""
        self.file = None
        if path is None:
            return
        kept = kept_metrics(path, keep_through_step) if keep_through_step else []
        # Rewritten whole, then appended to: a symbolic link planted at the path is replaced, never followed.
        atomic_write(path, "".join(line + "\n" for line in kept).encode())
        self.file = open_append(path)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def kept_metrics(path: Path, through_step: int) -> list[str]:
    """The lines of a metrics.jsonl that a run resumed at `through_step` keeps (none if absent, or
    if a symbolic link stands there: what it points to is not this run's record)."""
    if not path.is_file() or path.is_symlink():
        return []
    try:
        lines = read_text(path).splitlines()
    except BadFile as e:
        raise LoomError(f"{e}; move it aside to resume without the metrics logged so far") from None
    return [line for line in lines if (step := _step_of(line)) is not None and step <= through_step]


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, RecursionError):  # a line cut short by a kill
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class LateRead:
    """A step's device values (loss, grad norm, ...), read on the host a step later without waiting
    for the step queued since: on CUDA they are copied to pinned memory behind the step's own work,
    and the read waits for that copy only (a plain read would wait for everything queued, the next
    step included, and leave the GPU idle while the host prepares the one after)."""

    def __init__(self, values: torch.Tensor):
        self.ready = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.values = values

    def tolist(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()  # this step's work and copy; CUDA events recorded before it too
        return self.values.tolist()


# A pipeline's schedule runs forward and backward interleaved: one "pipeline" phase.
PHASES = ("data", "forward", "backward", "pipeline", "optimizer")


class PhaseTimer:
    """The light ledger, always on: seconds per step in data, forward, backward and optimizer.

    Each phase is also a `record_function` range (`loom/<phase>`) for the profiler. On CPU the
    host clock is the truth; on GPUs the compute phases are timed with CUDA events that are read
    a step later, when they have long completed, so timing adds no device synchronization. Data
    waits are host time on both.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._host: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, object, object]] = []
        # LOOM_LEDGER=off: no timing at all, to measure what the ledger costs (`loom bench`)
        self.enabled = os.environ.get("LOOM_LEDGER", "on") != "off"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with torch.profiler.record_function(f"loom/{name}"):
            if self.cuda and name != "data":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self._host[name] += time.perf_counter() - t0

    def end_step(self) -> tuple[dict[str, float], list]:
        """This step's timings, to `resolve` once the step's values are read back."""
        done = (self._host, self._events)
        self._host, self._events = dict.fromkeys(PHASES, 0.0), []
        return done

    @staticmethod
    def resolve(handle: tuple[dict[str, float], list]) -> dict[str, float]:
        seconds, events = dict(handle[0]), handle[1]
        for name, start, end in events:  # recorded a step ago: complete, so no wait here
            seconds[name] += start.elapsed_time(end) / 1000
        return {f"{name}_s": value for name, value in seconds.items()}


def phase_share(times: dict[str, float]) -> str:
    """' | data 3% fwd 31% bwd 52% opt 14%' for the progress line (phases that ran)."""
    total = sum(times.values())
    if total <= 0:
        return ""
    short = {"data_s": "data", "forward_s": "fwd", "backward_s": "bwd", "pipeline_s": "fwd+bwd",
             "optimizer_s": "opt"}
    return " | " + " ".join(f"{short[k]} {v / total:.0%}" for k, v in times.items() if k in short and v > 0)
