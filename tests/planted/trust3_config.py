"""Planted bugs in config loading and planning (issue 38, config): a UTF-8 byte-order mark,
`[[train]]`, `loom plan --params` beside `--model`, and analyze/bench `--out` a file."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_trust3_config.py"
CASE = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug('config-bom-refused', "a config file starting with a UTF-8 BOM is 'not valid TOML'",
        'loom/config.py',
        '    text = text.removeprefix("\\ufeff")\n',
        '',
        (f"{UNIT}::test_a_config_file_starting_with_a_utf8_bom_is_read",)),
    Bug('config-array-of-tables-misnamed', "[[train]] is called 'outside any [section]'",
        'loom/config.py',
        '        if isinstance(table, list) and section in _SECTION_NAMES',
        '        if False and isinstance(table, list) and section in _SECTION_NAMES',
        (f"{UNIT}::test_an_array_of_tables_is_named_with_its_fix", f"{CASE}[config-array-of-tables]")),
    Bug('plan-params-beside-model-ignored', "loom plan --params X --model Y plans X and ignores --model",
        'loom/plan/command.py',
        '    if model is not None and args.params is not None:',
        '    if False:',
        (f"{CASE}[plan-params-and-model]",)),
    Bug('analyze-out-file-unchecked', "analyze --out FILE: reads the traces, then a traceback",
        'loom/cli.py',
        '        if problem := not_a_folder(args.out):  # before the traces are read',
        '        if False:',
        (f"{CASE}[analyze-out-is-a-file]",)),
    Bug('bench-out-file-unchecked', "bench --out FILE: calibrates first, then a traceback",
        'bench/suite.py',
        '    if problem := not_a_folder(a.out):  # before any calibration or benchmark runs',
        '    if False:',
        (f"{CASE}[bench-out-is-a-file]",)),
    Bug('size-check-fp32-weights-only', "the pre-launch size check counts 4 bytes a parameter, not 16",
        'loom/config.py',
        'TRAINING_BYTES = ((strategies.PARAMS, 4), (strategies.GRADS, 4), (strategies.OPTIMIZER, 8))',
        'TRAINING_BYTES = ((strategies.PARAMS, 4),)',
        (f"{UNIT}::test_the_size_check_counts_training_state_not_fp32_weights_alone",)),
    Bug('config-source-beside-mix-ignored', "data.source beside data.mix is silently ignored",
        'loom/config.py',
        '    if d.mix and d.source != DataConfig.source:',
        '    if False:',
        (f"{CASE}[config-source-beside-mix]",)),
    Bug('inert-pp-keys-unnoted', "pipeline keys set with pp = 1 pass without a note",
        'loom/config.py',
        '    if dims.pp == 1:\n',
        '    if False:\n',
        (f"{UNIT}::test_a_key_the_layout_never_reads_gets_a_note",)),
    Bug('plan-pinned-layout-ignored', "loom plan ignores the parallel keys --set pins on a bare model",
        'loom/plan/command.py',
        'yours, pinned = None, sorted(',
        'yours, pinned = None, [] and sorted(',
        (f"{UNIT}::test_a_layout_pinned_by_set_is_priced_beside_the_plan",)),
]
