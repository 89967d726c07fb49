"""Stray lines a user sees that loom can silence: Kineto's USDT/STAGE marks, printed to fd 2 where a
trace starts and stops (inside the progress line), are dropped; anything else said meanwhile,
Kineto's errors included, still reaches the terminal."""

from __future__ import annotations

import os

import torch

from loom.config import ProfileConfig, choose_deepspeed_accelerator
from loom.observe.profiler import StepProfiler, kineto_marks_dropped, trace_path


def test_a_profiled_loop_prints_no_kineto_marks(tmp_path, capfd):
    cfg = ProfileConfig(wait=1, warmup=1, active=2)
    with StepProfiler(cfg, tmp_path, 0, torch.device("cpu")) as prof:
        for _ in range(6):
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.step()
    out, err = capfd.readouterr()
    assert trace_path(tmp_path, 0).is_file()
    assert "USDT:" not in err and "STAGE:" not in err and "profiler_start" not in err, err


def test_only_the_marks_are_dropped(capfd):
    with kineto_marks_dropped():
        os.write(2, b"USDT:2026-12-04 22:58:39 8499:8499 SyncActivityProfilerHandler.cpp:52] "
                    b"profiler_start\n"
                    b"ERROR:2026-12-04 22:58:39 8499:8499 CuptiActivityProfiler.cpp:1] buffer full\n"
                    b"STAGE:2026-12-04 22:58:39 8499:8499 SyncActivityProfilerHandler.cpp:51] "
                    b"Completed Stage: Warm Up\nUSDT: a line of someone else's\n")
    err = capfd.readouterr().err
    assert err == ("ERROR:2026-12-04 22:58:39 8499:8499 CuptiActivityProfiler.cpp:1] buffer full\n"
                   "USDT: a line of someone else's\n"), err


def test_a_scalar_collective_has_a_size():
    """The loop's 0-d all-reduce (its token count): the issue lists a TensorList of no shape, gloo's
    span a float of dims [] — one element, 4 bytes, not "no recorded size" (which the ledger warned)."""
    from loom.observe.ledger import _CommEvent, _payload_bytes

    issue = _CommEvent((1, 1), 0, 10, "c10d::allreduce_", {
        "Input Dims": [[[]], [], [], [], [], []],
        "Input type": ["TensorList", "", "", "", "Scalar", "Scalar"]}, work=False)
    run = _CommEvent((1, 2), 5, 20, "gloo:all_reduce", {"Input Dims": [[]], "Input type": ["float"]},
                     work=True)
    assert _payload_bytes("all_reduce", [issue, run], 2) == 4
    stats = _CommEvent((1, 2), 5, 20, "gloo:all_reduce", {"Input Dims": [[3]], "Input type": ["long int"]},
                       work=True)
    assert _payload_bytes("all_reduce", [issue, stats], 2) == 24
    # an argument without a shape (a Scalar's []) is no element
    assert _payload_bytes("all_reduce", [issue], 2) is None


def test_the_known_third_party_lines_are_dropped_each_by_its_message(capsys, monkeypatch):
    import warnings

    from loom.parallel import known_warnings as kw

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kw.silence_flattened_dim_slicing()
        kw.silence_module_hierarchy()
        kw.silence_profiler_cycles()
        warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the "
                      "current cycle will be reported.To keep events across cycles, set acc_events=True.",
                      UserWarning)
        warnings.warn("Slicing a flattened dim from root mesh will be deprecated in PT 2.11. Users need to "
                      "bookkeep the flattened mesh directly. ", UserWarning)
        warnings.warn("The module hierarchy tracking maybe be messed up. Please file a bug to PyTorch, if "
                      "it is the case.", UserWarning)
        warnings.warn("Slicing a tensor is slow", UserWarning)  # anything else still shows
    assert [str(w.message) for w in seen] == ["Slicing a tensor is slow"]

    with kw.deepspeed_build_notes_dropped():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("DeepSpeed says something else")
    assert capsys.readouterr().out == "DeepSpeed says something else\n"

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    choose_deepspeed_accelerator()  # what DeepSpeed would find, said, so it does not warn of it
    assert os.environ["DS_ACCELERATOR"] == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    choose_deepspeed_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "xpu"  # a user's own choice stays
