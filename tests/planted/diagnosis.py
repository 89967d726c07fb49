"""Planted bugs in the diagnosis a new user reads first (issue 25): imbalance named as such,
exposed time split by collective kind with knobs that fit the layout that ran, loom's own loop
never flagged for host syncs, a TRY that is a valid TOML line, and the report's self times,
tables without scroll boxes, off-plan flags and run header."""

from __future__ import annotations

from planted import Bug

FINDINGS = "tests/unit/test_diagnosis_findings.py"
LAYOUT = f"{FINDINGS}::test_exposed_communication_names_the_knob_of_the_layout_that_ran"
IMBALANCE = f"{FINDINGS}::test_imbalance_names_the_slow_rank_and_its_compute"
BY_KIND = f"{FINDINGS}::test_exposed_communication_is_split_by_kind"
LEDGER = "tests/unit/test_ledger.py"
REPORT = "tests/unit/test_report.py"

BUGS = [
    Bug("diagnose-imbalance-never", "a rank waiting for a slower one is never named as imbalance",
        "loom/observe/diagnose.py",
        "    if share[waiter] < SHARE:\n",
        "    if share[waiter] < 100:\n",
        (IMBALANCE,)),
    Bug("diagnose-imbalance-wrong-compute",
        "the imbalance quotes the waiting rank's compute as the slow one's",
        "loom/observe/diagnose.py",
        '    slow_compute = _mean(_ms(s, "compute") for s in s_steps)\n',
        '    slow_compute = _mean(_ms(s, "compute") for s in w_steps)\n',
        (IMBALANCE,)),
    Bug("diagnose-waits-as-overlap", "waiting for a slower rank is left in the exposed transfer (advised as "
        "missing overlap)",
        "loom/observe/diagnose.py",
        '            exposed = max(_ms(s, "comm_exposed") - waits.get(rank, {}).get(s.get("step"), 0.0), '
        '0.0)\n',
        '            exposed = _ms(s, "comm_exposed")\n',
        (IMBALANCE,)),
    Bug("diagnose-one-unit-prefetch", "a model that is one FSDP unit is told to prefetch more units",
        "loom/observe/diagnose.py",
        '        if layout["units"] <= 1:\n',
        '        if layout["units"] < 1:\n',
        (LAYOUT, "tests/unit/test_compare.py::"
         "test_exposed_reduce_scatter_names_the_collective_and_the_config_key")),
    Bug("diagnose-kinds-not-split", "only the largest collective kind gets a finding and a knob",
        "loom/observe/diagnose.py",
        "        if i and share < exposed / 4:\n",
        "        if i:\n",
        (BY_KIND,)),
    Bug("diagnose-p2p-no-pipeline-knob", "NCCL's p2p kind (SendRecv) under a pipeline gets no pipeline knob",
        "loom/observe/diagnose.py",
        '    if kind in ("p2p", "send", "recv") and pp > 1:\n',
        '    if kind in ("send", "recv") and pp > 1:\n',
        (LAYOUT, BY_KIND)),
    Bug("diagnose-try-prose-in-value", "the TRY puts the prose inside the TOML value's quotes",
        "loom/observe/diagnose.py",
        "    line = f\"{finding['knob']} = {toml_value(finding['value'])}\"\n",
        "    line = f\"{finding['knob']} = {toml_value(str(finding['value']) + ' ' + note)}\"\n",
        (f"{FINDINGS}::test_io",)),
    Bug("ledger-loop-syncs-as-users", "loom's own loop (the stop agreement) counted as the user's host syncs",
        "loom/observe/ledger.py",
        "        loop_syncs, syncs = syncs[~in_step], syncs[in_step]\n",
        "        loop_syncs = syncs[~in_step]\n",
        (f"{LEDGER}::test_loom_loop_syncs_are_not_the_users",)),
    Bug("ledger-self-is-total", "an op's self time includes the ops nested in it",
        "loom/observe/ledger.py",
        "                inner[parent] += min(e, parent_end) - s\n",
        "                inner[parent] += 0\n",
        (f"{LEDGER}::test_cpu_trace_ledger_is_exact",)),
    Bug("report-top-ops-by-total", "the report's top ops add nested ops' time (totals, not self)",
        "loom/observe/report.py",
        '            own = _num(op.get("self_ms"))\n',
        "            own = None\n",
        (f"{REPORT}::test_top_ops_rank_by_self_time",)),
    Bug("report-scroll-box", "tables sit in a fixed-height scroll box that cuts them",
        "loom/observe/report.py",
        ".scroll{max-width:100%}",
        ".scroll{overflow-x:auto;max-height:560px;overflow-y:auto}",
        (f"{REPORT}::test_no_scroll_box_cuts_a_table",)),
    Bug("report-off-plan-never", "measured far from planned is never flagged",
        "loom/observe/report.py",
        "    if abs(change) <= OFF_PLAN:\n",
        "    if abs(change) <= 1:\n",
        (f"{REPORT}::test_measured_vs_planned_flags_past_a_quarter",)),
    Bug("report-try-quoted", "the report's TRY renders the prose inside TOML quotes",
        "loom/observe/report.py",
        "            value = \"\" if f.get(\"value\") is None else f\" = {toml_value(f['value'])}\"\n",
        "            value = \"\" if f.get(\"value\") is None else "
        "f\" = {toml_value(str(f['value']) + note)}\"\n",
        (f"{REPORT}::test_try_is_a_toml_line_with_the_prose_beside_it",)),
    Bug("report-no-trace-links", "the report's header has no links to the trace files",
        "loom/observe/report.py",
        "            f\"{_trace_links(run.get('traces'), base)}</header>\")",
        "            \"</header>\")",
        (f"{REPORT}::test_header_names_model_batch_commit_date_memory_loss_and_traces",)),
    Bug("analyze-loss-step-off-by-one", "the profiled steps' losses are read one training step early",
        "loom/observe/analyze.py",
        "    profiled = {start + n + 1 for n in profiled if isinstance(n, int) and n >= 0}\n",
        "    profiled = {start + n for n in profiled if isinstance(n, int) and n >= 0}\n",
        (f"{REPORT}::test_header_names_model_batch_commit_date_memory_loss_and_traces",)),
]
