"""Planted bugs in resuming a run as it was configured: the run's config.toml as the base, the
changes told, the LR schedule of the config resumed, hints that work as printed."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_resume_config.py"
STOP_HINT = f"{TESTS}::test_the_stop_hint_continues_the_run_as_it_was_configured"
END_HINT = f"{TESTS}::test_the_end_hint_extends_the_run_and_init_from_is_kept"
STOP_2_RANKS = ("tests/distributed/test_stop.py::"
                "test_signal_checkpoints_and_resume_continues_the_same_run[sigterm]")

BUGS = [
    Bug("resume-from-defaults", "a resume builds its config from the defaults, not the run's config.toml",
        "loom/cli.py",
        "    base, note = _resumed_config(args) if args.resume else (None, None)\n",
        "    base, note = None, None\n",
        (f"{TESTS}::test_resume_auto_starts_from_the_runs_config_toml", STOP_HINT)),
    Bug("ranks-ignore-run-config", "the ranks torchrun starts build their config without the run's "
        "config.toml (the launcher alone continues the run as configured)", "loom/cli.py",
        "    base, note = _resumed_config(args) if args.resume else (None, None)\n",
        '    base, note = _resumed_config(args) if args.resume and "RANK" not in os.environ '
        'else (None, None)\n',
        (STOP_2_RANKS,)),
    Bug("resume-changes-untold", "a resume changes settings without a line saying which",
        "loom/cli.py",
        '        print(f"loom: resume changes {key} {old!r} → {new!r}{why}", flush=True)\n',
        "        pass\n",
        (STOP_HINT, END_HINT)),
    Bug("resume-keeps-checkpoint-lr", "a resume trains at the checkpoint's train.lr, not the config's",
        "loom/train/checkpoint.py",
        '        return {**state, **_schedule_fields(doc), "base_lrs": state["base_lrs"]}\n',
        "        return {**state, **_schedule_fields(doc)}\n",
        (STOP_HINT,)),
    Bug("resume-first-step-old-schedule", "a resumed run's first step trains at the LR of the old schedule",
        "loom/train/checkpoint.py",
        "    scheduler._last_lr = [base * factor(scheduler.last_epoch)\n"
        "                          for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]\n",
        "",
        (STOP_HINT,)),
    Bug("stop-hint-drops-launch", "the stop's continue command leaves out the run's --nproc",
        "loom/cli.py",
        '        if value != default:\n            launch += [flag, str(value)]\n',
        '        pass\n',
        (STOP_HINT,)),
    Bug("end-hint-placeholder", "the end-of-run continue command holds a placeholder, not a step count",
        "loom/train/driver.py",
        "--set train.steps={2 * cfg.train.steps}",
        "--set train.steps=N",
        (END_HINT,)),
    Bug("init-from-change-as-tampering", "a resume without the run's model.init_from is refused as an "
        "altered checkpoint", "loom/cli.py",
        "        _check_same_model(meta, cfg, model, path)\n",
        "",
        (END_HINT,)),
]
