"""Planted bugs in silencing stray lines (issue 40, item 3): Kineto's USDT/STAGE marks kept, or
everything said during the profiler's steps dropped with them (loom/observe/profiler.py)."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_first_hour2_noise.py"

BUGS = [
    Bug('kineto-marks-kept', "Kineto's USDT profiler_start/stop lines reach the progress line",
        'loom/observe/profiler.py',
        '                            if not _KINETO_MARK.match(line))',
        '                            if True)',
        (f"{UNIT}::test_a_profiled_loop_prints_no_kineto_marks", f"{UNIT}::test_only_the_marks_are_dropped")),
    Bug('kineto-errors-dropped', "everything fd 2 received during the profiler's steps is dropped, Kineto's "
        "errors with its marks",
        'loom/observe/profiler.py',
        '            if kept:\n                os.write(2, kept)\n',
        '',
        (f"{UNIT}::test_only_the_marks_are_dropped",)),
]
BUGS += [
    Bug('scalar-collective-unsized', "a 0-d tensor's all-reduce (dims []) has no size: 'rank 0: 3 of 15 "
        "collectives have no recorded size' in every profile",
        'loom/observe/ledger.py',
        '            if d == [] and i < len(types) and _dtype_bytes(types[i]):\n',
        '            if False:\n',
        (f"{UNIT}::test_a_scalar_collective_has_a_size",)),
    Bug('deepspeed-build-note-shown', "DeepSpeed's 'built successfully' line printed by every rank",
        'loom/parallel/known_warnings.py',
        '                             if not DEEPSPEED_BUILT.match(line.rstrip("\\n"))))',
        '                             if True))',
        (f"{UNIT}::test_the_known_third_party_lines_are_dropped_each_by_its_message",)),
    Bug('deepspeed-accelerator-unnamed', "DS_ACCELERATOR left unset: DeepSpeed warns 'Setting accelerator "
        "to CPU' on every rank",
        'loom/config.py',
        '    if "DS_ACCELERATOR" not in os.environ:\n',
        '    if False:\n',
        (f"{UNIT}::test_the_known_third_party_lines_are_dropped_each_by_its_message",)),
    Bug('mesh-slicing-warning-shown', "DeviceMesh's 'Slicing a flattened dim' warning under cp and ep",
        'loom/parallel/known_warnings.py',
        '    warnings.filterwarnings("ignore", message=FLATTENED_DIM_SLICING, category=UserWarning)\n',
        '    pass\n',
        (f"{UNIT}::test_the_known_third_party_lines_are_dropped_each_by_its_message",)),
]
