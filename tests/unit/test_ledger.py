"""The step ledger from profiler traces: synthetic traces with a known answer (CPU and GPU style)
and bad input (a real 2-rank gloo DDP trace: tests/distributed/test_ledger_gloo.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loom.errors import LoomError
from loom.observe.ledger import analyze_dir, collective_kind, rank_ledger
from loom.observe.trace_events import TraceStream, find_traces

BASE_NS = 1_700_000_000_000_000_000  # baseTimeNanoseconds: ts are µs after it
MAIN, GLOO = 11, 12  # thread ids
CPU_PID, GPU_PID = 100, 0
STEP_KEYS = {"step", "start_us", "wall_ms", "compute_ms", "comm_exposed_ms", "comm_hidden_ms", "io_ms",
             "idle_ms", "forward_ms", "backward_ms", "optimizer_ms", "data_ms", "overlap_pct", "shares",
             "host_syncs", "host_syncs_optimizer", "host_syncs_loop"}


def X(name: str, start_ms: float, dur_ms: float, cat: str = "cpu_op", tid: int = MAIN, pid: int = CPU_PID,
      **args) -> dict:
    """A complete event; times in ms (written as the µs Kineto uses)."""
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start_ms * 1000,
          "dur": dur_ms * 1000}
    if args:
        ev["args"] = {k.replace("_", " "): v for k, v in args.items()}
    return ev


def write_trace(path: Path, events: list[dict], rank: int | None = 0, world: int = 2) -> Path:
    """Kineto's layout: pretty-printed, header keys before traceEvents, a key after them."""
    doc = {"schemaVersion": 1, "deviceProperties": []}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": world, "pg_count": 1}
    doc |= {"displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS, "traceEvents": events,
            "traceName": str(path)}
    text = json.dumps(doc, indent=2)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def cpu_events() -> list[dict]:
    """Two steps of a gloo DDP-style loop on the main thread, collectives on a runloop thread.

    Step 1 (0-100 ms): DataLoader 0-10 · forward 10-30 (ops 10-25, gap 25-30) · backward ops
    30-50 with an all-reduce enqueued 45-47, run by gloo 48-70, a wait gap 50-60, an op 60-65,
    a wait gap 65-70 · optimizer 70-90 (ops 70-80, item 82-84) · zero_grad 90-92 · sleep 92-100.
    Step 2 (100-150 ms, the last): DataLoader 100-120 · op 120-130 · broadcast enqueued 130-131,
    run 131-140, waited for · op 140-150.
    """
    return [
        {"ph": "M", "name": "thread_name", "pid": CPU_PID, "tid": GLOO, "args": {"name": "pt_gloo_runloop"}},
        X("ProfilerStep#1", 0, 100, "user_annotation"),
        X("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, "user_annotation"),
        X("aten::stack", 2, 4),
        X("DistributedDataParallel.forward", 10, 20, "user_annotation"),
        X("aten::linear", 10, 15),
        X("aten::addmm", 12, 8),
        X("autograd::engine::evaluate_function: AddmmBackward0", 30, 20),
        X("c10d::allreduce_", 45, 2, Input_Dims=[[[1000]], [], []], Input_type=["TensorList", "", ""]),
        X("gloo:all_reduce", 48, 22, "user_annotation", tid=GLOO, Input_Dims=[[1000]], Input_type=["float"]),
        X("aten::mul", 60, 5),
        X("Optimizer.step#AdamW.step", 70, 20, "user_annotation"),
        X("aten::add_", 70, 10),
        X("aten::item", 82, 2),
        X("aten::_local_scalar_dense", 82.5, 1),
        X("Optimizer.zero_grad#AdamW.zero_grad", 90, 2, "user_annotation"),
        X("aten::zero_", 90, 2),
        X("ProfilerStep#2", 100, 50, "user_annotation"),
        X("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 100, 20, "user_annotation"),
        X("aten::mm", 120, 10),
        X("c10d::broadcast_", 130, 1, Input_Dims=[[[500]], []], Input_type=["TensorList", ""]),
        X("gloo:broadcast", 131, 9, "user_annotation", tid=GLOO, Input_Dims=[[500]],
          Input_type=["c10::BFloat16"]),
        X("aten::add_", 140, 10),
        X("aten::mm", 150, 5),  # after the last step: in no step
    ]


CPU_EXPECTED = [
    {"step": 1, "start_us": BASE_NS / 1000, "wall_ms": 100.0, "compute_ms": 52.0, "comm_exposed_ms": 17.0,
     "comm_hidden_ms": 8.0, "io_ms": 10.0, "idle_ms": 21.0, "forward_ms": 20.0, "backward_ms": 20.0,
     "optimizer_ms": 22.0, "data_ms": 10.0, "overlap_pct": 32.0,
     "shares": {"compute": 52.0, "comm_exposed": 17.0, "io": 10.0, "idle": 21.0}, "host_syncs": 0,
     "host_syncs_optimizer": 1, "host_syncs_loop": 0},  # the optimizer's own .item() is not the user's sync
    {"step": 2, "start_us": BASE_NS / 1000 + 100_000, "wall_ms": 50.0, "compute_ms": 20.0,
     "comm_exposed_ms": 10.0, "comm_hidden_ms": 0.0, "io_ms": 20.0, "idle_ms": 0.0, "forward_ms": 0.0,
     "backward_ms": 0.0, "optimizer_ms": 0.0, "data_ms": 20.0, "overlap_pct": 0.0,
     "shares": {"compute": 40.0, "comm_exposed": 20.0, "io": 40.0, "idle": 0.0}, "host_syncs": 0,
     "host_syncs_optimizer": 0, "host_syncs_loop": 0},
]


def test_cpu_trace_ledger_is_exact(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", cpu_events())
    led = analyze_dir(tmp_path)["ranks"]["0"]
    assert led["kind"] == "cpu" and led["warnings"] == []
    assert led["steps"] == CPU_EXPECTED
    base = BASE_NS / 1000
    assert led["collectives"] == [
        {"step": 1, "kind": "all_reduce", "bytes": 4000, "group_size": 2, "group": None, "seq": None,
         "enqueue_us": base + 45_000, "start_us": base + 48_000, "end_us": base + 70_000,
         "duration_ms": 22.0},
        {"step": 2, "kind": "broadcast", "bytes": 1000, "group_size": 2, "group": None, "seq": None,
         "enqueue_us": base + 130_000, "start_us": base + 131_000, "end_us": base + 140_000,
         "duration_ms": 9.0},
    ]
    top = {op["name"]: (op["total_ms"], op["count"]) for op in led["top_ops"]}
    assert top["aten::add_"] == (20.0, 2) and top["aten::mm"] == (15.0, 2)
    own = {op["name"]: op["self_ms"] for op in led["top_ops"]}
    # aten::linear (10-25) holds aten::addmm (12-20): 15 ms in all, 7 of them its own
    assert (top["aten::linear"], own["aten::linear"], own["aten::addmm"]) == ((15.0, 1), 7.0, 8.0)
    assert own["aten::item"] == 1.0  # its _local_scalar_dense inside is the rest
    selfs = [op["self_ms"] for op in led["top_ops"]]
    assert selfs == sorted(selfs, reverse=True)  # ranked by self time: nested ops counted once


def test_loom_loop_syncs_are_not_the_users(tmp_path):
    """In a loom run a sync between loom's ranges is its own loop's (the stop agreement); one in
    forward is the user's. Without loom's ranges (any PyTorch loop) every sync is the user's."""
    events = cpu_events() + [X("loom/forward", 10, 18, "user_annotation"),
                             X("loom/backward", 30, 20, "user_annotation"),
                             X("loom/optimizer", 70, 22, "user_annotation"),
                             X("aten::is_nonzero", 26, 0.5), X("aten::item", 94, 1),
                             X("aten::is_nonzero", 96, 1)]
    steps = rank_ledger(TraceStream(write_trace(tmp_path / "t.json", events)), 0)["steps"]
    assert [(s["host_syncs"], s["host_syncs_loop"], s["host_syncs_optimizer"]) for s in steps] == [
        (1, 2, 1), (0, 0, 0)]
    no_ranges = [e for e in events if not e["name"].startswith("loom/")]
    steps = rank_ledger(TraceStream(write_trace(tmp_path / "u.json", no_ranges)), 0)["steps"]
    assert [(s["host_syncs"], s["host_syncs_loop"]) for s in steps] == [(3, 0), (0, 0)]


def test_loom_ranges_take_precedence(tmp_path):
    events = cpu_events() + [X("loom/forward", 10, 18, "user_annotation"),
                             X("loom/backward", 28, 42, "user_annotation"),
                             X("loom/optimizer", 70, 22, "user_annotation"),
                             X("loom/data", 100, 25, "user_annotation")]
    steps = rank_ledger(TraceStream(write_trace(tmp_path / "t.json", events)), 0)["steps"]
    assert [(s["forward_ms"], s["backward_ms"], s["optimizer_ms"], s["data_ms"]) for s in steps] == [
        (18.0, 42.0, 22.0, 0.0), (0.0, 0.0, 0.0, 25.0)]
    assert steps[1]["io_ms"] == 25.0  # loom/data is IO too: it covers 120-125 of the op
    assert steps[1]["compute_ms"] == 15.0
    # no forward range at all (FSDP2, a bare module): the first op after the fetch to the backward
    bare = [e for e in cpu_events() if e["name"] != "DistributedDataParallel.forward"]
    steps = rank_ledger(bare, 0)["steps"]
    assert [s["forward_ms"] for s in steps] == [20.0, 0.0]


def gpu_events() -> list[dict]:
    """Two steps of a GPU rank. Step 1 (0-100 ms): DataLoader 0-10 with the GPU idle · kernels
    10-40 (occupancy 50%) and 40-50 (100%) · NCCL all-reduce 30-60 (hidden 30-50, exposed
    50-60) · memcpy 60-65 (a memset inside) · kernel 70-80 · nothing 65-70 and 80-100, with a
    host sync 84-96. Step 2 (100-150): kernel 100-120 (80%) · NCCL all-gather 120-140 · nothing."""
    rpc = {"Process_Group_Name": "0", "Group_size": 8}
    return [
        X("ProfilerStep#1", 0, 100, "user_annotation"),
        X("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, "user_annotation"),
        X("aten::mm", 10, 2),
        X("cudaLaunchKernel", 10.5, 1, "cuda_runtime", correlation=1),
        X("c10d::allreduce_", 24, 3),
        X("record_param_comms", 25, 1, Collective_name="allreduce", In_msg_nelems=1048576,
          Out_msg_nelems=1048576, dtype="Float", Seq=7, **rpc),
        X("nccl:all_reduce", 25.2, 0.6, "user_annotation"),
        X("aten::item", 84, 12),
        X("aten::_local_scalar_dense", 84.5, 11),
        X("cudaStreamSynchronize", 85, 10, "cuda_runtime"),
        X("ampere_sgemm_128x64_tn", 10, 30, "kernel", tid=7, pid=GPU_PID,
          **{"est._achieved_occupancy_%": 50}),
        X("vectorized_elementwise_kernel", 40, 10, "kernel", tid=7, pid=GPU_PID,
          **{"est._achieved_occupancy_%": 100}),
        X("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 30, 30, "kernel",
          tid=20, pid=GPU_PID),
        X("Memcpy HtoD (Pageable -> Device)", 60, 5, "gpu_memcpy", tid=7, pid=GPU_PID),
        X("Memset (Device)", 62, 2, "gpu_memset", tid=7, pid=GPU_PID),
        X("reduce_kernel", 70, 10, "kernel", tid=7, pid=GPU_PID),
        X("ProfilerStep#2", 100, 50, "user_annotation"),
        X("c10d::_allgather_base_", 104, 3),
        X("record_param_comms", 105, 1, Collective_name="_allgather_base", In_msg_nelems=1000,
          Out_msg_nelems=8000, dtype="BFloat16", Seq=8, **rpc),
        X("ampere_sgemm_128x64_tn", 100, 20, "kernel", tid=7, pid=GPU_PID,
          **{"est._achieved_occupancy_%": 80}),
        X("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 120, 20, "kernel",
          tid=20, pid=GPU_PID),
    ]


def test_gpu_trace_ledger_is_exact(tmp_path):
    write_trace(tmp_path / "rank_3.pt.trace.json.gz", gpu_events(), rank=None)
    led = analyze_dir(tmp_path)["ranks"]["3"]
    assert led["kind"] == "gpu" and led["warnings"] == []
    s1, s2 = led["steps"]
    assert set(s1) == STEP_KEYS | {"kernels", "mean_kernel_us", "occupancy_pct"}
    assert (s1["wall_ms"], s1["compute_ms"], s1["comm_exposed_ms"], s1["comm_hidden_ms"], s1["io_ms"],
            s1["idle_ms"]) == (100.0, 50.0, 10.0, 20.0, 15.0, 25.0)
    assert s1["shares"] == {"compute": 50.0, "comm_exposed": 10.0, "io": 15.0, "idle": 25.0}
    assert (s1["overlap_pct"], s1["host_syncs"], s1["data_ms"]) == (round(100 * 20 / 30, 2), 1, 10.0)
    assert (s1["kernels"], s1["mean_kernel_us"], s1["occupancy_pct"]) == (4, 20_000.0, 62.5)
    assert (s2["wall_ms"], s2["compute_ms"], s2["comm_exposed_ms"], s2["comm_hidden_ms"], s2["io_ms"],
            s2["idle_ms"]) == (50.0, 20.0, 20.0, 0.0, 0.0, 10.0)
    assert (s2["kernels"], s2["mean_kernel_us"], s2["occupancy_pct"],
            s2["overlap_pct"]) == (2, 20_000.0, 80.0, 0.0)
    base = BASE_NS / 1000
    assert led["collectives"] == [
        {"step": 1, "kind": "all_reduce", "bytes": 4 * 1048576, "group_size": 8, "group": "0", "seq": 7,
         "enqueue_us": base + 24_000, "start_us": base + 30_000, "end_us": base + 60_000,
         "duration_ms": 30.0},
        {"step": 2, "kind": "all_gather", "bytes": 16000, "group_size": 8, "group": "0", "seq": 8,
         "enqueue_us": base + 104_000, "start_us": base + 120_000, "end_us": base + 140_000,
         "duration_ms": 20.0},
    ]
    assert led["top_ops"][0] == {"name": "ampere_sgemm_128x64_tn", "total_ms": 50.0, "self_ms": 50.0,
                                 "count": 2}


def test_partition_adds_up_and_gzip_reads_the_same(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_trace(tmp_path / "a" / "trace_rank0.json", cpu_events())
    write_trace(tmp_path / "b" / "trace_rank0.json.gz", cpu_events())
    plain, gz = analyze_dir(tmp_path / "a")["ranks"]["0"], analyze_dir(tmp_path / "b")["ranks"]["0"]
    assert plain["steps"] == gz["steps"] and plain["collectives"] == gz["collectives"]
    for s in plain["steps"]:
        parts = s["compute_ms"] + s["comm_exposed_ms"] + s["io_ms"] + s["idle_ms"]
        assert parts == pytest.approx(s["wall_ms"], abs=1e-9)


def test_stream_reads_what_json_loads_at_any_chunk_size(tmp_path):
    path = write_trace(tmp_path / "t.json", gpu_events())
    doc = json.loads(path.read_text())
    for chunk in (1, 7, 64, 1 << 20):
        stream = TraceStream(path, chunk_chars=chunk)
        assert list(stream) == doc["traceEvents"] and stream.warnings == []
        assert stream.header == {k: v for k, v in doc.items() if k != "traceEvents"}
    assert stream.absolute_us(5.5) == BASE_NS / 1000 + 5.5 and stream.distributed_rank == 0
    bare = tmp_path / "bare.json"  # Chrome's array form
    bare.write_text(json.dumps(doc["traceEvents"]))
    assert list(TraceStream(bare, chunk_chars=5)) == doc["traceEvents"]


def test_collective_kinds():
    names = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
             "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter", "gloo:all_to_all": "all_to_all",
             "c10d::recv_any_source_": "recv", "nccl:send": "send", "c10d::barrier": "barrier",
             "ncclKernel_ReduceScatter_RING_LL_Sum_float": "reduce_scatter",
             "ncclDevKernel_SendRecv(ncclDevComm*)": "p2p", "_c10d_functional::wait_tensor": None,
             "aten::mm": None}
    assert {n: collective_kind(n) for n in names} == names


def test_ranks_from_names_distributed_info_and_order(tmp_path):
    write_trace(tmp_path / "worker-rank-1.json", cpu_events(), rank=None)
    write_trace(tmp_path / "host_a.123.pt.trace.json", cpu_events(), rank=0)
    write_trace(tmp_path / "zz.json", cpu_events(), rank=None)
    assert [f.name_rank for f in find_traces(tmp_path)] == [None, 1, None]
    out = analyze_dir(tmp_path, workers=2)
    assert sorted(out["ranks"]) == ["0", "1", "2"] and out["warnings"] == []
    assert out["ranks"]["2"]["trace"].endswith("zz.json")
    assert all(led["steps"] == CPU_EXPECTED for led in out["ranks"].values())


def test_run_directory_repeated_traces_and_plain_events(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "memory.json").write_text("{}")  # a loom run directory: its traces/ are read
    write_trace(tmp_path / "traces" / "rank0.json.gz", cpu_events())
    later = [dict(e, ts=e["ts"] + 1e6) if "ts" in e else e for e in cpu_events()]  # 1 s later, same rank
    write_trace(tmp_path / "traces" / "host.2.pt.trace.json", later, rank=0)
    out = analyze_dir(tmp_path)
    led = out["ranks"]["0"]
    assert list(out["ranks"]) == ["0"] and any("merged" in w for w in led["warnings"])
    assert [s["step"] for s in led["steps"]] == [1, 2, 1, 2] and len(led["collectives"]) == 4
    plain = rank_ledger(cpu_events(), 5, base_ns=BASE_NS)  # any iterable of events
    assert plain["rank"] == 5 and plain["steps"] == CPU_EXPECTED


# -- bad input --------------------------------------------------------------------------------

def test_empty_directory(tmp_path):
    with pytest.raises(LoomError, match="no trace files"):
        analyze_dir(tmp_path)


def test_not_json_and_not_a_trace(tmp_path):
    (tmp_path / "notes.json").write_text("hello, I am not JSON")
    with pytest.raises(LoomError, match="not a JSON trace"):
        analyze_dir(tmp_path)
    (tmp_path / "notes.json").unlink()
    (tmp_path / "memory.json").write_text(json.dumps({"peak_bytes": 1, "ranks": [1, 2]}, indent=2))
    with pytest.raises(LoomError, match="no traceEvents"):
        analyze_dir(tmp_path)
    write_trace(tmp_path / "trace_rank0.json", cpu_events())  # beside a trace: skipped, said so
    out = analyze_dir(tmp_path)
    assert list(out["ranks"]) == ["0"] and "memory.json" in out["warnings"][0]


def test_skipped_file_is_said_in_the_table_and_own_outputs_are_not_traces(tmp_path, capsys):
    """A rank's file that is no trace is skipped: the table says so (it would vanish from it
    otherwise); loom analyze's own ledger.json beside the traces is never read as one."""
    import loom.cli

    write_trace(tmp_path / "rank0.json", cpu_events())
    (tmp_path / "rank1.json").write_text("hello")
    assert loom.cli.main(["analyze", str(tmp_path)]) == 0
    assert "warning: skipped: " + str(tmp_path / "rank1.json") in capsys.readouterr().out
    (tmp_path / "rank1.json").unlink()
    assert (tmp_path / "ledger.json").is_file()
    assert loom.cli.main(["analyze", str(tmp_path)]) == 0  # its ledger.json of the run before
    out = capsys.readouterr().out
    assert "warning: skipped" not in out  # (its own ledger.json read as a trace would be skipped)


def test_a_missing_ranks_trace_is_said(tmp_path):
    """Traces of 2 of a 4-rank run: each ledger holds, and the analysis says whose are missing (the
    comparison across ranks is of those present alone); every rank's trace, nothing said."""
    for rank in (0, 2):
        write_trace(tmp_path / f"rank{rank}.json", cpu_events(), rank=rank, world=4)
    out = analyze_dir(tmp_path)
    assert sorted(out["ranks"]) == ["0", "2"]
    assert out["warnings"] == [f"traces of 2 of the run's 4 ranks (none of rank 1, 3): stragglers and "
                               f"imbalance are told among these only; put every rank's trace in {tmp_path} "
                               f"for the whole run"]
    for rank in (1, 3):
        write_trace(tmp_path / f"rank{rank}.json", cpu_events(), rank=rank, world=4)
    assert analyze_dir(tmp_path)["warnings"] == []


def test_truncated_trace_analyzes_what_was_read(tmp_path):
    text = write_trace(tmp_path / "full.json", cpu_events()).read_text()
    (tmp_path / "full.json").unlink()
    cut = text.index('"name": "ProfilerStep#2"')  # inside step 2's event: step 1 is complete
    (tmp_path / "trace_rank0.json").write_text(text[:cut])
    led = analyze_dir(tmp_path)["ranks"]["0"]
    assert any("truncated" in w for w in led["warnings"])
    assert led["steps"] == CPU_EXPECTED[:1]
    with gzip.open(tmp_path / "trace_rank1.json.gz", "wt") as f:
        f.write(text)
    data = (tmp_path / "trace_rank1.json.gz").read_bytes()
    (tmp_path / "trace_rank1.json.gz").write_bytes(data[: len(data) * 2 // 3])  # a cut gzip stream
    led = analyze_dir(tmp_path)["ranks"]["1"]
    assert any("truncated" in w for w in led["warnings"]) and led["steps"]
    (tmp_path / "x.json").write_text(text[:40])  # cut before traceEvents: nothing to analyze
    with pytest.raises(LoomError, match="ends before its traceEvents"):
        rank_ledger(TraceStream(tmp_path / "x.json"))


def test_trace_without_steps_is_one_step(tmp_path):
    events = [e for e in cpu_events() if not e["name"].startswith("ProfilerStep")]
    led = analyze_dir(write_trace(tmp_path / "trace_rank0.json", events))["ranks"]["0"]
    assert any("no ProfilerStep" in w for w in led["warnings"])
    (step,) = led["steps"]
    assert step["step"] == -1 and step["wall_ms"] == 155.0  # the main thread's whole span
    assert step["compute_ms"] == 52.0 + 20.0 + 5.0 and step["io_ms"] == 30.0
    assert sum(step["shares"].values()) == pytest.approx(100, abs=0.5)
