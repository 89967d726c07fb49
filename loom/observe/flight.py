"""Collective timeouts that say who is stuck: torch's flight recorder, dumped by every rank.

torch records each collective a process group issues (its flight recorder, on for gloo and NCCL
when TORCH_FR_BUFFER_SIZE is set). When a collective times out on a rank, that rank asks every
rank, through the rendezvous store, to dump its record into RUN_DIR/flight_recorder/; a small
thread on each rank answers even while its main thread is stuck. Comparing the sequence numbers
names the collective and the ranks that never reached it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loom.errors import LoomError
from loom.files import atomic_write

DIR = "flight_recorder"
_REQUEST = "loom/flight_recorder/dump"
_BUFFER = "2000"  # collectives remembered per rank


def enable(run_dir: Path | None) -> None:
    """Before the process group starts: record collectives; on NCCL, let torch's watchdog dump too."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", _BUFFER)
    if run_dir is not None:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(run_dir).resolve() / DIR / "nccl_rank_"))


def _dump(run_dir: Path, rank: int) -> Path:
    text = torch._C._distributed_c10d._dump_fr_trace_json(True, True)
    path = run_dir / DIR / f"rank{rank}.json"
    # never through a link planted in the run directory (at the file, or as flight_recorder/ itself)
    atomic_write(path, text if isinstance(text, bytes) else text.encode(), inside=run_dir)
    return path


class Watcher:
    """Dumps this rank's flight record when any rank asks (polls the store twice a second)."""

    def __init__(self, run_dir: Path, d) -> None:
        self.run_dir, self.rank = run_dir, d.rank
        self.store = dist.distributed_c10d._get_default_store()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loom-flight-recorder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            try:
                if self.store.check([_REQUEST]):
                    _dump(self.run_dir, self.rank)
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def stop(self) -> None:
        """Before the process group goes: no store call may be in flight when it is destroyed."""
        self.done.set()
        self.thread.join(timeout=5)


def is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _last_seq(entries: list[dict], pg: str) -> int:
    return max((e["collective_seq_id"] for e in entries if e["process_group"][0] == pg and not e["is_p2p"]),
               default=0)


def timeout_error(e: BaseException, run_dir: Path, d, timeout_s: float, wait_s: float = 10.0) -> LoomError:
    """The stuck collective and the ranks that did not arrive, from every rank's dump."""
    mine = _dump(run_dir, d.rank)
    with contextlib.suppress(Exception):  # no store left: the dumps already on disk still tell
        dist.distributed_c10d._get_default_store().set(_REQUEST, "1")
    record = json.loads(mine.read_text())
    entries = [x for x in record.get("entries", []) if not x["is_p2p"]]
    if not entries:
        return LoomError(f"a collective timed out after {timeout_s:g} s on rank {d.rank} "
                         f"({str(e).splitlines()[0]}); "
                         f"raise train.collective_timeout_s if the wait is legitimate")
    stuck = max(entries, key=lambda x: x["time_created_ns"])
    pg, desc = stuck["process_group"]
    seq = stuck["collective_seq_id"]
    ranks = record.get("pg_config", {}).get(pg, {}).get("ranks")
    members = json.loads(ranks) if isinstance(ranks, str) else (ranks or list(range(d.world_size)))
    deadline = time.monotonic() + wait_s
    behind: dict[int, int | None] = {}
    for r in members:
        path = run_dir / DIR / f"rank{r}.json"
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not path.exists():
            behind[r] = None  # did not answer: stuck outside Python, or dead
            continue
        last = _last_seq(json.loads(path.read_text()).get("entries", []), pg)
        if last < seq:
            behind[r] = last
    late = ", ".join(f"{r} (at #{v})" if v is not None else f"{r} (no answer)" for r, v in behind.items())
    who = (f"rank(s) {late} did not arrive" if behind
           else "every rank arrived (a transport problem, not a hang)")
    size = " × ".join(str(s) for s in stuck.get("input_sizes", [])[:1])
    return LoomError(f"collective {stuck['profiling_name']} #{seq} ({size}, group '{desc}', ranks {members}) "
                     f"timed out after {timeout_s:g} s on rank {d.rank}: {who}; flight recorder dumps in "
                     f"{run_dir / DIR}; raise train.collective_timeout_s if the wait is legitimate")

