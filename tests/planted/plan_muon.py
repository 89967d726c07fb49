"""Planted bugs in the planner's Muon (loom/plan/muon.py, memory.py): its states, its Newton-Schulz
FLOPs and its owners' exchange, each caught by tests/unit/test_plan_muon.py."""

from __future__ import annotations

from planted import Bug

PLAN = "tests/unit/test_plan_muon.py"

BUGS = [
    Bug("plan-muon-states-as-adam", "Muon's matrices priced at AdamW's 8 optimizer bytes (no momentum saved)",
        "loom/plan/memory.py", "    saved = 4 * dense / n\n", "    saved = 0.0\n",
        (f"{PLAN}::test_states_are_four_bytes_per_matrix_parameter[zero3-2-2]",)),
    Bug("plan-muon-ns-no-gram-square", "Newton-Schulz FLOPs without the Gram matrix's square (2m³)",
        "loom/plan/muon.py", "    return steps * (4 * m * m * n + 2 * m ** 3)\n",
        "    return steps * 4 * m * m * n\n", (f"{PLAN}::test_newton_schulz_flops_closed_form",)),
    Bug("plan-muon-one-all-to-all-a-batch", "one all-to-all counted per batch (the scatter back forgotten)",
        "loom/plan/muon.py", "2 * ns_bytes * params / group, 2 * -(-count // group))",
        "2 * ns_bytes * params / group, -(-count // group))",
        (f"{PLAN}::test_exchange_is_two_all_to_alls_a_batch[2-2]",)),
]
