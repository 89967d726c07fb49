"""Planted bugs in the lean decoder block (issue 26): its autograd Functions' backwards, what they
keep, GQA without repeats, and the planner's count of the saved tensors."""

from __future__ import annotations

from planted import Bug

LEAN = "tests/unit/test_lean_block.py"
OPS = "loom/models/gpt/lean_ops.py"
FP32 = (f"{LEAN}::test_lean_block_equals_the_reference_in_fp32",)
SAVED = (f"{LEAN}::test_saved_bytes_are_the_planners_formula",)
NOISE = (f"{LEAN}::test_lean_block_is_within_the_references_bf16_noise",
         f"{LEAN}::test_each_piece_computes_the_references_forward_bit_for_bit")
# SwiGLU alone runs where w2 is hooked (TP): the block's fused MLP does not go through it
SWIGLU = (f"{LEAN}::test_a_hooked_w2_goes_through_its_module_and_keeps_the_product",)

BUGS = [
    Bug("lean-norm-grad-drops-mean", "RMSNorm's input gradient leaves out the statistics' term", OPS,
        "grad_x = (rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True)))",
        "grad_x = (rstd * gn)", FP32),
    Bug("lean-norm-grad-w-unrounded", "RMSNorm's weight gradient from the input, not the normalized tensor",
        OPS, "grad_w = (g * xhat.type_as(x).float())", "grad_w = (g * x.float())", FP32),
    Bug("lean-norm-keeps-fp32", "RMSNorm keeps its fp32 copy of the input for backward", OPS,
        "ctx.save_for_backward(x, weight, rstd)", "ctx.save_for_backward(xf, weight, rstd)", SAVED),
    Bug("lean-norm-no-autocast-cast", "under autocast the norm hands fp32 on: each linear casts a copy", OPS,
        "one per linear.\n        return out if out_dtype is None else out.to(out_dtype)",
        "one per linear.\n        return out", SAVED),
    Bug("lean-rope-backward-same-way", "RoPE's backward rotates the gradient forward, not back", OPS,
        "return _rotate(grad, rope, -1.0), None", "return _rotate(grad, rope, 1.0), None", FP32),
    Bug("lean-swiglu-grad-up-wrong", "SwiGLU's up gradient uses gate, not silu(gate)", OPS,
        "        grad_up = F.silu(gate).mul_(grad)\n", "        grad_up = gate * grad\n", SWIGLU),
    Bug("lean-swiglu-grads-swapped", "SwiGLU's backward uses up where gate belongs", OPS,
        "        grad_gate = grad * up\n        return torch.ops.aten.silu_backward.grad_input("
        "grad_gate, gate,",
        "        grad_gate = grad * gate\n        return torch.ops.aten.silu_backward.grad_input("
        "grad_gate, up,",
        SWIGLU),
    Bug("lean-gqa-repeats", "attention repeats k, v to every head instead of enable_gqa",
        "loom/parallel/sdpa.py",
        "    if device.type != \"cuda\":\n        return True\n",
        "    if device.type != \"cuda\":\n        return False\n",
        (f"{LEAN}::test_gqa_runs_the_fused_kernel_without_repeating_k_v", *SAVED)),
    Bug("lean-formula-kv-repeated", "the planner counts k, v as wide as q (repeated)", "loom/plan/shapes.py",
        "split = sb * ((2 * h + 2 * kv + mlp_saved_widths(tp) * f) * elem + 4 * shape.n_heads)",
        "split = sb * ((4 * h + mlp_saved_widths(tp) * f) * elem + 4 * shape.n_heads)", SAVED),
    Bug("lean-formula-silu-kept", "the planner still counts silu(gate) among the MLP's saved tensors",
        "loom/plan/shapes.py",
        "split = sb * ((2 * h + 2 * kv + mlp_saved_widths(tp) * f) * elem + 4 * shape.n_heads)",
        "split = sb * ((2 * h + 2 * kv + (mlp_saved_widths(tp) + 1) * f) * elem + 4 * shape.n_heads)", SAVED),
    Bug("lean-norm-stats-in-bf16", "RMSNorm takes its statistics in the input's 16-bit dtype", OPS,
        "        xf = x.float()\n        rstd", "        xf = x\n        rstd", NOISE),
    Bug("swiglu-backward-three-wide", "TP's SwiGLU backward holds three f-wide tensors of its own "
        "(silu(gate) beside both gradients)", OPS,
        "        grad_up = F.silu(gate).mul_(grad)\n        grad_gate = grad * up\n"
        "        return torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate), "
        "grad_up\n",
        "        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)\n"
        "        return grad_gate, grad * F.silu(gate)\n",
        (f"{LEAN}::test_swiglu_backward_is_autograds_with_two_wide_tensors_of_its_own",
         "tests/distributed/test_plan_measured.py::test_measured_matches_plan[tp2xddp-ac-accum2]")),
]
