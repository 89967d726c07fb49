"""Small valid inputs of the planner and the analysis, for the tests that perturb them
(tests/unit/bad_input_cases_plan.py, test_fuzz_plan.py, test_plan_inputs.py): the shipped device
profile, a two-step profiler trace with a collective, and a run directory as `loom train` leaves
it for `loom analyze`. No torch: the analysis of traces does not need it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "device_cpu.json"
BASE_NS = 1_700_000_000_000_000_000


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1, **args) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = {k.replace("_", " "): v for k, v in args.items()}
    return ev


def sample_events() -> list[dict]:
    """Two 100 µs steps on the main thread: a forward op, a backward op, an all-reduce issued
    (record_param_comms' sizes) and run on gloo's thread, a metadata event (skipped)."""
    events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "pt_gloo_runloop"}}]
    for step in range(2):
        t = 1000.0 + 100 * step
        events += [_x(f"ProfilerStep#{step + 1}", t, 100, "user_annotation"),
                   _x("aten::mm", t + 5, 30),
                   _x("autograd::engine::evaluate_function: MmBackward0", t + 40, 30),
                   _x("record_param_comms", t + 72, 2, Collective_name="allreduce", dtype="Float",
                      In_msg_nelems=256, Out_msg_nelems=256, Group_size=2, Seq=step),
                   _x("gloo:all_reduce", t + 75, 10, "user_annotation", tid=2)]
    return events


def trace_doc(events: list | None = None, **header) -> dict:
    """A Kineto-style Chrome trace: header keys, traceEvents, a key after them."""
    info = {"backend": "gloo", "rank": 0, "world_size": 2, "pg_count": 1}
    return {"schemaVersion": 1, "distributedInfo": info, "baseTimeNanoseconds": BASE_NS, **header,
            "traceEvents": sample_events() if events is None else events, "traceName": "trace"}


def write_trace(path: Path, events: list | None = None, **header) -> Path:
    """`trace_doc` as a file (pretty-printed, as Kineto writes it); .gz compresses it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(trace_doc(events, **header), indent=1)
    path.write_bytes(gzip.compress(text.encode()) if path.name.endswith(".gz") else text.encode())
    return path


def write_run(run: Path) -> Path:
    """A run directory as `loom train` leaves it for `loom analyze`: traces/ and the records it reads."""
    write_trace(run / "traces" / "rank0.json")
    (run / "config.toml").write_text('[parallel]\nstrategy = "ddp"\nddp_bucket_mb = 25.0\nfsdp_prefetch = 1\n'
                                     '[data]\nnum_workers = 0\n')
    (run / "plan.json").write_text(json.dumps({"label": "ddp", "strategy": "ddp", "step_time_s": 1e-4,
                                               "memory_bytes": {"total": 1.5e6}, "comm_bytes_per_step": 1024,
                                               "comm_payload_bytes_per_step": 1024}))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "measured_vs_planned": [
        {"rank": 0, "model_state_bytes": [1.6e6, 1.6e6], "activation_peak_bytes": [1e6, None],
         "comm_by_kind": {"all_reduce": {"payload_bytes": [1024, 1024], "count": [1, 1]}}}]}))
    return run
