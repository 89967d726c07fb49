"""Planted bugs in the fourth pass over bad input: exports into checkpoints, run directories loom could
not finish in, `loom plan`'s own layout against its model, printed commands that run as pasted."""

from __future__ import annotations

from planted import Bug

BAD = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug("export-into-its-checkpoint", "loom export writes into the checkpoint it reads (--overwrite replaces "
        "its files)", "loom/train/export.py", "    _outside_checkpoints(output, path)\n", "",
        (f"{BAD}[export-into-its-checkpoint]", f"{BAD}[export-into-checkpoints]")),
    Bug("export-read-only-late", "an output folder loom cannot write found after the checkpoint is read",
        "loom/train/export.py",
        '    check_writable(parent, "the output folder", "choose an output path in a folder you can '
        'write")\n',
        "",
        (f"{BAD}[export-output-read-only]",)),
    Bug("run-dir-writable-unchecked", "a continued run's folder that takes no file found at its first write",
        "loom/cli.py", '    check_writable(run_dir, "the run directory")  # one that exists, a continued '
        'run\'s\n', "", (f"{BAD}[resume-run-dir-read-only]",)),
    Bug("run-entries-unchecked", "a run file that is a folder found when the run ends", "loom/cli.py",
        "    check_checkpoints_dir(run_dir)\n    check_run_entries(run_dir)\n",
        "    check_checkpoints_dir(run_dir)\n", (f"{BAD}[resume-run-file-is-a-folder]",)),
    Bug("plan-layout-unchecked", "loom plan prices a config's layout its model cannot take (a traceback "
        "where the pipeline has more stages than layers)", "loom/plan/command.py",
        "    if shape.known:\n        check_layout(", "    if False:\n        check_layout(",
        (f"{BAD}[plan-set-pp-over-layers]", f"{BAD}[plan-set-tp-heads]", f"{BAD}[plan-set-ep-dense]")),
    Bug("plan-model-set-ignored", "loom plan --model X --set model.* plans X and drops the --set unsaid",
        "loom/plan/command.py", "    if model is not None and changed:", "    if False:",
        (f"{BAD}[plan-model-and-set-model]",)),
    Bug("permission-read-as-damage", "a checkpoint this user may not read called damaged",
        "loom/train/safe_load.py",
        "    if isinstance(e, PermissionError):", "    if False:", (f"{BAD}[ckpt-not-readable]",)),
    Bug("export-hint-unquoted", "the end of a run prints its export command with the path unquoted",
        "loom/train/driver.py", "name, step = last.parents[1].name, shlex.quote(str(last))",
        "name, step = last.parents[1].name, str(last)",
        ("tests/unit/test_resume_config.py::test_the_end_hint_extends_the_run_and_init_from_is_kept",)),
    Bug("closed-pipe-traceback", "`loom … | head` ends in a BrokenPipeError traceback", "loom/cli.py",
        "        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit\n", "",
        ("tests/unit/test_cli.py::test_a_closed_pipe_is_no_traceback",)),
    Bug("init-from-tokenizer-unchecked", "a checkpoint trained on one tokenizer's ids fine-tuned on "
        "another's", "loom/train/task.py",
        "        _check_same_tokenizer(cfg, meta, checkpoint)\n", "",
        (f"{BAD}[model-init-from-other-tokenizer]",)),
    Bug("mix-weights-overflow", "data.mix's weights summed as given: the largest floats overflow to inf "
        "and a source is never drawn", "loom/data/mix.py",
        "    scaled /= scaled.max()  # weights near float64's top would sum to inf (and a source never be "
        "drawn)\n", "", ("tests/unit/test_mix_weights.py",)),
    Bug("missing-ranks-unsaid", "traces of some of a run's ranks analyzed as if they were all of them",
        "loom/observe/ledger.py", "    if missing:  # each present rank's ledger holds",
        "    if False:  # each present rank's ledger holds",
        ("tests/unit/test_ledger.py::test_a_missing_ranks_trace_is_said",)),
    Bug("glob-skips-unreadable", "a recursive glob's folder loom cannot list skipped without a word",
        "loom/data/corpus.py", '    if "**" in pattern.parts:  # glob skips a folder it cannot list',
        '    if False:  # glob skips a folder it cannot list', (f"{BAD}[data-glob-subfolder-unreadable]",)),
    Bug("rank-env-unchecked", "a RANK or SLURM_NTASKS left in the shell reaches torch's rendezvous",
        "loom/cli.py", "    check_rank_env()  # a RANK or SLURM_NTASKS left in a shell",
        "    pass  # (planted)",
        (f"{BAD}[env-rank-not-a-number]", f"{BAD}[env-rank-alone]",
         f"{BAD}[env-slurm-ntasks-no-task]")),
    Bug("stray-rank-over-nproc", "RANK in the environment makes `loom train --nproc N` a rank, past every "
        "check", "loom/launch.py", '    return not launching and ("RANK" in os.environ',
        '    return ("RANK" in os.environ',
        (f"{BAD}[env-rank-with-nproc]",)),
    Bug("bench-out-empty-accepted", "loom bench --out '' writes into the working directory",
        "bench/suite.py", "    if not a.out.strip():  # Path(\"\") is the working directory",
        "    if False:  # Path(\"\") is the working directory",
        (f"{BAD}[bench-out-empty]",)),
    Bug("calibrate-target-unchecked", "loom plan --calibrate measures for minutes, then replaces whatever "
        "LOOM_DEVICE_PROFILE names", "loom/cli.py",
        "        check_profile_target()  # and where the profile goes\n", "",
        (f"{BAD}[plan-calibrate-over-other-file]", f"{BAD}[plan-calibrate-into-folder]")),
    Bug("resume-profile-window-unchecked", "a resumed profile run with fewer steps left than its schedule",
        "loom/cli.py", "        if prof.enabled and needs > cfg.train.steps - done:",
        "        if False and needs > cfg.train.steps - done:", (f"{BAD}[resume-profile-too-long]",)),
]
