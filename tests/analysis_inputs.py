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


# A mixture of experts' routing per logged step (metrics.jsonl, loom/train/moe_step.py's fields and
# expert parallelism's tally): 8 experts, 64 tokens × top-2 in one MoE block, so 128 choices a step.
# Training steps 2 and 3 are the profiled ones (sample_events' ProfilerStep#1, #2 with start_step 0):
# load imbalance 2.5 and 1.875 (median 2.1875), 2 and 1 choices dropped (1.5625% and 0.78125%:
# median 1.171875%); the steps around them are balanced.
MOE_ROWS = [
    {"step": 1, "loss": 5.6, "moe_aux_loss": 1.0, "moe_load_imbalance": 1.0, "moe_expert_tokens": [16] * 8,
     "moe_dropped": 0, "ep_bytes": 4096, "ep_wait_s": 0.001},
    {"step": 2, "loss": 5.5, "moe_aux_loss": 1.3, "moe_load_imbalance": 2.5,
     "moe_expert_tokens": [40, 10, 10, 10, 10, 10, 10, 28], "moe_dropped": 2, "ep_bytes": 8192,
     "ep_wait_s": 0.004},
    {"step": 3, "loss": 5.4, "moe_aux_loss": 1.1, "moe_load_imbalance": 1.875,
     "moe_expert_tokens": [30, 12, 14, 14, 14, 14, 14, 16], "moe_dropped": 1, "ep_bytes": 6144,
     "ep_wait_s": 0.002},
    {"step": 4, "loss": 5.3, "moe_aux_loss": 1.0, "moe_load_imbalance": 1.0, "moe_expert_tokens": [16] * 8,
     "moe_dropped": 0, "ep_bytes": 4096, "ep_wait_s": 0.001},
]
MOE_CONFIG = ('[model]\npreset = "tiny-moe"\nmoe_capacity_factor = 1.25\n[parallel]\nstrategy = "ddp"\n'
              'ep = 2\n[data]\nnum_workers = 0\n')


def write_moe_run(run: Path, config: str = MOE_CONFIG, rows: list[dict] | None = None) -> Path:
    """`write_run` of a mixture of experts under expert parallelism: config.toml's model.moe_* and
    parallel.ep, metrics.jsonl's routing (MOE_ROWS), memory.json's ep and ep_rank."""
    write_run(run)
    (run / "config.toml").write_text(config)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "start_step": 0}))
    rows = MOE_ROWS if rows is None else rows
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "memory.json").write_text(json.dumps({"ranks": {
        str(r): {"peak_bytes": 1 << 20, "num_params": 123456, "ep": 2, "ep_rank": r} for r in range(2)}}))
    return run
