"""Planted bugs in observability: the diagnosis, stragglers, the step ledger, the phase timers and
the metrics they feed."""

from __future__ import annotations

from planted import Bug

FINDINGS = "tests/unit/test_diagnosis_findings.py"
LEDGER = "tests/unit/test_ledger.py"
METRICS = "tests/distributed/test_profile.py::test_light_ledger_in_metrics"

BUGS = [
    Bug("diagnose-comm-knob-swapped", "exposed all-reduces name DDP's bucket size for a sharded run "
        "(and none for DDP)",
        "loom/observe/diagnose.py",
        'if kind == "all_reduce" and strategy in ("ddp", "zero1"):',
        'if kind == "all_reduce" and strategy not in ("ddp", "zero1"):',
        (f"{FINDINGS}::test_exposed_communication_names_the_knob_of_the_layout_that_ran",)),
    Bug("diagnose-io-knob", "the IO finding names data.prefetch_factor, not data.num_workers",
        "loom/observe/diagnose.py",
        '"data.num_workers", suggest,',
        '"data.prefetch_factor", suggest,',
        (f"{FINDINGS}::test_io",)),
    Bug("diagnose-idle-never", "the idle finding never fires",
        "loom/observe/diagnose.py",
        "if idle >= SHARE and not stragglers:",
        "if idle > 100 and not stragglers:",
        (f"{FINDINGS}::test_idle",)),
    Bug("diagnose-optimizer-never", "the optimizer finding never fires",
        "loom/observe/diagnose.py",
        "if opt >= 30.0:",
        "if opt > 100.0:",
        (f"{FINDINGS}::test_optimizer",)),
    Bug("diagnose-sync-threshold", "host syncs flagged only from 10 per step",
        "loom/observe/diagnose.py",
        "if syncs >= 1:",
        "if syncs >= 10:",
        (f"{FINDINGS}::test_host_syncs_and_tiny_kernels",)),
    Bug("diagnose-straggler-knob", "a straggler with high IO is sent to its host, one without to "
        "data.num_workers",
        "loom/observe/diagnose.py",
        "        if own_io >= SHARE:",
        "        if own_io < SHARE:",
        (f"{FINDINGS}::test_straggler_names_the_late_rank_and_what_to_fix",)),
    Bug("straggler-threshold-x10", "a straggler must delay its step by 4× the step (not 40%)",
        "loom/observe/stragglers.py",
        "late_ms >= max(1.0, 0.4 * mean_wall)",
        "late_ms >= max(1.0, 4 * mean_wall)",
        (f"{FINDINGS}::test_stragglers_from_crafted_arrivals",)),
    Bug("straggler-first-not-last", "the rank arriving first taken as the one that sets the pace",
        "loom/observe/stragglers.py",
        "last_rank = max(arrivals, key=arrivals.get)",
        "last_rank = min(arrivals, key=arrivals.get)",
        (f"{FINDINGS}::test_stragglers_from_crafted_arrivals",)),
    Bug("timers-forward-backward-swapped", "the forward and backward phase timers swapped",
        "loom/train/meters.py",
        'return {f"{name}_s": value for name, value in seconds.items()}',
        'return {f"{ {\'forward\': \'backward\', \'backward\': \'forward\'}.get(name, name)}_s": value\n'
        '                for name, value in seconds.items()}',
        (METRICS,)),
    Bug("metrics-step-off-by-one", "metrics.jsonl numbers each step one ahead",
        "loom/train/driver.py",
        'self.pending = {"step": step, "lr": out.lr,',
        'self.pending = {"step": step + 1, "lr": out.lr,',
        (METRICS,)),
    Bug("ledger-hidden-as-exposed", "communication in flight under compute counted as exposed",
        "loom/observe/ledger.py",
        "comm_m = (cov[1] & ~cov[0]) | (cov[3] & ~cov[0] & ~cov[1] & ~cov[2])",
        "comm_m = (cov[1] & ~cov[0]) | (cov[3] & ~cov[0] & ~cov[1])",
        (f"{LEDGER}::test_cpu_trace_ledger_is_exact",
         "tests/distributed/test_ledger_gloo.py::test_ledger_against_clocks_outside_the_profiler")),
    Bug("ledger-compute-during-io", "ops inside a DataLoader fetch counted as compute too (idle, the "
        "remainder, shrinks to make the sum hold)",
        "loom/observe/ledger.py",
        "compute_m = cov[2] & ~cov[0] & ~cov[1]",
        "compute_m = cov[2] & ~cov[1]",
        (f"{LEDGER}::test_cpu_trace_ledger_is_exact",)),
    Bug("ledger-compute-includes-inflight", "time a collective is in flight counted as compute",
        "loom/observe/ledger.py",
        "compute_m = cov[2] & ~cov[0] & ~cov[1]",
        "compute_m = (cov[2] | cov[3]) & ~cov[0] & ~cov[1]",
        ("tests/distributed/test_ledger_gloo.py::test_ledger_against_clocks_outside_the_profiler",)),
    Bug("ledger-optimizer-syncs-as-users", "the optimizer's own host syncs counted as the training step's",
        "loom/observe/ledger.py",
        "opt_syncs, syncs = syncs[in_optimizer], syncs[~in_optimizer]",
        "syncs, opt_syncs = syncs[in_optimizer], syncs[~in_optimizer]",
        (f"{LEDGER}::test_cpu_trace_ledger_is_exact",)),
]
