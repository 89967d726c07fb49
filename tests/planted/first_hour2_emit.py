"""Planted bugs in what `loom plan --emit` writes (issue 40, item 5): the CPU demo's data, LR, warmup
or steps left in, placeholders that `loom train` takes, a preset of another size under a --params
shape, a user's own settings overwritten, the comments lost."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_emit.py"
PRESET_EMIT = f"{TESTS}::test_a_preset_emit_derives_lr_warmup_and_steps_and_leaves_the_data_to_the_user"
REFUSAL = f"{TESTS}::test_loom_train_refuses_the_placeholders_until_set"
KEPT = f"{TESTS}::test_a_users_own_data_and_training_settings_are_kept"

BUGS = [
    Bug("emit-demo-data-kept", "--emit writes the CPU demo's data.source = 'stdlib' for a real model",
        "loom/plan/starting_point.py",
        "    if not d.mix and d.source == DataConfig.source:\n",
        "    if False:\n",
        (PRESET_EMIT, REFUSAL)),
    Bug("emit-placeholder-trains", "loom train takes a placeholder data.source (to fail later)",
        "loom/config.py",
        "        if this_machine and is_placeholder(value):\n",
        "        if False:\n",
        (REFUSAL, "tests/unit/test_bad_input.py::test_bad_input[data-placeholder]")),
    Bug("emit-demo-lr-kept", "--emit keeps the CPU demo's lr = 0.003 for an 8B model",
        "loom/plan/starting_point.py",
        "    if scratch and t.lr == default.lr:\n",
        "    if False:\n",
        (PRESET_EMIT,)),
    Bug("emit-lr-not-interpolated", "the LR of the table's row below the size, not interpolated to it",
        "loom/plan/starting_point.py",
        "    f = math.log(params / n0) / math.log(n1 / n0)\n",
        "    f = 0.0\n",
        (PRESET_EMIT,)),
    Bug("emit-steps-one-token-per-param", "steps from 1 token per parameter, not Chinchilla's 20",
        "loom/plan/starting_point.py",
        "math.ceil(TOKENS_PER_PARAM * params / tokens_per_step)",
        "math.ceil(params / tokens_per_step)",
        (PRESET_EMIT,)),
    Bug("emit-demo-warmup-kept", "warmup of the demo's 10 steps, not GPT-3's 375M tokens",
        "loom/plan/starting_point.py",
        "max(1, min(math.ceil(WARMUP_TOKENS / tokens_per_step), steps // 10))",
        "10",
        (PRESET_EMIT, KEPT)),
    Bug("emit-params-under-8b", "a --params shape written over preset 8b whatever its size",
        "loom/plan/command.py",
        "    base = min(LLAMA_PRESETS, key=",
        '    base = "8b" or min(LLAMA_PRESETS, key=',
        (f"{TESTS}::test_a_params_emit_writes_a_preset_of_its_own_size",)),
    Bug("emit-users-steps-overwritten", "the user's own train.steps replaced by the token budget",
        "loom/plan/starting_point.py",
        "    if scratch and t.steps == default.steps:\n",
        "    if scratch:\n",
        (KEPT,)),
    Bug("emit-comments-lost", "the emitted keys carry no comment saying where they come from",
        "loom/plan/command.py",
        "starting_point.annotate(to_toml(emitted), changes)",
        "to_toml(emitted)",
        (PRESET_EMIT,)),
]
