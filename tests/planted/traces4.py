"""Planted bugs in what `loom analyze` is given, fourth pass (tests/unit/bad_input_cases_traces4.py): a run
directory without traces (loom/observe/trace_events.py), a trace with no events to time and traces of
two runs recorded apart (loom/observe/ledger.py), a gzip trace named .json, an output folder that
cannot be written (loom/cli.py), and a skipped file said in the table (loom/observe/analyze.py)."""

from __future__ import annotations

from planted import Bug

CASES = "tests/unit/test_bad_input.py::test_bad_input"
LEDGER = "tests/unit/test_ledger.py"

BUGS = [
    Bug("analyze-untraced-run-as-traces", "a run directory without traces/ has its own records read as "
        "traces (and the user told to remove memory.json)",
        "loom/observe/trace_events.py",
        "        if _untraced_run(path, files):",
        "        if False:",
        (f"{CASES}[analyze-run-without-traces]", f"{CASES}[analyze-compare-run-without-traces]")),
    Bug("analyze-empty-trace-diagnosed", "a trace with no timed events is diagnosed: findings none, exit 0",
        "loom/observe/ledger.py",
        '    if not ledger["steps"]:  # a verdict from no events',
        '    if False:  # a verdict from no events',
        (f"{CASES}[analyze-trace-no-events]", f"{CASES}[analyze-trace-no-events-array]",
         f"{CASES}[analyze-trace-other-tool]")),
    Bug("analyze-gzip-json-not-utf8", "a gzip trace named .json is said to be text that is not UTF-8",
        "loom/observe/trace_events.py",
        'not self.path.name.endswith(".gz") and _gzipped(self.path):',
        'not self.path.name.endswith(".gz") and False:',
        (f"{CASES}[analyze-trace-gzip-named-json]",)),
    Bug("analyze-runs-apart-unchecked", "two runs' traces in one folder are analyzed as one run's ranks",
        "loom/observe/ledger.py",
        "    refuse_apart(ranks)\n",
        "    pass\n",
        (f"{CASES}[analyze-trace-runs-apart]",)),
    Bug("analyze-runs-apart-a-day", "runs are told apart only a day apart (seconds taken for ms)",
        "loom/observe/ledger.py",
        "    if apart_s <= MAX_APART_S:",
        "    if apart_s <= MAX_APART_S * 1000:",
        (f"{CASES}[analyze-trace-runs-apart]",)),
    Bug("analyze-out-unchecked", "a read-only output folder is a traceback after the analysis",
        "loom/cli.py",
        "    check_out_writable(out_dir)  # and the analysis has somewhere to go",
        "    pass  # and the analysis has somewhere to go",
        (f"{CASES}[analyze-out-read-only]",)),
    Bug("compare-out-unchecked", "--compare --out in a read-only folder is a traceback after both analyses",
        "loom/cli.py",
        '        check_out_writable(args.out, "loom analyze --compare")',
        "        pass",
        (f"{CASES}[analyze-compare-out-read-only]",)),
    Bug("analyze-skipped-unsaid", "a rank's file skipped as no trace vanishes from the table unsaid",
        "loom/observe/analyze.py",
        '    lines += [f"  warning: {w}" for w in analysis.get("warnings", [])]',
        "    lines += []",
        (f"{LEDGER}::test_skipped_file_is_said_in_the_table_and_own_outputs_are_not_traces",)),
    Bug("analyze-reads-own-ledger", "loom analyze's own ledger.json beside the traces is read as a trace",
        "loom/observe/trace_events.py",
        ' and p.name not in _OUTPUTS]',
        "]",
        (f"{LEDGER}::test_skipped_file_is_said_in_the_table_and_own_outputs_are_not_traces",)),
]
