"""Planted bugs in the user pages (README and docs/) and what they name: a command, flag or
cross-reference that is no longer true."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_readme.py"
RUN = "tests/distributed/test_readme_commands.py"

BUGS = [
    Bug("readme-see-wrong-way", 'the planner page sends the reader to "This machine" above, a section below',
        "docs/planner.md",
        '(`--gpu local`, see "This machine" below)',
        '(`--gpu local`, see "This machine" above)',
        (f"{UNIT}::test_every_see_points_at_a_section_where_it_says",)),
    Bug("readme-flag-renamed", "loom export's --layout renamed, the README's synopsis left as it was",
        "loom/cli.py",
        '    export.add_argument("--layout", ',
        '    export.add_argument("--format", ',
        (f"{UNIT}::test_every_flag_of_a_usage_synopsis_exists",)),
    Bug("readme-walkthrough-broken", "the fine-tune walk-through's export command no longer runs",
        "docs/hugging-face.md",
        "tiny-llama-sft/model.safetensors --layout hf",
        "tiny-llama-sft --layout hf",
        (f"{RUN}::test_fine_tune_walkthrough_and_continued_pretraining",)),
    Bug("readme-key-renamed", "a config key the README's commands set is renamed in the config",
        "loom/config.py",
        "    log_to: list[str] = field(default_factory=list)",
        "    trackers: list[str] = field(default_factory=list)",
        (f"{UNIT}::test_run_blocks_parse",)),
]
