"""Planted bugs in the leaner block (issue 26, items 3 and 6): SwiGLU fused with the down projection
(swiglu_down), its fallback under tensor parallel, and the planner's count of what it keeps."""

from __future__ import annotations

from planted import Bug

LEAN = "tests/unit/test_lean_block.py"
OPS = "loom/models/gpt/lean_ops.py"
SHAPES = "loom/plan/shapes.py"
DOWN = (f"{LEAN}::test_swiglu_down_is_the_reference_product_and_linear",
        f"{LEAN}::test_lean_block_equals_the_reference_in_fp32")
SAVED = (f"{LEAN}::test_saved_bytes_are_the_planners_formula",
         "tests/unit/test_plan_formulas.py::test_block_activations_are_what_autograd_keeps")

BUGS = [
    Bug("down-product-recomputed-wrong", "swiglu_down's backward recomputes w2's input as gate · up", OPS,
        "                product = F.silu(gate).mul_(up)", "                product = gate * up", DOWN),
    Bug("down-grad-up-from-gate", "swiglu_down's up gradient multiplies by gate, not silu(gate)", OPS,
        "    grad_up = F.silu(gate).mul_(grad_product)", "    grad_up = gate * grad_product", DOWN),
    Bug("down-weight-grad-from-gate", "swiglu_down's weight gradient from gate instead of the product", OPS,
        "grad_w = grad.flatten(0, -2).t().mm(product.flatten(0, -2))",
        "grad_w = grad.flatten(0, -2).t().mm(gate.flatten(0, -2))", DOWN),
    Bug("down-keeps-weight-copy", "swiglu_down keeps its 16-bit cast of w2 for backward", OPS,
        "ctx.save_for_backward(gate, up, weight)  # the weight", "ctx.save_for_backward(gate, up, "
        "weight.to(gate.dtype))  # the weight",
        (f"{LEAN}::test_swiglu_down_keeps_gate_and_up_not_the_product_nor_a_weight_copy", *SAVED)),
    Bug("down-ignores-tp-hooks", "FeedForward fuses w2 even when its module has hooks (TP's row-parallel w2)",
        "loom/models/gpt/model.py", "if _hooked(self.w2) or ", "if ",
        (f"{LEAN}::test_a_hooked_w2_goes_through_its_module_and_keeps_the_product",)),
    Bug("formula-mlp-keeps-product", "the planner still counts the product (w2's input) without TP", SHAPES,
        "return 2 if tp == 1 else 3", "return 3", SAVED),
    Bug("formula-tp-drops-product", "the planner drops the product under TP too (not fused there)",
        SHAPES, "return 2 if tp == 1 else 3", "return 2",
        (f"{LEAN}::test_a_hooked_w2_goes_through_its_module_and_keeps_the_product",
         "tests/unit/test_plan_formulas.py::test_activation_tally_by_hand")),
    Bug("formula-autocast-caches-w2", "the planner's autocast weight copies leave w2's out of the ones kept",
        SHAPES, "return self.layer_params - self.layer_norm_params - self.d_model * self.ffn_hidden",
        "return self.layer_params - self.layer_norm_params", SAVED),
    Bug("elementwise-product-not-recounted", "BLOCK_ELEMENTWISE leaves out the product's recompute (16·f)",
        "loom/plan/step.py", "BLOCK_ELEMENTWISE = (93, 22, 18)", "BLOCK_ELEMENTWISE = (93, 16, 18)",
        ("tests/unit/test_plan_truth.py::test_block_elementwise_count_matches_the_block",)),
]
