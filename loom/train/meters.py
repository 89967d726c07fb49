"""Progress on rank 0: a one-line bar (loss, tokens/s, ETA) and the per-step metrics file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Redraws one line on a terminal; prints a line every `log_every` steps otherwise (CI, logs)."""

    def __init__(self, total_steps: int, log_every: int, enabled: bool, stream: IO[str] = sys.stderr):
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
            self.stream.write("\r" + line)
            if step == self.total:
                self.stream.write("\n")
        elif step % self.log_every == 0 or step == self.total or step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()


class MetricsFile:
    """RUN_DIR/metrics.jsonl: one JSON object per optimizer step (rank 0 writes it)."""

    def __init__(self, path: Path | None):
        self.file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
