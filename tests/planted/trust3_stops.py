"""Planted bugs in "every stop saves" (issue 38): data-loader workers leaving the stop signals to
their trainer (loom/data/loader.py), one Ctrl-C delivered twice read as one (loom/launch.py,
loom/train/stop.py), `loom profile --nproc 1` analyzing its traces (loom/cli.py), and a rank's
restart said in one line, its details in the run's logs (loom/train/torchrun.py, loom/launch.py)."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_trust3_stops.py"
GROUP = "tests/distributed/test_stop.py::test_a_signal_to_the_process_group_under_timeout_saves"
RESTART = "tests/distributed/test_faults.py::test_killed_rank_restarts_and_resumes_from_the_latest_checkpoint"

BUGS = [
    Bug('worker-dies-of-stop', "the DataLoader workers keep torch's SIGTERM handler (a process group's "
        "SIGTERM kills them and crashes the trainer, which saves nothing)",
        'loom/data/loader.py',
        '        kwargs.setdefault("worker_init_fn", leave_stops_to_the_trainer)\n',
        '',
        (f"{UNIT}::test_a_data_loader_worker_outlives_the_stop_signals_its_trainer_handles",
         f"{GROUP}[1-sigterm]")),
    Bug('worker-ignores-every-sigterm', "the workers ignore every SIGTERM, their trainer's too: "
        "Python's exit, which ends a live loader's daemonic workers with one and waits, hangs for good",
        'loom/data/loader.py',
        '        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == os.getppid():\n',
        '        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == -1:\n',
        (f"{UNIT}::test_a_script_leaving_a_loader_running_exits",)),
    Bug('ctrl-c-window-zero', 'no window for one Ctrl-C delivered twice: its copy aborts the run',
        'loom/launch.py',
        'SAME_CTRL_C_S = 1.0\n',
        'SAME_CTRL_C_S = 0.0\n',
        (f"{UNIT}::test_one_ctrl_c_delivered_twice_is_one_and_a_later_one_aborts",
         f"{UNIT}::test_the_launchers_rule_for_a_signal_after_the_first")),
    Bug('ctrl-c-any-second-aborts', "the trainer's handler aborts on any SIGINT after the first stop signal",
        'loom/train/stop.py',
        '    elif aborts(signum, _received_at, time.monotonic()):  # a second Ctrl-C: abort now\n',
        '    elif signum == signal.SIGINT:\n',
        (f"{UNIT}::test_one_ctrl_c_delivered_twice_is_one_and_a_later_one_aborts",
         f"{UNIT}::test_only_a_ctrl_c_aborts_and_the_window_counts_from_the_first_signal")),
    Bug('profile-thinks-it-is-a-rank', 'loom profile takes its own --nproc for a launcher having started it '
        'as a rank: no ledger, report or findings',
        'loom/cli.py',
        '    a_rank = under_launcher(launching)  #',
        '    a_rank = launching  #',
        (f"{UNIT}::test_profile_of_one_process_writes_the_ledger_report_and_findings",)),
    Bug('restart-traceback-on-console', "a rank's failure with a restart left is shown, not kept in the log",
        'loom/launch.py',
        '    if not agent_log or restarts_left() <= 0:\n',
        '    if not agent_log or restarts_left() >= 0:\n',
        (f"{UNIT}::test_a_ranks_failure_with_a_restart_left_goes_to_the_log", RESTART)),
    Bug('restart-agent-log-on-console', "torchrun's records of a restarting group's processes reach the "
        "console",
        'loom/train/torchrun.py',
        '        if self.restarts_left > 0 and record.name.startswith(f"{ELASTIC}.multiprocessing"):\n',
        '        if False:\n',
        (f"{UNIT}::test_the_agents_log_keeps_everything_and_the_console_not_a_restarting_groups_failures",
         RESTART)),
    Bug('restart-names-the-survivor', 'the restart line names every rank that exited, the survivor whose '
        'collective broke too',
        'loom/train/torchrun.py',
        '    return {r: c for r, c in own.items() if c < 0} or own or failures\n',
        '    return own or failures\n',
        (f"{UNIT}::test_the_ranks_a_restart_names", RESTART)),
    Bug('restart-line-missing', 'no line for a restart (the agent not watched)',
        'loom/train/torchrun.py',
        '        announce_restarts(log)\n',
        '        pass\n',
        (RESTART,)),
]
