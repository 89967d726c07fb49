"""torchrun as loom's launcher runs it (`python -m loom.train.torchrun ARGS`: torch.distributed.run's own
arguments), its agent's log kept in the run folder.

A rank that dies while a restart is left is routine: torchrun restarts the group, which resumes
from the latest checkpoint. torchrun's agent logs it as warnings and errors (the dead and the
stopped processes) and each surviving rank prints the traceback of its broken collective: dozens
of lines on the console. Here the agent's whole log goes to RUN/logs/torchrun.log, the ranks'
tracebacks to RUN/logs/rank<R>.attempt<K>.log (loom/launch.py `keep_for_restart`), and the
console gets one line per restart. A failure with no restart left is shown as before.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from loom.errors import LoomError
from loom.files import open_append
from loom.launch import AGENT_LOG_ENV

ELASTIC = "torch.distributed.elastic"


def the_dead(failures: dict[int, int]) -> dict[int, int]:
    """The ranks that failed first, of a failed group's {rank: exit code (-N: signal N)}: the agent
    stops the rest with SIGTERM, and a rank whose peer died raises (exit code 1), so a rank ended by
    any other signal is the cause; without one, every rank that exited on its own."""
    own = {r: c for r, c in failures.items() if c != -signal.SIGTERM}
    return {r: c for r, c in own.items() if c < 0} or own or failures


def _how(code: int) -> str:
    names = {s.value: s.name for s in signal.Signals}
    return f"signal {-code}, {names[-code]}" if -code in names else f"exit code {code}"


def restart_line(failures: dict[int, int], restart: int, restarts: int, run_dir: Path) -> str:
    """The console's line for a restart: who died of what, where the group resumes, which restart."""
    from loom.train.checkpoint import latest_checkpoint

    dead = ", ".join(f"rank {r} died ({_how(c)})" for r, c in sorted(the_dead(failures).items()))
    try:
        latest = latest_checkpoint(run_dir) if run_dir.is_dir() else None
        where = f"from {latest.name}" if latest is not None else "from the start (no checkpoint yet)"
    except (LoomError, OSError):  # the restarted ranks' resume says what is wrong with it
        where = "from the latest checkpoint"
    return f"loom: {dead}; restarting {where}, restart {restart} of {restarts} (details: {run_dir / 'logs'})"


class AgentLog(logging.Handler):
    """The agent's records: all to the log file; to the console, those of WARNING and above except
    the processes' failures and stops while a restart is left (restart_line says it in one)."""

    def __init__(self, log_file: Path, restarts: int, console: list[logging.Handler]) -> None:
        super().__init__(logging.INFO)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        # appended across the run's launches; a planted link is refused, not followed
        self.file = logging.StreamHandler(open_append(log_file, inside=log_file.parent.parent))
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.run_dir = log_file.parent.parent
        self.restarts_left, self.console = restarts, console
        self.failures: dict[int, int] = {}  # the latest failed group's {rank: exit code}

    def note(self, message: str) -> None:
        """A line of loom's own in the log."""
        self.file.handle(logging.makeLogRecord({"msg": message, "levelno": logging.WARNING,
                                                "levelname": "WARNING", "name": "loom"}))

    def emit(self, record: logging.LogRecord) -> None:
        self.file.handle(record)
        if record.levelno < logging.WARNING:
            return
        if self.restarts_left > 0 and record.name.startswith(f"{ELASTIC}.multiprocessing"):
            return  # the dead and the stopped processes of a group about to restart
        for handler in self.console:
            handler.handle(record)


def _console(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record of `logger` would reach through its parents (torch's own, on stderr)."""
    found, node = [], logger.parent
    while node is not None:
        found += node.handlers
        if not node.propagate:
            break
        node = node.parent
    return found or [logging.lastResort]


def keep_agent_log(argv: list[str]) -> AgentLog | None:
    """Route the elastic agent's loggers through AgentLog (their console handlers were torch's)."""
    path = os.environ.get(AGENT_LOG_ENV)
    if not path:
        return None
    restarts = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--max-restarts=")), 0)
    top = logging.getLogger(ELASTIC)
    try:
        log = AgentLog(Path(path), restarts, _console(top))
    except (LoomError, OSError) as e:  # torchrun runs as it would without loom
        print(f"loom: torchrun's log stays on the console: {e}", file=sys.stderr, flush=True)
        return None
    top.addHandler(log)
    top.propagate = False  # the console sees what AgentLog passes on, once
    for name in list(logging.root.manager.loggerDict):
        if name == ELASTIC or name.startswith(f"{ELASTIC}."):
            logging.getLogger(name).setLevel(logging.INFO)  # each set its own level (WARNING)
    return log


def announce_restarts(log: AgentLog) -> None:
    """The agent's view of a failed group (its monitor's result) and of each restart, for the one
    line: wraps two of LocalElasticAgent's steps (private, so only when they are there)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor, restart = (getattr(LocalElasticAgent, n, None) for n in ("_monitor_workers", "_restart_workers"))
    if monitor is None or restart is None:
        return

    def _monitor_workers(self, group):
        result = monitor(self, group)
        failures = getattr(result, "failures", None) or {}
        if failures:
            log.failures = {rank: f.exitcode for rank, f in failures.items()}
        return result

    def _restart_workers(self, group):
        left, total = getattr(self, "_remaining_restarts", 0), group.spec.max_restarts
        if log.failures:  # (not a restart for a node joining)
            line = restart_line(log.failures, total - left, total, log.run_dir)
            print(line, file=sys.stderr, flush=True)
            log.note(f"{line}; every rank's exit code (-N: signal N): {log.failures}")
            log.failures = {}
        log.restarts_left = left
        return restart(self, group)

    LocalElasticAgent._monitor_workers = _monitor_workers
    LocalElasticAgent._restart_workers = _restart_workers


def main() -> None:
    from torch.distributed import run

    log = keep_agent_log(sys.argv[1:])
    if log is not None:
        announce_restarts(log)
    run.main()


if __name__ == "__main__":
    main()
