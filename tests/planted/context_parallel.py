"""Planted bugs in context parallelism (the split, both exchanges, the mesh, the loss) and packed
documents (issue 27)."""

from __future__ import annotations

from planted import Bug

CP = "loom/parallel/context_parallel.py"
MATCH = "tests/distributed/test_context_parallel.py::test_context_parallel_matches_single_process"
RING2, A2A2, RING4 = f"{MATCH}[cp2-ring-units]", f"{MATCH}[cp2-a2a-units]", f"{MATCH}[cp4-ring]"
PACKED = "tests/distributed/test_context_parallel.py::test_packed_documents_under_cp_equal_one_rank"
UNIT = "tests/unit/test_document_packing.py"

BUGS = [
    Bug("cp-unbalanced-split", "each rank takes two neighbouring chunks, not a chunk and its mirror", CP,
        "    return rank, 2 * size - 1 - rank\n", "    return 2 * rank, 2 * rank + 1\n",
        (f"{UNIT}::test_cp_split_is_balanced",)),
    Bug("cp-future-keys", "a query chunk also attends to key chunks after it", CP,
        "for b in range(2) if theirs[b] <= mine[a]]", "for b in range(2)]", (RING2,)),
    Bug("cp-diagonal-not-causal", "the diagonal pieces are attended whole", CP,
        "pieces = [(a, b, mine[a] == theirs[b])", "pieces = [(a, b, False)", (RING2,)),
    Bug("cp-merge-drops-rescale", "online softmax forgets to rescale the running output", CP,
        "    out.mul_(torch.exp(lse - merged).unsqueeze(-1))\n", "", (RING2,)),
    Bug("cp-ring-wrong-direction", "k/v are received from the next rank instead of the previous one", CP,
        "ops += [dist.P2POp(dist.irecv, t, cp.peer(-1), cp.group, tag) for t in self.received]",
        "ops += [dist.P2POp(dist.irecv, t, cp.peer(1), cp.group, tag) for t in self.received]", (RING4,)),
    Bug("cp-dkv-not-accumulated", "the dk/dv of the ranks before are dropped", CP,
        "                        acc += before\n", "                        pass\n", (RING2,)),
    Bug("cp-a2a-order", "Ulysses attends the gathered tokens in rank order, not position order", CP,
        "q_all, k_all, v_all = (_heads_to_sequence(t, cp)[:, :, natural] for t in (q, k, v))",
        "q_all, k_all, v_all = (_heads_to_sequence(t, cp) for t in (q, k, v))", (A2A2,)),
    Bug("cp-targets-whole", "the loss compares this rank's logits with the first tokens' targets",
        "loom/models/gpt/model.py", "                targets = split.shard(targets)\n",
        "                targets = targets[:, :tokens.shape[1]]\n", (RING2,)),
    Bug("cp-rope-local-positions", "RoPE places this rank's tokens at 0..T/cp, not their true positions",
        CP, "        if seq.docs is None:\n            return seq.positions\n",
        "        if seq.docs is None:\n            return torch.arange(seq.positions.numel())\n",
        (RING2,)),
    Bug("cp-grads-not-reduced-over-cp", "FSDP2 shards over dp_shard only: cp ranks' gradients never meet",
        "loom/parallel/mesh.py", 'return self.mesh["dp_shard_cp" if cp else "dp_shard"]',
        'return self.mesh["dp_shard"]', (RING2,)),
    Bug("cp-ddp-group-dp-only", "DDP all-reduces over dp only, not dp × cp", "loom/parallel/ddp.py",
        "process_group=d.grad_mesh.get_group(),", "process_group=d.dp_mesh.get_group(),",
        (f"{MATCH}[cp2xddp-dp2-ac]",)),
    Bug("cp-sft-units-without-cp", "SFT's loss units leave out the cp ranks", "loom/train/step.py",
        "units = cfg.train.grad_accum * d.grad_mesh.size()",
        "units = cfg.train.grad_accum * d.dp_mesh.size()",
        ("tests/distributed/test_sft.py::test_sft_losses_do_not_depend_on_the_layout[cp2-ring-accum2]",)),
    Bug("cp-pp-targets-whole", "under a pipeline the last stage's loss takes the whole sequence's targets",
        "loom/train/step.py", "            targets = split.shard(targets)\n", "            pass\n",
        (f"{MATCH}[cp2xpp2-a2a]",)),
    Bug("cp-observed-as-send", "the observer counts the ring's sends as plain sends",
        "loom/observe/collectives.py",
        "            k = exchange or k\n", "", (RING2,)),
    Bug("docs-mask-ignored", "packed documents attend across their ends", "loom/models/gpt/model.py",
        "        if seq is None or (seq.cp is None and seq.docs is None):",
        "        if seq is None or seq.cp is None:", (f"{UNIT}::test_no_attention_crosses_a_document_end",)),
    Bug("docs-mask-ignored-under-cp", "the ring ignores documents", CP,
        "    if seq.docs is None:\n        return None\n    c = seq.chunk",
        "    return None\n    c = seq.chunk",
        (PACKED,)),
    Bug("docs-positions-not-restarted", "RoPE keeps counting across documents", CP,
        "        return document_positions(seq.docs)[:, seq.positions]", "        return seq.positions",
        (f"{UNIT}::test_rope_restarts_at_each_document",)),
    Bug("docs-eos-starts-next", "the EOS is counted as the next document's first token", CP,
        "    return torch.cumsum(ends, dim=1) - ends\n", "    return torch.cumsum(ends, dim=1)\n",
        (f"{UNIT}::test_document_ids_and_positions",
         f"{UNIT}::test_packed_window_equals_its_documents_alone")),
    Bug("cp-seq-len-unchecked", "a sequence that 2·cp does not divide is let through", "loom/config.py",
        "        if seq % split:\n", "        if False:\n",
        ("tests/unit/test_bad_input.py::test_bad_input[parallel-cp-seq-len]",)),
]
