"""Planted bugs in the discovery commands (issue 40, item 8): a dry run that starts the run, a
config show that loses doc lines or the preset's values, a presets table with the wrong count, a
--help that points nowhere, a --gpu alias taken without a word."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_discover.py"

BUGS = [
    Bug("dry-run-starts-the-run",
        "--dry-run prints the plan, then goes on to make the run directory and launch",
        "loom/cli.py",
        "        print_dry_run(cfg, model, spec.world_size, spec.nproc)\n        return 0\n",
        "        print_dry_run(cfg, model, spec.world_size, spec.nproc)\n",
        (f"{TESTS}::test_dry_run_checks_plans_and_starts_nothing",)),
    Bug("config-show-block-comments-lost", "a field documented by the comment lines above it shows no doc",
        "loom/config_show.py",
        "        while alone(row - 1):\n",
        "        while False:\n",
        (f"{TESTS}::test_every_key_has_its_doc_line_from_the_source",
         f"{TESTS}::test_config_show_puts_each_key_under_its_doc")),
    Bug("config-show-preset-unresolved",
        "a model shape left to the preset shows as unset, not the preset's value",
        "loom/config_show.py",
        '    if section == "model" and key in {f.name for f in dataclasses.fields(GPTConfig)}:\n',
        '    if False:\n',
        (f"{TESTS}::test_config_show_resolves_the_preset",)),
    Bug("presets-active-as-total", "an MoE preset's active parameters are its total",
        "loom/preset_table.py",
        "params_text(g.num_params(active=True))",
        "params_text(g.num_params())",
        (f"{TESTS}::test_presets_table_lists_every_shape",)),
    Bug("train-help-points-nowhere", "loom train --help without the epilog naming the discovery commands",
        "loom/cli.py",
        'description="Train a model with the configured strategy.", epilog=TRAIN_EPILOG)',
        'description="Train a model with the configured strategy.")',
        (f"{TESTS}::test_train_help_points_to_the_discovery_commands",)),
    Bug("gpu-alias-unsaid", "--gpu H100 is taken as H100-SXM without a note",
        "loom/cli.py",
        "    if alias is not None:  # (stderr: --format json keeps stdout to the JSON)\n",
        "    if False:\n",
        (f"{TESTS}::test_a_gpu_alias_is_said_once",)),
]
