"""Planted bugs in examples/recipes/ (issue 40, item 6): a recipe whose layout no longer fits, whose
step count leaves its token budget, whose data fall back to the CPU demo's, a planner change that
makes the recipes' stated figures wrong, and sequence parallel's pipeline stages given RoPE for
their share of the sequence (what the 3-D recipe's tiny run found)."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_recipes.py"
TINY = "tests/distributed/test_recipes_tiny.py"

BUGS = [
    Bug("recipe-3d-without-recompute",
        "the 70B 3-D recipe drops its selective recompute (71 GB of 80 per GPU)",
        "examples/recipes/llama3-70b-3d.toml",
        'activation_checkpointing = "selective"  # every 3rd block',
        'activation_checkpointing = "none"  # every 3rd block',
        (f"{TESTS}::test_recipe_fits_as_its_header_says[llama3-70b-3d]",)),
    Bug("recipe-moe-without-ep", "the Mixtral recipe loses its expert parallelism",
        "examples/recipes/mixtral-8x7b-ep.toml",
        "ep = 4  # each block's experts",
        "ep = 1  # each block's experts",
        (f"{TESTS}::test_recipe_fits_as_its_header_says[mixtral-8x7b-ep]",)),
    Bug("recipe-steps-off-budget", "the 8B recipe's steps no longer its token budget over its tokens a step",
        "examples/recipes/llama3-8b-fsdp.toml",
        "steps = 19074  #",
        "steps = 20000  #",
        (f"{TESTS}::test_recipe_steps_come_from_its_token_budget[llama3-8b-fsdp]",)),
    Bug("recipe-demo-data", "a recipe trains on the CPU demo's corpus when the user sets no data",
        "examples/recipes/llama3-70b-lora.toml",
        'source = "<your fine-tuning data: JSONL of prompt/completion or messages records>"',
        'source = "stdlib"',
        (f"{TESTS}::test_recipe_data_are_placeholders_not_the_demo[llama3-70b-lora]",)),
    Bug("planner-fragmentation-halved",
        "the planner's fragmentation margin halved: every recipe's figure drifts",
        "loom/plan/hardware.py",
        "    fragmentation: float = 0.10  # allocator margin",
        "    fragmentation: float = 0.05  # allocator margin",
        (f"{TESTS}::test_recipe_fits_as_its_header_says[llama3-8b-fsdp]",)),
    Bug("pp-stage-rope-ignores-sp", "a later pipeline stage under sequence parallel takes RoPE for 1/tp of "
        "the sequence",
        "loom/models/gpt/tensor_parallel.py",
        "model.residual_shards = tp_mesh.size() if sequence_parallel else 1",
        "model.residual_shards = 1",
        (f"{TINY}::test_recipe_trains_tiny[llama3-70b-3d]",
         "tests/distributed/test_strategies.py::test_pipeline_parallel_matches_single_process[pp2xtp2-sp]")),
]
