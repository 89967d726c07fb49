"""Planted bugs in Muon (loom/train/muon.py, its config checks): the iteration's inputs, the owners'
exchange of shards, which parameters Muon steps, and its keys."""

from __future__ import annotations

from planted import Bug

LAYOUTS = "tests/distributed/test_muon_layouts.py"
PIECES = "tests/distributed/test_muon_orthogonalize.py"
UNIT = "tests/unit/test_muon.py"

BUGS = [
    Bug("muon-nesterov-ignored", "the plain momentum orthogonalized where nesterov asks for the look-ahead",
        "loom/train/muon.py",
        'updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)',
        "updates.append(buf)",
        (f"{UNIT}::test_steps_equal_torch_muon_and_adamw[match_rms_adamw-True]",)),
    Bug("muon-chunks-floor", "shard rows taken as ⌊n/world⌋ (FSDP2 and DTensor chunk by ⌈n/world⌉)",
        "loom/train/muon.py", "    size = -(-n // world)\n", "    size = max(1, n // world)\n",
        (f"{PIECES}::test_pieces_of_the_whole_matrix_result[3]",
         f"{LAYOUTS}::test_layout_matches_torch_muon[zero3-3ranks]")),
    Bug("muon-strided-shard-missed",
        "FSDP2's strided split over TP not counted: one rank's TP piece iterated alone",
        "loom/train/muon.py",
        "    return placement.is_shard() or isinstance(placement, _StridedShard)\n",
        "    return placement.is_shard()\n",
        (f"{LAYOUTS}::test_layout_matches_torch_muon[tp2-sp]",)),
    Bug("muon-steps-the-embedding", "the embedding orthogonalized by Muon instead of stepped by AdamW",
        "loom/train/muon.py", '{"tok_embeddings", "output",', '{"output",',
        (f"{UNIT}::test_which_parameters_go_where", f"{LAYOUTS}::test_layout_matches_torch_muon[ddp]")),
    Bug("muon-momentum-restarts", "the momentum buffer made anew every step", "loom/train/muon.py",
        '            if "momentum_buffer" not in state:\n', "            if True:\n",
        (f"{UNIT}::test_state_dict_round_trip_continues_exactly",
         f"{LAYOUTS}::test_layout_matches_torch_muon[zero3-units]")),
    Bug("muon-exchange-unnamed", "the ledger leaves Muon's all-to-alls as plain all_to_all",
        "loom/observe/ledger.py", "_EXCHANGE_KINDS = (*CP_KINDS, *EP_KINDS, MUON_ALLTOALL)",
        "_EXCHANGE_KINDS = (*CP_KINDS, *EP_KINDS)",
        ("tests/unit/test_ledger_muon.py::test_muon_alltoall_has_its_own_kind",)),
    Bug("muon-resume-expects-adamw", "the pre-launch check expects AdamW's states of Muon's matrices",
        "loom/train/safe_load.py", '        if optimizer == "muon" and is_muon_matrix(name, p):',
        "        if False:", (f"{UNIT}::test_a_muon_run_resumes_through_the_cli",)),
    Bug("muon-keys-silent", "[muon] keys accepted without train.optimizer = \"muon\"", "loom/config.py",
        "        if changed:\n            raise ConfigError(f\"muon.{changed[0]}",
        "        if False:\n            raise ConfigError(f\"muon.{changed[0]}",
        ("tests/unit/test_bad_input.py::test_bad_input[muon-keys-without-muon]",)),
]
