"""Planted bugs in what a run shows (issue 40, item 7): its report.html's curves, the progress line on
a terminal, the final eval in metrics.jsonl, and the end-of-run MFU."""

from __future__ import annotations

from planted import Bug

T = "tests/unit/test_first_hour2_report.py"

BUGS = [
    Bug("report-curve-wrong-column", "the training-loss curve is drawn from the learning rate column",
        "loom/observe/curves.py",
        '"loss": ("loss", "training loss", "#4c78a8")',
        '"loss": ("lr", "training loss", "#4c78a8")',
        (f"{T}::test_run_report_curves_are_the_runs_numbers", f"{T}::test_ledger_report_gains_the_curves")),
    Bug("report-curve-y-flipped", "the curves' y axis is drawn upside down (a falling loss rises)",
        "loom/observe/curves.py",
        "        return top + ph - (y - y0) / (y1 - y0) * ph\n",
        "        return top + (y - y0) / (y1 - y0) * ph\n",
        (f"{T}::test_run_report_curves_are_the_runs_numbers", f"{T}::test_report_renders_in_chromium")),
    Bug("report-over-users-file", "a run's report.html replaces the user's own file of that name",
        "loom/observe/run_report.py",
        "    if path.exists() and not path.is_symlink() and not is_loom_report(path):\n",
        "    if False:\n",
        (f"{T}::test_a_users_report_html_stays_and_loom_own_is_replaced",)),
    Bug("final-eval-missing", "the final eval is not written to metrics.jsonl (summary.json only)",
        "loom/train/driver.py",
        "        if step == t.steps:  # the final eval: in the last step's metrics, before its checkpoint\n",
        "        if False:  # the final eval after the loop, as before\n",
        (f"{T}::test_a_run_writes_its_final_eval_report_and_mfu",)),
    Bug("progress-no-cr-on-tty", "the progress line on a terminal is printed as new lines, not redrawn",
        "loom/train/meters.py",
        "        self.tty = enabled and stream.isatty()\n",
        "        self.tty = False\n",
        (f"{T}::test_progress_redraws_in_place_on_a_terminal",)),
    Bug("mfu-wrong-peak", "MFU is figured on the device's memory bandwidth, not its bf16 peak",
        "loom/train/record.py",
        '    record["peak_tflops"] = cluster.gpu.bf16_tflops if cluster.gpu else None\n',
        '    record["peak_tflops"] = cluster.gpu.hbm_tbps * 1000 if cluster.gpu else None\n',
        (f"{T}::test_mfu_on_a_catalog_gpu_and_na_without_a_peak",)),
]
