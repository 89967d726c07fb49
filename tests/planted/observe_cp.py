"""Planted bugs in how the step ledger, the diagnosis, the report and the comparison see context
parallelism's exchanges (the cp_ring / cp_alltoall profiler ranges)."""

from __future__ import annotations

from planted import Bug

CP = "tests/unit/test_ledger_cp.py"
KINDS = f"{CP}::test_cp_exchanges_have_their_own_kinds_and_time"
KNOB = f"{CP}::test_exposed_cp_exchange_names_the_knob"
REPORT = f"{CP}::test_report_shows_cp_exchange_and_the_layout"
COMPARE = f"{CP}::test_compare_names_the_cp_key_that_differs"

BUGS = [
    Bug("ledger-cp-range-unseen", "the cp_ring / cp_alltoall ranges are not kept: CP's exchanges read as "
        "the pipeline's send/recv and an all-to-all",
        "loom/observe/ledger.py",
        "    if name in CP_KINDS:\n        out.append(name)\n",
        "    if False:\n        out.append(name)\n",
        (KINDS, f"{CP}::test_gpu_cp_exchange_is_its_kernel")),
    Bug("ledger-cp-alltoall-kind", "only the ring's range is a CP kind: Ulysses' all-to-alls stay all_to_all",
        "loom/observe/ledger.py",
        'CP_KINDS = ("cp_ring", "cp_alltoall")',
        'CP_KINDS = ("cp_ring",)',
        (KINDS,)),
    Bug("ledger-cp-by-run-thread", "a collective's CP range looked up on the thread that ran it (gloo's), "
        "not the one that issued it",
        "loom/observe/ledger.py",
        "    first = head or run\n",
        "    first = run or head\n",
        (KINDS,)),
    Bug("ledger-cp-all-in-flight-exposed", "all of CP's in-flight time counted as its exposed time",
        "loom/observe/ledger.py",
        'row["cp_exposed_ms"] = int(lengths[comm_m & cov[-1]].sum()) / 1e6',
        'row["cp_exposed_ms"] = int(lengths[cov[-1]].sum()) / 1e6',
        (KINDS,)),
    Bug("ledger-cp-wait-as-compute", "the main thread waiting inside a CP range counted as compute (the "
        "autograd Function's op around it)",
        "loom/observe/ledger.py",
        "for c in (COMM, *CP_KINDS) if c in arrays])),",
        "for c in (COMM,) if c in arrays])),",
        (KINDS,)),
    Bug("ledger-cp-range-not-cp", "exposed time in a CP range outside its collectives not counted as CP's",
        "loom/observe/ledger.py",
        "ranges = [] if gpu else [arrays[k] for k in CP_KINDS if k in arrays]",
        "ranges = []",
        (KINDS,)),
    Bug("diagnose-cp-split-by-transfer", "CP's measured exposed time ignored: the exposed time shared by "
        "transfer time (long, hidden all-gathers take CP's share)",
        "loom/observe/diagnose.py",
        '    if not cp or step.get("cp_exposed_ms") is None or not rest:\n',
        "    if True:\n",
        (KNOB,)),
    Bug("diagnose-cp-alltoall-more-bytes", "Ulysses suggested wherever the heads divide, even where its "
        "all-to-alls move more bytes than the ring (GQA)",
        "loom/observe/diagnose.py",
        "    if h % cp or ratio >= 1:\n",
        "    if h % cp:\n",
        (KNOB,)),
    Bug("diagnose-cp-kv-not-repeated", "Ulysses' bytes counted with the kv heads as they are, where cp does "
        "not divide them and they are repeated to the query heads",
        "loom/observe/diagnose.py",
        "    ratio = (h + (h if kv % cp else kv)) / (kv * cp)\n",
        "    ratio = (h + kv) / (kv * cp)\n",
        (KNOB,)),
    Bug("diagnose-cp-kv-heads-as-heads", "the preset's kv heads taken for its attention heads",
        "loom/observe/diagnose.py",
        '    kv = model.get("n_kv_heads") or (base.n_kv_heads if base else None)\n',
        '    kv = model.get("n_kv_heads") or heads\n',
        (KNOB,)),
    Bug("diagnose-cp-alltoall-knob", "exposed all-to-alls sent to fewer cp ranks, not to the ring",
        "loom/observe/diagnose.py",
        '        return "parallel.cp_mode", "ring", (\n',
        '        return "parallel.cp", cp // 2, (\n',
        (KNOB,)),
    Bug("report-cp-segment-missing", "the ledger bar draws no CP segment (all exposed comm one colour)",
        "loom/observe/report.py",
        "            if cp is not None:  # CP's exchange first",
        "            if False:  # CP's exchange first",
        (REPORT,)),
    Bug("report-cp-header-missing", "the header names cp only above 8 ranks",
        "loom/observe/report.py",
        '         if (_num(run.get("cp")) or 1) > 1 else None),',
        '         if (_num(run.get("cp")) or 1) > 8 else None),',
        (REPORT,)),
    Bug("analyze-cp-not-read", "run_config does not read parallel.cp (the layout that ran says cp 1)",
        "loom/observe/analyze.py",
        '"microbatches": _COUNT, "cp": _COUNT,',
        '"microbatches": _COUNT,',
        (REPORT, COMPARE)),
    Bug("compare-cp-mode-unnamed", "two runs' different cp_mode not named (only equal ones)",
        "loom/observe/compare.py",
        '    if a["cp"] > 1 and b["cp"] > 1 and a["cp_mode"] != b["cp_mode"]:\n',
        '    if a["cp"] > 1 and b["cp"] > 1 and a["cp_mode"] == b["cp_mode"]:\n',
        (COMPARE,)),
]
