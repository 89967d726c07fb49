"""Planted bugs in how the step ledger, the diagnosis, the report and the comparison see a mixture of
experts and expert parallelism (the ep_alltoall profiler ranges; metrics.jsonl's moe_* / ep_* fields,
memory.json's ep / ep_rank, config.toml's parallel.ep and model.moe_* keys)."""

from __future__ import annotations

from planted import Bug

MOE = "tests/unit/test_ledger_moe.py"
KINDS = f"{MOE}::test_ep_alltoall_has_its_own_kind_and_time"
APART = f"{MOE}::test_cp_and_ep_exchanges_are_told_apart"
GPU = f"{MOE}::test_gpu_ep_alltoall_is_its_sendrecv_kernel"
EP_KNOB = f"{MOE}::test_exposed_ep_alltoall_names_fewer_ep_ranks"
LOAD = f"{MOE}::test_expert_load_imbalance_names_the_balancing_knob"
THRESHOLDS = f"{MOE}::test_expert_findings_fire_above_their_thresholds_only"
DROPPED = f"{MOE}::test_dropped_tokens_name_the_capacity_factor"
ORDER = f"{MOE}::test_expert_findings_in_the_experts_order"
ROUTING = f"{MOE}::test_routing_read_over_the_profiled_steps"
BAD = f"{MOE}::test_bad_routing_records_are_one_line"
REPORT = f"{MOE}::test_report_shows_the_experts_and_the_ep_alltoall"
COMPARE = f"{MOE}::test_compare_names_the_ep_and_moe_keys_that_differ"

BUGS = [
    Bug("ledger-ep-range-unseen", "the ep_alltoall ranges are not kept: EP's all-to-alls read as plain "
        "all_to_all, their waits inside _AllToAll as compute",
        "loom/observe/ledger.py",
        "    elif name in EP_KINDS:\n        out.append(name)\n",
        "    elif False:\n        out.append(name)\n",
        (KINDS, GPU)),
    Bug("ledger-ep-not-tagged", "the collectives issued inside an ep_alltoall range keep their own kind "
        "(only CP's ranges name a kind)",
        "loom/observe/ledger.py",
        "        for kind in _EXCHANGE_KINDS:\n",
        "        for kind in CP_KINDS:\n",
        (KINDS, GPU)),
    Bug("ledger-ep-wait-as-compute", "the main thread waiting inside an ep_alltoall range counted as compute "
        "(the autograd Function's op around it)",
        "loom/observe/ledger.py",
        "        ep_waits = [arrays[c] for c in EP_KINDS if c in arrays]\n",
        "        ep_waits = []\n",
        (KINDS,)),
    Bug("ledger-ep-takes-cp-set", "EP's exposed time read from the last in-flight set, which is CP's when "
        "both exchange",
        "loom/observe/ledger.py",
        'row["ep_exposed_ms"] = int(lengths[comm_m & cov[ep_at]].sum()) / 1e6',
        'row["ep_exposed_ms"] = int(lengths[comm_m & cov[-1]].sum()) / 1e6',
        (APART,)),
    Bug("ledger-ep-hidden-as-exposed", "EP's hidden time taken from the exposed segments",
        "loom/observe/ledger.py",
        'row["ep_hidden_ms"] = int(lengths[hidden_m & cov[ep_at]].sum()) / 1e6',
        'row["ep_hidden_ms"] = int(lengths[comm_m & cov[ep_at]].sum()) / 1e6',
        (KINDS, GPU)),
    Bug("ledger-alltoall-not-sendrecv", "on GPUs an all-to-all is not matched to the SendRecv kernel NCCL "
        "runs it with: EP's exchange is a stray p2p and never in flight",
        "loom/observe/ledger.py",
        ' or (issued == "all_to_all" and ran == "p2p"))',
        ")",
        (GPU,)),
    Bug("ledger-moe-syncs-as-users", "the host syncs of loom's MoE blocks (their split sizes) counted as the "
        "user's",
        "loom/observe/ledger.py",
        "        moe_syncs, syncs = syncs[in_moe], syncs[~in_moe]\n",
        "        moe_syncs = syncs[in_moe]\n",
        (f"{MOE}::test_host_syncs_in_moe_blocks_are_the_blocks_own",)),
    Bug("diagnose-ep-split-by-transfer", "EP's measured exposed time ignored: the exposed time shared by "
        "transfer time (long, hidden all-gathers take EP's share)",
        "loom/observe/diagnose.py",
        '    if ep and step.get("ep_exposed_ms") is not None and len(ep) < len(kinds):\n',
        "    if False:\n",
        (EP_KNOB,)),
    Bug("diagnose-ep-knob-missing", "exposed EP all-to-alls get no key (the generic all-to-all advice)",
        "loom/observe/diagnose.py",
        "    if kind in EP_KINDS:\n        return _ep_knob(layout)\n",
        "",
        (EP_KNOB, ORDER)),
    Bug("diagnose-ep-half-not-divisor", "ep halved even where the half does not divide ep (nor the experts)",
        "loom/observe/diagnose.py",
        "    fewer = max(d for d in range(1, ep) if ep % d == 0)\n",
        "    fewer = ep // 2\n",
        (EP_KNOB,)),
    Bug("diagnose-expert-imbalance-at-threshold", "the expert load finding fires at the threshold, not "
        "above it",
        "loom/observe/diagnose.py",
        "    if imbalance is not None and imbalance > EXPERT_IMBALANCE:\n",
        "    if imbalance is not None and imbalance >= EXPERT_IMBALANCE:\n",
        (THRESHOLDS,)),
    Bug("diagnose-bias-rate-ignored", "a run balancing by bias is told to raise its auxiliary loss",
        "loom/observe/diagnose.py",
        "        if rate:  # aux-loss-free balancing runs",
        "        if False:  # aux-loss-free balancing runs",
        (LOAD,)),
    Bug("diagnose-aux-zero-times-ten", "a run without an auxiliary loss is told to set it to 10 × 0",
        "loom/observe/diagnose.py",
        "        elif coef:\n",
        "        elif coef is not None:\n",
        (LOAD,)),
    Bug("diagnose-dropless-capacity", "a dropless run (capacity factor 0) is told to raise its capacity",
        "loom/observe/diagnose.py",
        ' and cf.get("capacity_factor") != 0:\n',
        ":\n",
        (DROPPED,)),
    Bug("diagnose-expert-load-after-transfers", "the experts' load judged after the exposed transfers",
        "loom/observe/diagnose.py",
        '    findings += _expert_load(analysis.get("moe"), cfg)\n\n'
        '    findings += _exposed_by_kind(ranks, waits, analysis.get("collectives") or [], cfg,\n'
        '                                 (analysis.get("plan") or {}).get("pipeline_bubble"))\n',
        '    findings += _exposed_by_kind(ranks, waits, analysis.get("collectives") or [], cfg,\n'
        '                                 (analysis.get("plan") or {}).get("pipeline_bubble"))\n'
        '    findings += _expert_load(analysis.get("moe"), cfg)\n',
        (ORDER,)),
    Bug("analyze-routing-every-step", "the routing's medians taken over every logged step though the "
        "profiled ones are known",
        "loom/observe/analyze.py",
        "    rows = chosen or rows\n",
        "    rows = rows\n",
        (ROUTING,)),
    Bug("analyze-dropped-share-of-tokens", "the dropped share divided by the experts' count, not the "
        "choices routed",
        "loom/observe/analyze.py",
        "values[\"dropped_pct\"].append(100 * dropped / sum(tokens))",
        "values[\"dropped_pct\"].append(100 * dropped / len(tokens))",
        (ROUTING,)),
    Bug("analyze-expert-tokens-unchecked", "negative tokens per expert accepted",
        "loom/observe/analyze.py",
        "        if not tokens or min(tokens) < 0:\n",
        "        if not tokens:\n",
        (BAD,)),
    Bug("analyze-ep-rank-unchecked", "memory.json's ep_rank taken without its range (< ep)",
        "loom/observe/analyze.py",
        'row.int("ep_rank", min=0, max=ep - 1)',
        'row.int("ep_rank", min=0)',
        (BAD,)),
    Bug("analyze-capacity-not-read", "config.toml's model.moe_capacity_factor not read (the preset's "
        "dropless 0 stands)",
        "loom/observe/analyze.py",
        '"moe_capacity_factor": (float, 0, 1e6)},',
        "},",
        (ROUTING, BAD)),
    Bug("analyze-ep-not-read", "config.toml's parallel.ep not read (memory.json's stands in for it)",
        "loom/observe/analyze.py",
        '"cp_mode": (str, CP_MODES, None), "ep": (int, 1, 1 << 20)},',
        '"cp_mode": (str, CP_MODES, None)},',
        (COMPARE, BAD)),
    Bug("report-ep-segment-missing", "the ledger bar draws no EP segment (all exposed comm one colour)",
        "loom/observe/report.py",
        "            if ep is not None:  # then EP's all-to-alls",
        "            if False:  # then EP's all-to-alls",
        (REPORT,)),
    Bug("report-moe-header-missing", "the header does not name the mixture of experts",
        "loom/observe/report.py",
        '        ("mixture of experts", _moe_text(run)),\n',
        "",
        (REPORT,)),
    Bug("compare-ep-unnamed", "two runs' different ep not named (only equal ones)",
        "loom/observe/compare.py",
        '    if a["ep"] is not None and b["ep"] is not None and a["ep"] != b["ep"]:\n',
        '    if a["ep"] is not None and b["ep"] is not None and a["ep"] == b["ep"]:\n',
        (COMPARE,)),
    Bug("compare-moe-keys-unnamed", "two runs' different model.moe_* keys not named",
        "loom/observe/compare.py",
        "        if va is not None and vb is not None and va != vb:\n",
        "        if va is not None and vb is not None and va != vb and False:\n",
        (COMPARE,)),
    Bug("overlap-helper-compute-ignored", "an overlapped backward's helper thread computes off the ledger",
        "loom/observe/ledger.py",
        "            compute_m = ((cov[2] & ~cov[1] & ~cov[7]) | (cov[4] & ~cov[5] & ~cov[6])) & ~cov[0]\n",
        "            compute_m = cov[2] & ~cov[1] & ~cov[7] & ~cov[0]\n",
        ("tests/unit/test_ledger_moe.py::test_an_overlapped_backward_computes_beside_the_main_thread",)),
    Bug("overlap-waits-shared", "one side's wait for its turn taken off the other side's compute",
        "loom/observe/ledger.py",
        "            compute_m = ((cov[2] & ~cov[1] & ~cov[7]) | (cov[4] & ~cov[5] & ~cov[6])) & ~cov[0]\n",
        "            compute_m = ((cov[2] & ~cov[1]) | (cov[4] & ~cov[5])) & ~cov[0] & ~cov[6] & ~cov[7]\n",
        ("tests/unit/test_ledger_moe.py::test_an_overlapped_backward_computes_beside_the_main_thread",)),
    Bug("ep-knob-no-overlap", "exposed all-to-all under dualpipev with its overlap off: fewer ep ranks named",
        "loom/observe/diagnose.py",
        '    if pp > 1 and schedule == "dualpipev" and layout.get("dualpipev_overlap") is False:\n',
        '    if False:\n',
        ("tests/unit/test_ledger_moe.py::test_exposed_ep_alltoall_under_a_pipeline_names_dualpipev",)),
    Bug("ep-knob-no-dualpipev", "exposed all-to-all under 1f1b with a V possible: dualpipev not named",
        "loom/observe/diagnose.py",
        '    if pp > 1 and schedule != "dualpipev" and micro >= 2 * pp'
        ' and (layers is None or layers >= 2 * pp):\n',
        '    if False:\n',
        ("tests/unit/test_ledger_moe.py::test_exposed_ep_alltoall_under_a_pipeline_names_dualpipev",)),
]
