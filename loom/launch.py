"""Start the ranks: re-exec under torchrun when --nproc/--nnodes ask for it, or join one.

loom never launches processes or moves bytes itself: torchrun (c10d rendezvous) starts and
restarts the ranks, and under Slurm each srun task joins with the env that srun gives it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loom.errors import LoomError
from loom.files import atomic_write


@dataclass
class LaunchSpec:
    nproc: int = 1
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def under_launcher(launching: bool = False) -> bool:
    """True inside a rank started by torchrun or srun (then we just join the group; check_rank_env
    says in one line where its variables are not a launcher's). `launching`: the command asks to
    start ranks itself (--nproc/--nnodes: torchrun per node under srun), which a RANK left in the
    shell does not override."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent started this process
        return True
    tasks = _env_int("SLURM_NTASKS", 1)
    return not launching and ("RANK" in os.environ or tasks is None or tasks > 1)


def _env_int(name: str, default: int) -> int | None:
    """An integer environment variable, `default` where unset; None where it holds something else."""
    text = os.environ.get(name)
    if text is None:
        return default
    return int(text) if text.strip().isdigit() else None


# The variables a rank joins its group by: torch's env:// set, or srun's (adopt_slurm_env)
ENV_RANK = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_NUMBERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
            "SLURM_LOCALID", "SLURM_JOB_ID")


def check_rank_env() -> None:
    """Before a rank joins its group: the variables it joins by are all there, and numbers where
    numbers go. A RANK or SLURM_NTASKS left in a shell would otherwise make `loom train` a rank of a
    group that does not exist (a traceback from torch's rendezvous, or a run of the wrong size)."""
    env = os.environ
    for name in _NUMBERS:
        if name in env and _env_int(name, 0) is None:
            raise LoomError(f"{name}={env[name]!r} in the environment must be a whole number ≥ 0 (a launcher "
                            f"sets it); unset it, or start loom from torchrun or srun, which set it")
    if "RANK" in env and "TORCHELASTIC_RUN_ID" not in env:
        missing = [name for name in ENV_RANK if name not in env]
        if missing:
            raise LoomError(f"RANK={env['RANK']} is set in the environment but {missing[0]} is not: a rank "
                            f"started by a launcher has all of {', '.join(ENV_RANK)}; unset RANK to have "
                            f"loom start the ranks (--nproc N), or set the others")
    elif "RANK" not in env and "SLURM_PROCID" not in env:
        raise LoomError(f"SLURM_NTASKS={env.get('SLURM_NTASKS')} is set but this process is no srun task (no "
                        f"SLURM_PROCID: an salloc shell?); start it with srun, or pass --nproc N to start N "
                        f"ranks here")
    elif "RANK" not in env and "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" not in env:
        raise LoomError("an srun task without SLURM_JOB_NODELIST or MASTER_ADDR: loom cannot tell which "
                        "node hosts rank 0; set MASTER_ADDR to it")


def adopt_slurm_env() -> None:
    """Translate srun's task variables into the env:// variables torch.distributed reads."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = nodes[0]
    # one port per job: two jobs sharing a node must not meet at the same store
    os.environ.setdefault("MASTER_PORT", str(15000 + int(os.environ.get("SLURM_JOB_ID", "14500")) % 20000))
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def srun_tasks() -> list[str]:
    """`srun --nodes N --ntasks T` when srun started this rank as one of its tasks (no torchrun
    between them), so that a printed command relaunches the same ranks; [] otherwise."""
    if "TORCHELASTIC_RUN_ID" in os.environ or (_env_int("SLURM_NTASKS", 1) or 1) <= 1:
        return []
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return ["srun", "--nodes", nodes, "--ntasks", os.environ["SLURM_NTASKS"]]


def max_local_processes() -> tuple[int, str]:
    """How many ranks one machine may run: one per GPU, or a few per core on a CPU-only host."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return n, f"{n} visible GPU(s)"
    cores = os.cpu_count() or 1
    return max(8, 4 * cores), f"{cores} CPU core(s), no GPU: at most max(8, 4 × cores) gloo ranks"


def default_nproc() -> int:
    """Every local GPU; on a CPU-only host two gloo ranks (a distributed run you can watch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def check_spec(spec: LaunchSpec) -> None:
    if spec.nproc < 1 or spec.nnodes < 1:
        raise LoomError(f"--nproc ({spec.nproc}) and --nnodes ({spec.nnodes}) must be ≥ 1 "
                        f"(ranks per machine, machines), e.g. --nproc 2")
    limit, why = max_local_processes()
    if spec.nproc > limit:
        raise LoomError(f"--nproc {spec.nproc} is more than this machine allows ({why}); "
                        f"use --nproc {limit} or fewer, and add machines with --nnodes")
    if spec.max_restarts < 0:
        raise LoomError(f"--max-restarts ({spec.max_restarts}) must be ≥ 0 (0: a failed group is not "
                        f"restarted)")
    if spec.node_rank is not None and not 0 <= spec.node_rank < spec.nnodes:
        raise LoomError(f"--node-rank {spec.node_rank} must be in 0..{spec.nnodes - 1} for "
                        f"--nnodes {spec.nnodes}; "
                        f"give each machine its own rank, 0 on the one hosting --rdzv-endpoint")
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise LoomError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if spec.rdzv_endpoint:
        _check_endpoint(spec)


def _check_endpoint(spec: LaunchSpec) -> None:
    """HOST:PORT must parse; node 0 of a static rendezvous hosts the store, so its port must be free."""
    host, sep, port = spec.rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LoomError(f"--rdzv-endpoint '{spec.rdzv_endpoint}' must be HOST:PORT with a port in 1..65535, "
                        f"e.g. node0:29500")
    if spec.node_rank != 0 or not _is_local(host):
        return
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            raise LoomError(f"port {port} on {host} is already in use (another run's rendezvous?); "
                            f"pick a free port: --rdzv-endpoint {host}:{free_port()}") from None


def _is_local(host: str) -> bool:
    try:
        return host in ("localhost", socket.gethostname()) or socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous or a single process's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(spec: LaunchSpec, loom_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "loom.train.torchrun", f"--nproc-per-node={spec.nproc}",
           f"--max-restarts={spec.max_restarts}"]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        cmd.append("--standalone")  # local rendezvous on a free port
    elif spec.node_rank is not None:  # static rendezvous: fixed node ranks
        host, _, port = spec.rdzv_endpoint.partition(":")
        cmd += [f"--nnodes={spec.nnodes}", f"--node-rank={spec.node_rank}",
                f"--master-addr={host}", f"--master-port={port or 29500}"]
    else:  # elastic c10d rendezvous
        cmd += [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={spec.rdzv_endpoint}", "--rdzv-id=loom"]
    return cmd + ["-m", "loom.cli", *loom_args]


def torchrun_log(log_dir: Path, spec: LaunchSpec) -> Path:
    """This node's torchrun agent's log (loom/train/torchrun.py): one per node when nodes share the run."""
    return log_dir / ("torchrun.log" if spec.nnodes == 1 else f"torchrun.{socket.gethostname()}.log")


STOP_FILE_ENV = "LOOM_STOP_FILE"  # the launcher's stop request to its ranks: the signal's number
REPORT_FILE_ENV = "LOOM_REPORT_FILE"  # an error every rank agreed on, for the launcher to print once
AGENT_LOG_ENV = "LOOM_TORCHRUN_LOG"  # torchrun's agent's log (loom/train/torchrun.py); the ranks' beside it
PR_SET_PDEATHSIG = 1


@dataclass
class Ended:
    """How a launch ended: torchrun's exit code, the signal that asked the launcher to stop (0:
    none), and the one-line error the ranks left for it (None: none)."""

    code: int
    asked: int
    report: str | None


# One Ctrl-C can reach a process twice, within milliseconds: the terminal sends it to the whole
# process group and `timeout` (or `uv run` and the like) passes on the copy it got. Within this many
# seconds of the first stop signal, a Ctrl-C is that one again; later, a person pressed it again.
SAME_CTRL_C_S = 1.0


def aborts(signum: int, first_at: float, now: float) -> bool:
    """Whether `signum`, received at `now` after a stop signal received at `first_at` (monotonic
    seconds), is a second Ctrl-C: abort at once."""
    return signum == signal.SIGINT and now - first_at >= SAME_CTRL_C_S


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits, whatever killed the parent (no-op
    elsewhere). torchrun dies with the `loom` launcher and a rank with torchrun's agent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was gone before the call
        os._exit(1)


def report_to_launcher(message: str) -> bool:
    """A rank under loom's launcher leaves an agreed error for it to print (once per node);
    False when there is no such launcher (srun started the rank): the rank prints it itself."""
    path = os.environ.get(REPORT_FILE_ENV)
    if not path:
        return False
    if os.environ.get("LOCAL_RANK", "0") == "0":
        _leave(Path(path), message)
    return True


def end_launch(message: str) -> bool:
    """An error this rank raised on its own (the others may not have, or not yet): leave it for
    loom's launcher and end torchrun at once, before torchrun sees a failed rank and prints its
    failure report; the other ranks die with torchrun (die_with_parent), and the launcher prints
    the one line. Does not return when it does that. False when there is no such launcher (srun
    started the rank) or torchrun has a restart left, which it uses: the rank prints the error."""
    path = os.environ.get(REPORT_FILE_ENV)
    if not path or restarts_left() > 0:
        return False
    _leave(Path(path), message)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getppid(), signal.SIGKILL)  # torchrun, which started this rank
    os._exit(1)


def restarts_left() -> int:
    """How many times torchrun may still restart this rank's group (0: none, or not under torchrun)."""
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
            - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def keep_for_restart(details: str) -> bool:
    """A rank's failure (`details`: its traceback) while torchrun has a restart left: the group
    restarts from the latest checkpoint and the launcher says so in one line, so the details go to
    the run's log folder (rank<R>.attempt<K>.log beside torchrun's log), not the console. False
    when no restart is left or there is no such folder: the caller shows the failure as it is."""
    agent_log = os.environ.get(AGENT_LOG_ENV)
    if not agent_log or restarts_left() <= 0:
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = Path(agent_log).parent / f"rank{os.environ.get('RANK', '0')}.attempt{attempt}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, details.encode())  # replaces a planted link, never follows it
    except (LoomError, OSError):
        return False
    return True


def _leave(path: Path, message: str) -> None:
    """Write the report whole (the launcher may read it as torchrun ends), one writer's at a time."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(message)
    tmp.replace(path)


def relaunch(spec: LaunchSpec, loom_args: list[str], preempt: int = signal.SIGUSR1,
             log_dir: Path | None = None) -> Ended:
    """Run the same loom command on every rank under torchrun.

    torchrun runs in its own session, so a terminal's Ctrl-C reaches this launcher only: SIGINT,
    SIGTERM, SIGHUP or the preemption signal write the stop file the ranks read at each step
    (they checkpoint and leave together); a second Ctrl-C (not the first one delivered twice:
    SAME_CTRL_C_S) kills torchrun, and the ranks die with it. torchrun ignores the preemption
    signal (a scheduler may send it to every process of the job: by default it would end torchrun,
    and the ranks with it); the ranks keep their handler. `log_dir`: where torchrun's agent and the
    ranks that fail while a restart is left write their logs (loom/train/torchrun.py)."""
    env = dict(os.environ)
    # One rank per core share: avoids oversubscribing CPU threads (and torchrun's warning).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    folder = Path(tempfile.mkdtemp(prefix="loom-launch-"))
    stop_file, report_file = folder / "stop", folder / "report"
    env[STOP_FILE_ENV], env[REPORT_FILE_ENV] = str(stop_file), str(report_file)
    if log_dir is not None:
        env[AGENT_LOG_ENV] = str(torchrun_log(log_dir, spec))
    asked, asked_at = 0, 0.0

    def start_torchrun() -> None:
        die_with_parent()
        signal.signal(preempt, signal.SIG_IGN)

    proc = subprocess.Popen(torchrun_command(spec, loom_args), env=env, start_new_session=True,
                            preexec_fn=start_torchrun)

    def ask(signum, frame) -> None:
        nonlocal asked, asked_at
        if asked:
            if aborts(signum, asked_at, time.monotonic()):
                os.killpg(proc.pid, signal.SIGKILL)  # abort: the ranks die with torchrun
            return
        asked, asked_at = signum, time.monotonic()
        tmp = folder / "stop.tmp"
        tmp.write_text(str(asked))
        tmp.replace(stop_file)

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, preempt)
    previous = {sig: signal.signal(sig, ask) for sig in stops}
    try:
        code = proc.wait()
        report = report_file.read_text() if report_file.is_file() else None
        return Ended(code, asked, report)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(folder, ignore_errors=True)


def exit_rank(code: int) -> None:
    """End a rank started by torchrun (or spawned) without the interpreter's teardown. torch keeps
    each process group (gloo: a dozen native threads) alive past destroy_process_group through its
    DeviceMesh registry; tearing those down during interpreter finalization occasionally aborts
    ("terminate called without an active exception"), turning a finished run into a failure.
    Everything the caller wrote must be closed by now; only stdio needs a flush."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
