"""What a benchmark of `loom bench` is given: the registry it joins (`@bench`), and a Context that
runs loom (or any command) in a subprocess with a time limit, alternates the two sides of a
comparison, and records rows, notes and missed goals into the results, which are saved after
every row (a run cut short still reports).

bench/benchmarks.py and bench/gpu.py define the benchmarks; bench/suite.py (`loom bench`) runs
them and writes what they found. Imports go one way: suite → benchmarks, gpu → harness.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class Bench:
    """One benchmark: `run(ctx)` adds its rows (and notes, plots) to the results."""

    name: str
    title: str
    goal: str
    run: Callable[[Context], None]
    gpu: bool = False  # only under --gpu


REGISTRY: dict[str, Bench] = {}


def bench(name: str, title: str, goal: str, gpu: bool = False):
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        REGISTRY[name] = Bench(name, title, goal, fn, gpu)
        return fn

    return register


@dataclass
class Run:
    """What one `loom train` run left: its summary, memory, plan and per-step metrics."""

    out: Path
    command: str
    summary: dict
    memory: dict
    plan: dict
    metrics: list[dict]

    @property
    def tokens_per_s(self) -> float:
        return self.summary["tokens_per_s"]

    def ledger(self) -> dict[str, float]:
        """The always-on ledger's shares of the steady-state steps (after the first two)."""
        steps = self.metrics[2:] or self.metrics
        sums = {
            p: sum(m.get(f"{p}_s", 0.0) for m in steps)
            for p in ("data", "forward", "backward", "pipeline", "optimizer")
        }
        total = sum(m["step_time_s"] for m in steps) or 1.0
        shares = {p: s / total for p, s in sums.items() if s > 0}
        shares["other"] = max(0.0, 1 - sum(shares.values()))
        return shares


@dataclass
class Pair:
    """A comparison of two sides run alternately: the median of the pairwise ratios and their range."""

    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [x / y for x, y in zip(self.a, self.b)]

    def figure(self) -> dict:
        r = self.ratios
        return {
            "ratio": statistics.median(r),
            "ratio_min": min(r),
            "ratio_max": max(r),
            "pairs": len(r),
            "a_median": statistics.median(self.a),
            "b_median": statistics.median(self.b),
        }


class Progress:
    """One line per finished run, with a bar over the suite's planned runs."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = max(total, 1), 0, time.perf_counter()

    def tick(self, what: str) -> None:
        self.done += 1
        filled = min(24, round(24 * self.done / self.total))
        elapsed = time.perf_counter() - self.start
        print(
            f"|{'█' * filled}{'·' * (24 - filled)}| {self.done}/{self.total} {elapsed / 60:4.1f} min  {what}",
            flush=True,
        )


class Context:
    """What a benchmark needs: run loom or a command, alternate pairs, record rows and notes."""

    def __init__(self, quick: bool, work: Path, results: dict, progress: Progress, out: Path,
                 save: Callable[[], None] | None = None) -> None:
        self.quick, self.work, self.results, self.progress, self.out = quick, work, results, progress, out
        self.save = save or (lambda: None)  # writes the results so far (after every row)
        self.pairs = 2 if quick else 5
        self.bench = ""
        self._runs: dict[tuple, Run] = {}
        self._count = 0

    # --- running -----------------------------------------------------------------------------

    def env(self, **extra: str) -> dict:
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            **extra,
        }

    def folder(self, name: str) -> Path:
        self._count += 1
        path = self.work / f"{self._count:04d}-{name.replace(' ', '-').replace('/', '-')}"
        return path

    def train(
        self,
        sets: list[str],
        nproc: int = 2,
        label: str = "",
        env: dict | None = None,
        command: str = "train",
        cached: bool = False,
        timeout: float | None = None,
    ) -> Run:
        """`loom train --nproc N --set ...` (or `loom profile`); `cached`: reuse an identical run;
        `timeout`: seconds before the run is stopped and counted as failed."""
        key = (command, nproc, tuple(sets), tuple(sorted((env or {}).items())))
        if cached and key in self._runs:
            return self._runs[key]
        out = self.folder(label or command)
        args = [
            "loom",
            command,
            "--nproc",
            str(nproc),
            "--out",
            str(out),
            *[x for s in sets for x in ("--set", s)],
        ]
        done = _run([sys.executable, "-m", "loom.cli", *args[1:]], self.env(**(env or {})), timeout, args)
        if done.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(args)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
            )
        read = lambda name: json.loads((out / name).read_text()) if (out / name).is_file() else {}  # noqa: E731
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        shown = [x if x != str(out) else "RUN" for x in args]  # reproducible: any fresh run directory
        run = Run(
            out, _command(shown, env), read("summary.json"), read("memory.json"), read("plan.json"), metrics
        )
        self._runs[key] = run
        self.progress.tick(f"{self.bench}: {label or ' '.join(sets)}: {run.tokens_per_s:,.0f} tokens/s")
        return run

    def command(self, argv: list[str], label: str, env: dict | None = None, timeout: float | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        """argv run to its end (within `timeout` s); `check`: a non-zero exit is a failure."""
        done = _run(argv, self.env(**(env or {})), timeout, argv)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(argv)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
            )
        self.progress.tick(f"{self.bench}: {label}")
        return done

    def alternate(
        self, side_a: Callable[[], float], side_b: Callable[[], float], pairs: int | None = None
    ) -> Pair:
        """A, B, A, B, ...: drift of the machine hits both sides alike."""
        pair = Pair()
        for _ in range(pairs or self.pairs):
            pair.a.append(side_a())
            pair.b.append(side_b())
        return pair

    # --- recording ---------------------------------------------------------------------------

    def row(self, **fields) -> dict:
        self.results["benches"][self.bench]["rows"].append(fields)
        self.save()
        return fields

    def note(self, text: str) -> None:
        self.results["benches"][self.bench]["notes"].append(text)

    def missed(self, what: str, evidence: str) -> None:
        """A goal not met, with the evidence of why (listed in results.md)."""
        self.results["benches"][self.bench]["missed"].append({"what": what, "evidence": evidence})

    def plot(self, name: str, svg: str) -> None:
        path = self.out / f"results_{name}.svg"
        path.write_text(svg)
        self.results["benches"][self.bench]["plots"].append(path.name)


def _run(argv: list[str], env: dict, timeout: float | None, shown: list[str]) -> subprocess.CompletedProcess:
    """argv in a process group of its own; one that outlives `timeout` seconds is stopped with all
    it started (torchrun's ranks, data workers: nothing left holding a GPU), and fails."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException as e:  # the time limit, or Ctrl-C of the bench itself
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                raise RuntimeError(f"{shlex.join(shown)} did not finish in {timeout:.0f} s") from None
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _command(args: list[str], env: dict | None) -> str:
    prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(args)


def ledger_text(shares: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in shares.items())


