"""Planted bugs in what the user pages say and what their commands print (issue 40, items 3, 6, 8
and 9): a figure that drifts from its command, a recipe table apart from its header, a README
command that prints a library's progress bars, a dry run of several nodes planned as one."""

from __future__ import annotations

from planted import Bug

FIGURES = "tests/unit/test_readme_figures.py"
RECIPES = "tests/unit/test_first_hour2_recipes.py"
DISCOVER = "tests/unit/test_first_hour2_discover.py"

BUGS = [
    Bug("recipe-table-drift", "the recipes table quotes a tokens/s its recipe's header (and plan) does not",
        "examples/recipes/README.md",
        "| 53.4 GB | 65,749 |",
        "| 53.4 GB | 66,749 |",
        (f"{RECIPES}::test_the_recipes_table_quotes_each_header",)),
    Bug("dry-run-one-node", "`loom train --dry-run --nnodes 2` plans the ranks as one node",
        "loom/train/dry_run.py",
        "plan_run(cfg, model.shape, layout, per_node=per_node)",
        "plan_run(cfg, model.shape, layout)",
        (f"{DISCOVER}::test_dry_run_of_several_nodes_plans_across_them",)),
    Bug("zero-recipe-bytes-changed", "the ZeRO paper's recipe prices 14 optimizer bytes per parameter, "
        "the docs' 70B figures left as they were",
        "loom/plan/memory.py",
        '"zero": (2, 2, 12),',
        '"zero": (2, 2, 14),',
        (FIGURES,)),
]
