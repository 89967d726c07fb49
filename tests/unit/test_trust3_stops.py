"""Every stop saves (issue 38): data-loader workers leave the stop signals to their trainer, one
Ctrl-C delivered twice is one, and `loom profile --nproc 1` analyzes what it traced."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from in_process import world_of_one

import loom.cli
from loom.data.loader import WORKER_IGNORES, GlobalBatchSampler, Loader, make_loader
from loom.launch import AGENT_LOG_ENV, SAME_CTRL_C_S, aborts, keep_for_restart
from loom.train import stop
from loom.train.torchrun import AgentLog, keep_agent_log, restart_line, the_dead

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "train.log_every=100", "train.eval_batches=0", "train.ckpt_every_min=0"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def test_profile_of_one_process_writes_the_ledger_report_and_findings(tmp_path, corpus, capsys):
    """A world of one sets RANK in this process: the profile command must still know it launched
    the run (it did not join one), and analyze the traces."""
    run = tmp_path / "run"
    sets = [*TINY, f'data.source="{corpus}"', "train.steps=4", "profile.wait=0", "profile.warmup=1",
            "profile.active=2"]
    with world_of_one():
        rc = loom.cli.main(["profile", "--nproc", "1", "--out", str(run), *_sets(sets)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [p.name for p in (run / "traces").glob("*.json.gz")] == ["rank0.json.gz"]
    assert f"ledger: {run / 'ledger.json'}" in out and f"report: {run / 'report.html'}" in out
    assert "\nfindings:" in out
    assert (run / "ledger.json").is_file() and (run / "report.html").is_file()


@pytest.fixture
def clock(monkeypatch):
    """stop.py's clock, set by the test; os._exit raising Aborted instead of ending pytest."""
    now = [100.0]
    monkeypatch.setattr(stop, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(stop, "_received", 0)
    monkeypatch.setattr(stop, "_received_at", 0.0)

    def exit_(code):
        raise Aborted(code)

    monkeypatch.setattr(stop.os, "_exit", exit_)
    return now


class Aborted(Exception):
    pass


def test_one_ctrl_c_delivered_twice_is_one_and_a_later_one_aborts(clock):
    stop._record(signal.SIGINT, None)
    clock[0] += 0.05  # `timeout`'s copy of the terminal's Ctrl-C
    stop._record(signal.SIGINT, None)
    assert stop._received == signal.SIGINT  # a stop request, no abort
    clock[0] += SAME_CTRL_C_S  # a person pressing it again
    with pytest.raises(Aborted) as aborted:
        stop._record(signal.SIGINT, None)
    assert aborted.value.args == (130,)


def test_only_a_ctrl_c_aborts_and_the_window_counts_from_the_first_signal(clock):
    stop._record(signal.SIGTERM, None)
    clock[0] += 0.5
    stop._record(signal.SIGINT, None)  # within the window of the first
    clock[0] += 60
    stop._record(signal.SIGTERM, None)  # a SIGTERM never aborts
    assert stop._received == signal.SIGTERM
    with pytest.raises(Aborted):
        stop._record(signal.SIGINT, None)


@pytest.mark.parametrize("signum, after, abort", [
    (signal.SIGINT, 0.0, False), (signal.SIGINT, 0.999, False), (signal.SIGINT, 1.0, True),
    (signal.SIGINT, 30.0, True), (signal.SIGTERM, 30.0, False), (signal.SIGUSR1, 30.0, False),
])
def test_the_launchers_rule_for_a_signal_after_the_first(signum, after, abort):
    assert SAME_CTRL_C_S == 1.0
    assert aborts(signum, 50.0, 50.0 + after) is abort


STOPS = (*WORKER_IGNORES, signal.SIGTERM)  # every stop signal the trainer handles


class _SignalledWindows(torch.utils.data.Dataset):
    """Windows whose worker gets each stop signal (from itself: not its trainer) as it loads the
    first, as a process group's would."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 or torch.utils.data.get_worker_info() is None:
            for sig in STOPS:
                os.kill(os.getpid(), sig)
        return torch.tensor([os.getpid(), i])


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_data_loader_worker_outlives_the_stop_signals_its_trainer_handles(stream):
    assert set(STOPS) == {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
    if stream:
        loader = Loader(_SignalledStream(), batch_size=None, num_workers=1)
    else:
        loader = make_loader(_SignalledWindows(), GlobalBatchSampler(8, 4, 0, 1, 1, 0, num_steps=2),
                             num_workers=1, prefetch_factor=1, pin_memory=False)
    batches = list(loader)  # a worker killed by a signal: RuntimeError "DataLoader worker … is killed"
    assert len(batches) == 2
    assert {int(p) for b in batches for p in b[:, 0]} != {os.getpid()}  # loaded in a worker


def test_a_script_leaving_a_loader_running_exits():
    """Python's exit ends a live loader's daemonic workers with SIGTERM and waits for them: they must
    die of it (a worker ignoring every SIGTERM hung the interpreter's exit for good)."""
    script = (
        "import torch\n"
        "from loom.data.loader import GlobalBatchSampler, make_loader\n"
        "data = torch.arange(64).reshape(16, 4)\n"
        "loader = make_loader(data, GlobalBatchSampler(16, 4, 0, 1, 1, 0, num_steps=4), num_workers=2,\n"
        "                     prefetch_factor=1, pin_memory=False)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "import sys; sys.modules['__main__'].kept = it  # never shut down: ended at exit\n"
        "print('ok', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


class _SignalledStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for step in range(2):
            yield torch.stack([_SignalledWindows()[2 * step + j] for j in range(2)])


@pytest.mark.parametrize("failures, dead", [
    ({0: 1, 1: -9}, {1: -9}),  # rank 1 killed; rank 0's collective broke (exit code 1)
    ({0: -15, 1: -9}, {1: -9}),  # rank 0 stopped by the agent
    ({0: 1, 1: -15}, {0: 1}),  # rank 0 raised on its own
    ({0: -15, 1: -15}, {0: -15, 1: -15}),  # every rank stopped: the agent's own SIGTERM names no one
    ({0: -6, 1: -9, 2: 1}, {0: -6, 1: -9}),
])
def test_the_ranks_a_restart_names(failures, dead):
    assert the_dead(failures) == dead


def test_the_restart_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert restart_line({0: 1, 1: -9}, 1, 2, run) == (
        f"loom: rank 1 died (signal 9, SIGKILL); restarting from the start (no checkpoint yet), "
        f"restart 1 of 2 (details: {run}/logs)")
    (run / "checkpoints" / "step_4").mkdir()
    assert restart_line({3: 2, 1: -11}, 2, 2, run) == (
        f"loom: rank 1 died (signal 11, SIGSEGV); restarting from step_4, restart 2 of 2 "
        f"(details: {run}/logs)")
    assert restart_line({3: 2, 0: 1}, 1, 1, run).startswith(
        "loom: rank 0 died (exit code 1), rank 3 died (exit code 2); restarting from step_4")


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.makeLogRecord({"name": f"torch.distributed.elastic.{name}", "levelno": level,
                                  "levelname": logging.getLevelName(level), "msg": message})


def test_the_agents_log_keeps_everything_and_the_console_not_a_restarting_groups_failures(tmp_path):
    console = _Kept()
    log = AgentLog(tmp_path / "run" / "logs" / "torchrun.log", 1, [console])
    log.handle(_record("agent.server.api", logging.INFO, "starting workers"))
    log.handle(_record("multiprocessing.api", logging.WARNING, "Sending process 7 closing signal SIGTERM"))
    log.handle(_record("multiprocessing.api", logging.ERROR, "failed (exitcode: -9) local_rank: 1"))
    log.handle(_record("rendezvous.dynamic_rendezvous", logging.WARNING, "the store is slow"))
    log.restarts_left = 0  # the last attempt: its failure is the run's, shown as torchrun shows it
    log.handle(_record("multiprocessing.api", logging.ERROR, "failed (exitcode: 1) local_rank: 0"))
    log.note("loom: a line of loom's own")
    assert console.messages == ["the store is slow", "failed (exitcode: 1) local_rank: 0"]
    text = (tmp_path / "run" / "logs" / "torchrun.log").read_text()
    for message in ("starting workers", "closing signal SIGTERM", "exitcode: -9", "the store is slow",
                    "exitcode: 1", "a line of loom's own"):
        assert message in text, message
    assert log.run_dir == tmp_path / "run"


@pytest.mark.parametrize("restart_count, kept", [("0", True), ("1", False)])
def test_a_ranks_failure_with_a_restart_left_goes_to_the_log(tmp_path, monkeypatch, restart_count, kept):
    monkeypatch.setenv(AGENT_LOG_ENV, str(tmp_path / "logs" / "torchrun.log"))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    monkeypatch.setenv("RANK", "3")
    assert keep_for_restart("Traceback (most recent call last): ...") is kept
    log = tmp_path / "logs" / f"rank3.attempt{restart_count}.log"
    assert log.is_file() is kept
    monkeypatch.delenv(AGENT_LOG_ENV)  # not under loom's launcher: shown as it is
    assert keep_for_restart("Traceback") is False


def test_a_planted_link_in_the_logs_is_never_written_through(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep")
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "torchrun.log").symlink_to(elsewhere)
    (logs / "rank0.attempt0.log").symlink_to(elsewhere)
    monkeypatch.setenv(AGENT_LOG_ENV, str(logs / "torchrun.log"))
    monkeypatch.setattr(logging.getLogger("torch.distributed.elastic"), "handlers", [])
    assert keep_agent_log(["--max-restarts=1"]) is None  # torchrun's log stays on the console
    assert "torchrun's log stays on the console" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "0")
    assert keep_for_restart("Traceback")
    assert elsewhere.read_text() == "keep" and (logs / "rank0.attempt0.log").read_text() == "Traceback"

