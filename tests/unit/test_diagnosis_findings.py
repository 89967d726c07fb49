"""Each diagnosis finding from a crafted ledger: the category, the exact config key it names and
the value it suggests, at the threshold and not below it; a healthy ledger gives none."""

from __future__ import annotations

import tomllib

import pytest

from loom.observe.diagnose import SHARE, diagnose, try_text


def step(compute: float = 85.0, comm: float = 5.0, io: float = 5.0, idle: float = 5.0, wall: float = 100.0,
         **extra) -> dict:
    """One ledger step whose shares (percent of `wall` ms) are given."""
    shares = {"compute": compute, "comm_exposed": comm, "io": io, "idle": idle}
    assert sum(shares.values()) == pytest.approx(100)
    row = {"wall_ms": wall, "shares": shares, "forward_ms": 0.3 * wall, "backward_ms": 0.5 * wall,
           "optimizer_ms": 0.05 * wall, "data_ms": io * wall / 100, "overlap_pct": 50.0, "host_syncs": 0}
    return row | extra


def ledger(*steps: dict, ranks: int = 2, collectives: list | None = None, stragglers: list | None = None,
           ) -> dict:
    return {"ranks": {str(r): {"steps": list(steps), "collectives": collectives or []} for r in range(ranks)},
            "stragglers": stragglers or []}


def found(analysis: dict, config: dict | None = None) -> dict[str, dict]:
    """Findings by category (exposed communication: "comm:<kind>", one per collective kind)."""
    findings = diagnose(analysis, config)
    by_category = {f["category"] + (f":{f['kind']}" if f.get("kind") else ""): f for f in findings}
    assert len(by_category) == len(findings), findings  # one finding per category
    for f in findings:  # what to try is a valid `key = value` (the prose beside it), or prose alone
        if f["knob"]:
            line = try_text(f).split("  (", 1)[0]
            assert tomllib.loads(line.replace(f["knob"], "k", 1))["k"] == f["value"], line
        else:
            assert f["value"] is None and f["note"] and try_text(f) == f["note"]
    return by_category


def test_a_healthy_ledger_has_no_finding():
    assert diagnose(ledger(step(), step())) == []
    assert diagnose({"ranks": {}}) == []


def test_io():
    f = found(ledger(step(compute=60, io=20, idle=15)), {"data": {"num_workers": 2}})["io"]
    assert (f["knob"], f["value"]) == ("data.num_workers", 4) and f["note"].startswith("now 2")
    assert try_text(f) == "data.num_workers = 4  (now 2; and data.prefetch_factor ≥ 2)"
    assert "IO 20% of a 100.0 ms step" in f["evidence"]
    assert "io" in found(ledger(step(compute=70, io=SHARE, idle=10)))  # at the threshold
    assert "io" not in found(ledger(step(compute=71, io=SHARE - 1, idle=10)))


def _calls(counts: dict[str, int], ms: float = 10.0, nbytes: int = 8 << 20) -> list[dict]:
    """One step's collectives on a rank: `counts` calls of each kind, each `ms` long."""
    return [{"step": None, "kind": k, "duration_ms": ms, "bytes": nbytes} for k, n in counts.items()
            for _ in range(n)]


FSDP_4_UNITS = {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 1}


@pytest.mark.parametrize("calls, parallel, knob, value", [
    (FSDP_4_UNITS, {"strategy": "zero3", "fsdp_prefetch": 1}, "parallel.fsdp_prefetch", 2),
    (FSDP_4_UNITS, {"strategy": "zero2", "fsdp_prefetch": 2}, "parallel.fsdp_prefetch", 3),
    ({"all_gather": 1, "reduce_scatter": 1}, {"strategy": "zero3", "fsdp_unit_mb": 25.0},
     "parallel.fsdp_unit_mb", 2),  # one 8 MiB unit: nothing to prefetch, units of 2 MiB
    ({"all_reduce": 4, "broadcast": 1}, {"strategy": "ddp", "ddp_bucket_mb": 25.0}, "parallel.ddp_bucket_mb",
     12.5),
    ({"p2p": 6}, {"strategy": "ddp", "pp": 2, "microbatches": 0}, "parallel.microbatches", 4),
    ({"p2p": 6}, {"strategy": "ddp", "pp": 2, "pp_schedule": "gpipe"}, "parallel.pp_schedule", "1f1b"),
    ({"all_reduce": 8}, {"strategy": "ddp", "tp": 4}, "parallel.tp", 2),
    ({"all_to_all": 6}, {"strategy": "ddp"}, None, None),
    ({"all_reduce": 8}, {"strategy": "zero3", "ddp_bucket_mb": 25.0}, None, None),  # FSDP: no DDP buckets
])
def test_exposed_communication_names_the_knob_of_the_layout_that_ran(calls, parallel, knob, value):
    """The exposed time's main kind gets the key that moves it in this layout; FSDP's prefetch
    only with several units, DDP's buckets only for DDP's all-reduces."""
    f = diagnose(ledger(step(compute=55, comm=35, io=5, idle=5), collectives=_calls(calls)),
                 {"parallel": parallel})
    assert [x["category"] for x in f] == ["comm"] * len(f) and f, f
    assert (f[0]["knob"], f[0]["value"]) == (knob, value), f[0]
    assert "exposed communication 35%" in f[0]["evidence"]
    knobs = {x["knob"] for x in f}
    if parallel["strategy"] != "ddp":
        assert "parallel.ddp_bucket_mb" not in knobs
    if parallel["strategy"] == "ddp" or "fsdp_unit_mb" in parallel:
        assert "parallel.fsdp_prefetch" not in knobs
    found(ledger(step(compute=55, comm=35, io=5, idle=5), collectives=_calls(calls)), {"parallel": parallel})


def test_exposed_communication_is_split_by_kind():
    """p2p holding most of the exposed time gets its own finding and knob; the all-reduce its
    own; a kind under a quarter of it none."""
    calls = _calls({"p2p": 6}, ms=10.0) + _calls({"all_reduce": 1}, ms=25.0) + _calls({"broadcast": 1}, ms=5)
    f = found(ledger(step(compute=55, comm=36, io=5, idle=4), collectives=calls),
              {"parallel": {"strategy": "ddp", "pp": 2, "microbatches": 4, "ddp_bucket_mb": 25.0}})
    assert set(f) == {"comm:p2p", "comm:all_reduce"}, f
    # the pipeline's p2p is its bubble: 1F1B at pp 2 with 4 micro-batches and 4 layers (the small
    # preset) can take zbv (test_ledger_pipeline.py covers the other layouts)
    assert (f["comm:p2p"]["knob"], f["comm:p2p"]["value"]) == ("parallel.pp_schedule", "zbv")
    assert f["comm:p2p"]["title"] == "p2p exposed: 24% of the step waits on the transfers"
    # kinds one key moves share one finding: FSDP's gathers and reduce-scatters of a one-unit model
    one_unit = found(ledger(step(compute=55, comm=35, io=5, idle=5),
                            collectives=_calls({"all_gather": 1, "reduce_scatter": 1})),
                     {"parallel": {"strategy": "zero3"}})
    assert set(one_unit) == {"comm:all_gather + reduce_scatter"}, one_unit
    assert one_unit["comm:all_gather + reduce_scatter"]["title"].startswith("all_gather + reduce_scatter "
                                                                            "exposed: 35%")
    assert (f["comm:all_reduce"]["knob"], f["comm:all_reduce"]["value"]) == ("parallel.ddp_bucket_mb", 12.5)
    assert "comm" not in {x["category"] for x in diagnose(ledger(step(compute=71, comm=SHARE - 1, io=5,
                                                                       idle=10), collectives=calls))}


def test_idle():
    f = found(ledger(step(compute=50, comm=5, io=5, idle=40)))["idle"]
    assert (f["knob"], f["value"]) == ("train.compile", True)
    assert try_text(f).startswith("train.compile = true  (")
    assert f["title"] == "The step is 40% idle"
    assert "idle" in found(ledger(step(compute=70, comm=5, io=10, idle=SHARE)))  # at the threshold
    assert "idle" not in found(ledger(step(compute=71, comm=5, io=10, idle=SHARE - 1)))


def test_optimizer():
    heavy = step(optimizer_ms=40.0)
    f = found(ledger(heavy))["optimizer"]
    assert (f["knob"], f["value"]) == ("train.optimizer_impl", "foreach")  # CPU ranks
    assert try_text(f).startswith('train.optimizer_impl = "foreach"  (now unknown')
    assert f["title"] == "The optimizer step takes 40% of the step"
    assert "optimizer 40.0 ms per step" in f["evidence"]
    assert "optimizer" in found(ledger(step(optimizer_ms=30.0)))  # at the threshold
    assert "optimizer" not in found(ledger(step(optimizer_ms=29.0)))


def test_host_syncs_and_tiny_kernels():
    f = found(ledger(step(host_syncs=3, host_syncs_loop=3)))
    assert f["sync"]["knob"] is None and f["sync"]["title"].startswith("3 host")
    assert "sync" not in found(ledger(step(host_syncs=0, host_syncs_loop=3)))  # loom's own loop: never
    kernels = found(ledger(step(kernels=2000, mean_kernel_us=5.0, occupancy_pct=10.0)))["kernels"]
    assert (kernels["knob"], kernels["value"]) == ("train.compile", True)
    assert "kernels" not in found(ledger(step(kernels=2000, mean_kernel_us=25.0)))


def test_straggler_names_the_late_rank_and_what_to_fix():
    late = {"rank": 1, "evidence": "rank 1 arrives last at 9 of 9 collectives", "late_ms_mean": 140.0}
    slow, waiting = step(compute=50, comm=5, io=5, idle=40), step(compute=40, comm=55, io=3, idle=2)
    analysis = {"ranks": {"0": {"steps": [waiting]}, "1": {"steps": [slow]}}, "stragglers": [late]}
    f = found(analysis)
    assert f["straggler"]["knob"] is None and "rank 1's host" in f["straggler"]["note"]
    assert "about 140.0 ms less" in f["straggler"]["expected_effect"]
    assert not {"comm", "idle", "imbalance"} & set(f)  # explained by the straggler
    loading = step(compute=40, comm=5, io=40, idle=15)
    analysis["ranks"]["1"]["steps"] = [loading]
    assert found(analysis)["straggler"]["knob"] == "data.num_workers"


def _arrivals(late_ms: float) -> dict:
    """Two ranks, two steps of 100 ms, one all-reduce each: rank 0 arrives at its start, rank 1
    `late_ms` later; both finish 10 ms after rank 1 arrives."""
    ranks = {}
    for rank, delay in (("0", 0.0), ("1", late_ms)):
        collectives = []
        for n in (1, 2):
            t0 = n * 100_000.0  # µs
            arrive = t0 + 1000 * delay
            collectives.append({"step": n, "kind": "all_reduce", "bytes": 4000, "group_size": 2,
                                "group": None, "seq": None, "enqueue_us": arrive, "start_us": arrive,
                                "end_us": t0 + 1000 * (late_ms + 10)})
        ranks[rank] = {"steps": [step(), step()], "collectives": collectives}
    return ranks


def test_stragglers_from_crafted_arrivals():
    """Rank 1 is 50 ms late at every collective of 100 ms steps: rank 0 waits 50 ms and moves bytes
    for 10; rank 1 is the straggler, 50 ms late per step. 2 ms of jitter is no straggler."""
    from loom.observe.stragglers import find_stragglers, match_collectives

    ranks = _arrivals(50.0)
    matched = match_collectives(ranks)
    assert [m["last_rank"] for m in matched] == [1, 1]
    assert matched[0]["per_rank"] == {"0": {"wait_ms": 50.0, "transfer_ms": 10.0},
                                      "1": {"wait_ms": 0.0, "transfer_ms": 10.0}}
    (late,) = find_stragglers(matched, ranks)
    assert (late["rank"], late["late_ms_mean"], late["last_share"]) == (1, 50.0, 1.0)
    jitter = _arrivals(2.0)
    assert find_stragglers(match_collectives(jitter), jitter) == []


def _uneven(wait_ms: float, slow_compute: float = 90.0) -> dict:
    """Two ranks, one 100 ms step: rank 1 computes `slow_compute` ms, rank 0 60 ms and then waits
    `wait_ms` for it at the step's reduce-scatter, which moves bytes for 5 ms."""
    fast = step(compute=60, comm=wait_ms + 5, io=0, idle=35 - wait_ms, step=1)
    slow = step(compute=slow_compute, comm=5, io=0, idle=5 - (slow_compute - 90), step=1)
    matched = [{"kind": "reduce_scatter", "step": 1, "last_rank": 1,
                "per_rank": {"0": {"wait_ms": wait_ms, "transfer_ms": 5.0},
                             "1": {"wait_ms": 0.0, "transfer_ms": 5.0}}}]
    ops = {"0": [{"name": "aten::mm", "total_ms": 70.0, "self_ms": 40.0, "count": 4}],
           "1": [{"name": "aten::mm", "total_ms": 100.0, "self_ms": 70.0, "count": 4}]}
    return {"ranks": {r: {"steps": [s], "collectives": [], "top_ops": ops[r], "kind": "cpu"}
                      for r, s in (("0", fast), ("1", slow))},
            "collectives": matched, "stragglers": []}


def test_imbalance_names_the_slow_rank_and_its_compute():
    """Rank 0 waits 30 ms of its 100 ms step for rank 1, which computes 90 ms against 60: that is
    imbalance (named, with rank 1's compute and op), not missing overlap (no comm finding, no
    FSDP or DDP knob); a 10 ms wait is not worth a finding."""
    f = found(_uneven(30.0), {"parallel": {"strategy": "zero3", "fsdp_prefetch": 1}})
    assert set(f) == {"imbalance"}, f
    i = f["imbalance"]
    assert i["title"] == "Imbalance: rank 0 waits 30% of its step for rank 1"
    assert (i["slow_rank"], i["slow_compute_ms"], i["knob"]) == (1, 90.0, None)
    assert "rank 1 computes 90 ms per step against 60 ms" in i["evidence"]
    assert "its aten::mm takes 70 ms a step (self time) against 40 ms" in i["evidence"]
    assert "about 30 ms less per step on rank 0" in i["expected_effect"]
    assert "imbalance" not in found(_uneven(10.0))
    assert found(_uneven(SHARE))["imbalance"]["title"].endswith("15% of its step for rank 1")


def _pipeline(compute: list[float], wall: float = 100.0) -> dict:
    """One rank per pipeline stage, each computing compute[r] ms of a `wall` ms step, waiting the rest
    at its sends and receives."""
    return {"ranks": {str(r): {"steps": [step(compute=c, comm=100 - c, io=0, idle=0, wall=wall, step=1)],
                               "collectives": [], "kind": "cpu"} for r, c in enumerate(compute)},
            "collectives": [], "stragglers": []}


PIPELINE_1B = {"model": {"preset": "1b"}, "data": {"seq_len": 4096},
               "parallel": {"strategy": "ddp", "pp": 4, "pp_schedule": "1f1b"}}


def test_a_pipeline_waiting_on_its_heads_stage_names_the_balanced_split():
    """The 1b at pp 4: its last rank, holding the head (3.4 blocks' worth), computes 1.5× the mean; the
    finding gives the planner's balanced split, and nothing where the head's rank keeps pace, or where
    the busiest rank is another (not the head: no split of the blocks explains it)."""
    f = found(_pipeline([50, 50, 50, 80]), PIPELINE_1B)
    s = f["stages"]
    assert (s["knob"], s["value"], s["head_rank"]) == ("parallel.pp_stage_layers", [5, 5, 5, 1], 3)
    assert s["title"] == "Pipeline stages unbalanced: the head's rank computes 1.39× the mean"
    assert "0: 50 ms, 1: 50 ms, 2: 50 ms, 3: 80 ms" in s["evidence"]
    assert "now an even split, [4, 4, 4, 4]" in s["note"]
    assert "stages" not in found(_pipeline([50, 50, 50, 55]), PIPELINE_1B)
    assert "stages" not in found(_pipeline([80, 50, 50, 60]), PIPELINE_1B)
    v = dict(PIPELINE_1B, parallel={"strategy": "ddp", "pp": 2, "pp_schedule": "zbv"})
    assert found(_pipeline([80, 50]), v)["stages"]["head_rank"] == 0  # a V: both ends on rank 0
    # already split so: the note says what else to try, no key
    split = dict(PIPELINE_1B, parallel={**PIPELINE_1B["parallel"], "pp_stage_layers": [5, 5, 5, 1]})
    assert found(_pipeline([50, 50, 50, 80]), split)["stages"]["knob"] is None


def test_a_pipeline_rank_slower_at_its_own_stage_is_not_called_slower_hardware():
    """In a pipeline the ranks run different stages: the rank the others wait for (here rank 1 of a V,
    not the head's) is named for its stage's work, with the key that moves blocks between stages."""
    f = found(_uneven(30.0), {"parallel": {"strategy": "ddp", "pp": 2, "pp_schedule": "zbv"}})
    assert set(f) == {"imbalance"}, f
    assert "rank 1's pipeline stage computes longer" in f["imbalance"]["cause"]
    assert "parallel.pp_stage_layers" in f["imbalance"]["note"]
    assert "slower at the same work" in found(_uneven(30.0))["imbalance"]["cause"]


@pytest.mark.parametrize("model", [{"preset": "small", "d_model": 100, "n_heads": 3}, {"preset": "nope"},
                                   {"preset": "small", "n_layers": 1}, {"preset": "small", "vocab_size": 0},
                                   {"init_from": "/a/hf/folder"}])
def test_a_shape_not_known_here_leaves_the_split_to_the_user(model):
    """A model the diagnosis cannot shape (a pretrained folder, a config no run could have had): the
    finding still stands, naming the key in prose, with no value."""
    cfg = {"model": model, "data": {"seq_len": 128}, "parallel": {"strategy": "ddp", "pp": 2}}
    s = found(_pipeline([50, 90]), cfg)["stages"]
    assert s["knob"] is None and "parallel.pp_stage_layers" in s["note"]


def test_the_heads_stage_waited_on_is_one_finding_not_an_imbalance_too():
    """Rank 1, the last of two stages, computes 90 ms to rank 0's 60 and rank 0 waits for it: the
    stages' finding, not also a rank "slower at the same work"."""
    f = found(_uneven(30.0), PIPELINE_1B | {"parallel": {"strategy": "ddp", "pp": 2, "pp_schedule": "1f1b"}})
    assert set(f) == {"stages"}, f
    assert f["stages"]["value"] == [10, 6]


def test_a_runs_config_carries_what_its_split_needs(tmp_path):
    """analyze reads config.toml's model shape and split (run_config), so the diagnosis prices the
    model that ran: the small preset with its 16,384-token vocabulary, whose head is five blocks."""
    from loom.config import load_config, to_toml
    from loom.observe.analyze import run_config

    cfg = load_config(None, ["model.preset=small", "model.vocab_size=16384", "parallel.pp=2",
                             "parallel.pp_stage_layers=[3, 1]", "data.seq_len=128"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    read = run_config(tmp_path / "config.toml")
    assert read["parallel"]["pp_stage_layers"] == [3, 1] and read["model"]["vocab_size"] == 16384
    assert found(_pipeline([50, 90]), read)["stages"]["knob"] is None  # already split so
    even = read | {"parallel": {**read["parallel"], "pp_stage_layers": []}}
    assert found(_pipeline([50, 90]), even)["stages"]["value"] == [3, 1]
