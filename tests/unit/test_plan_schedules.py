"""The planner's price of each pipeline schedule (loom/plan/step.py bubble_time, loom/plan/memory.py
in flight and deferred W, loom/plan/search.py): the papers' bubbles on hand-computed numbers, the
F:B:W split from the model's FLOPs, the memory each holds, and the search's choice run as emitted."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import load_config, stages_per_rank
from loom.errors import ConfigError
from loom.layout import validate_pipeline
from loom.parallel.pipeline import stage_layers
from loom.plan import device, in_flight
from loom.plan.candidate import Candidate, Workload, head_recomputed, loss_chunk, plain_ops
from loom.plan.comm import comm_per_step, pp_sends
from loom.plan.command import emit_all, local_cluster
from loom.plan.explain import explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.memory import deferred_weight_bytes_per_layer, gpu_memory, stage_memory
from loom.plan.search import (
    config_workload,
    enumerate_candidates,
    installed_torch_takes_functions,
    schedule_runs,
    search,
    version_takes_functions,
)
from loom.plan.shapes import (
    ModelShape,
    activation_bytes_per_layer,
    attention_kv_width,
    from_preset,
    head_saved_bytes,
    plain_ops_bytes_per_layer,
)
from loom.plan.step import EQUAL_PASSES, Passes, bubble_fraction, bubble_time, local_params, passes
from loom.plan.terms import Terms

DATA = Path(__file__).resolve().parents[1] / "data"


def test_bubble_by_hand_when_f_b_w_are_equal():
    """p = 4, m = 16, F = B = W = 1 (a rank's, one micro-batch): the step's busy time is 16·3 = 48."""
    p, m = 4, 16
    want = {("gpipe", 1): 9 / 57, ("1f1b", 1): 3 / 19,  # 3·3 / (48 + 9)
            ("interleaved", 2): 3 / 35,                   # 3·3/2 / (48 + 4.5) = (p−1)/(v·m+p−1)
            ("zb", 1): 3 / 51,                            # 3·(1 + 1 − 1) = 3
            ("zb", 2): 1.5 / 49.5,                        # 3·1/2
            ("zbv", 2): 0.0,                              # 3·(½ + ½ − 2·½) = 0
            ("dualpipev", 2): 3 / 51}                     # 3·((½ + ½ + ½) + ½ − 2·½) = 3
    for (schedule, v), fraction in want.items():
        assert bubble_fraction(p, m, v, schedule, EQUAL_PASSES) == pytest.approx(fraction), schedule


def test_bubble_by_hand_when_backward_outweighs_forward():
    """F = 1, B = 2, W = 1 (attention-heavy: its matmuls have B = 2F and no W); busy 16·4 = 64."""
    split = Passes(1.0, 2.0, 1.0)
    assert bubble_time(4, 1, "1f1b", split) == pytest.approx(12)      # 3·4
    assert bubble_time(4, 1, "zb", split) == pytest.approx(6)         # 3·(1 + 2 − 1)
    assert bubble_time(4, 1, "zbv", split) == pytest.approx(1.5)      # 3·(0.5 + 1 − 1)
    assert bubble_time(4, 1, "dualpipev", split) == pytest.approx(6)  # 3·((0.5 + 1 + 0.5) + 1 − 1)
    assert bubble_fraction(4, 16, 1, "zbv", split) == pytest.approx(1.5 / 65.5)
    # W larger than F + B: every idle slot filled, none left (floored at 0, never negative)
    assert bubble_time(4, 1, "zb", Passes(1.0, 1.0, 3.0)) == 0.0
    assert bubble_time(4, 1, "zbv", Passes(1.0, 1.0, 1.5)) == 0.0
    assert bubble_time(1, 1, "zbv", split) == 0.0  # no pipeline


def test_f_b_w_come_from_the_models_flops():
    """Linears 2N each pass (N the matmul weights, the head's too); attention 4·L·H·Q·T forward, twice
    that in B, none in W."""
    shape, t = from_preset("8b"), 8192
    n = shape.active_params - shape.embedding_params  # untied: the input embedding is a lookup
    attention = 4 * shape.n_layers * shape.n_heads * shape.head_dim * t
    split = passes(shape, t)
    assert split.w == pytest.approx(2 * n)
    assert split.f == pytest.approx(2 * n + attention)
    assert split.b == pytest.approx(2 * n + 2 * attention)
    assert split.total == pytest.approx(shape.flops_per_token(t))
    assert split.b > split.f > split.w  # not 1:1:1


def test_zbv_halves_1f1b_bubble_at_pp4_m16():
    split = passes(from_preset("8b"), 8192)
    one_f_one_b = bubble_fraction(4, 16, 1, "1f1b", split)
    assert bubble_fraction(4, 16, 2, "zbv", split) <= 0.5 * one_f_one_b
    # the order the papers give: zbv < zb < interleaved < 1f1b
    assert bubble_fraction(4, 16, 2, "zbv", split) < bubble_fraction(4, 16, 1, "zb", split) \
        < bubble_fraction(4, 16, 2, "interleaved", split) < one_f_one_b


def _activations(schedule: str, virtual: int, stage: int = 0, moment: str | None = None) -> float:
    """The activations of pipeline rank `stage` at its peak, or at the named moment of its step."""
    w = Workload(from_preset("8b"), 4096, 64)
    c = Candidate("zero3", 2, 1, 4, schedule=schedule, virtual_stages=virtual, grad_accum=16,
                  activation_checkpointing="full")
    moments: list = []
    peak = stage_memory(w, c, stage, 0.0, moments=moments).activations
    return peak if moment is None else next(a for name, a, _ in moments if name == moment)


def test_memory_each_schedule_holds():
    """pp 4, m 16 (loom/plan/in_flight.py's counts, checked against torch's orders there): rank 0 holds
    p micro-batches under 1F1B and zb alike, zb's outputs among the sends torch's runtime holds to the
    step's end, its W's deferred keeping nothing more (torch's first stage runs no B: its W runs the
    whole backward); zb's rank 1 holds p, its first B's run with their W's deferred (the graph retained,
    the linears' and norms' output gradients kept: L_s × the per-block W term); zb's rank 3 holds p as
    well, 4 W's deferred, where 1F1B's holds one; a V holds 2p micro-batches of half its layers on every
    rank, the head's once, on rank 0; dualpipev as much or one more."""
    shape = from_preset("8b")
    h, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden  # each linear's output gradient, 2 bytes
    per_w = 4096 * 2 * (2 * h + h + 2 * kv + 2 * f)
    assert deferred_weight_bytes_per_layer(shape, 4096, 1, 2) == per_w
    per_w += 2 * 4096 * h * 2  # the two norms' output gradients
    # (full checkpointing: a block keeps its input, of the output's size)
    output, layers = 4096 * h * 2, shape.stage_blocks(0, 4)
    one_f_one_b = _activations("1f1b", 1, 0, "backward's start")
    assert one_f_one_b - _activations("zb", 1, 0, "backward's start") == pytest.approx(4 * output)
    deferred = in_flight.rank_moments("zb", 4, 1, 16, 1)[0][0].deferred
    assert deferred == 2
    assert _activations("zb", 1, 1, "backward's start") == pytest.approx(4 * (layers - 1) * output
                                                                         + deferred * layers * per_w)
    assert _activations("zb", 1, 3, "loss") - _activations("1f1b", 1, 3, "loss") \
        > 4 * shape.stage_blocks(3, 4) * per_w
    zbv, dualpipev = _activations("zbv", 2, 0, "loss"), _activations("dualpipev", 2, 0, "loss")
    assert dualpipev >= zbv > _activations("1f1b", 1, 0, "backward's start")
    # the last rank: 1F1B holds one micro-batch and the head's tensors, zbv 2p of its two half-stages
    # (the V's middle, so no head): p of its blocks' micro-batches, where 1F1B's last holds one
    assert _activations("zbv", 2, 3, "backward's start") > _activations("1f1b", 1, 2, "backward's start")


def test_a_v_places_the_embedding_and_the_head_on_rank_0():
    w = Workload(from_preset("8b"), 4096, 64)

    def account(schedule: str, rank: int) -> tuple[float, list[str]]:
        c = Candidate("zero3", 2, 1, 4, schedule=schedule, virtual_stages=2, grad_accum=16)
        moments: list = []
        return stage_memory(w, c, rank, 0.0, moments=moments).params, [name for name, _, _ in moments]

    (v0, v0_moments), (v3, v3_moments) = account("zbv", 0), account("zbv", 3)
    assert "loss" in v0_moments and "loss" not in v3_moments  # the V's last stage runs on rank 0
    (i0, _), (i3, i3_moments) = account("interleaved", 0), account("interleaved", 3)
    assert "loss" in i3_moments
    shape = from_preset("8b")
    ends = shape.embedding_params + shape.head_params  # each rank holds 1/2 of its stages (zero3, dp 2)
    assert v0 - v3 == pytest.approx(4 * ends / 2, rel=1e-3)  # fp32 parameters, sharded over 2
    assert i0 + i3 == pytest.approx(v0 + v3, rel=1e-3)  # the same stages, placed otherwise


def test_a_v_rank_0_syncs_and_steps_both_ends():
    """The data-parallel traffic and the optimizer's parameters are the heaviest rank's over its
    stages: under a V, rank 0's (the embedding, the head and its blocks), not one stage's."""
    shape = from_preset("8b")  # untied
    w = Workload(shape, 1024, 8)
    ends = shape.embedding_params + shape.head_params
    blocks = shape.num_params - ends

    def synced(schedule: str, virtual: int) -> tuple[float, float]:
        c = Candidate("ddp", 2, 1, 2, schedule=schedule, virtual_stages=virtual, grad_accum=8)
        payload = comm_per_step(w, c, 8)[0].payload_dict()["payload_bytes_by_kind"]
        return payload["all_reduce"], local_params(w, c)

    (v_bytes, v_params), (f_bytes, f_params) = synced("zbv", 2), synced("1f1b", 1)
    assert v_params == pytest.approx(blocks / 2 + ends, rel=1e-3)  # rank 0: half the blocks, both ends
    assert f_params == pytest.approx(blocks / 2 + max(shape.embedding_params, shape.head_params), rel=1e-3)
    assert v_bytes / f_bytes == pytest.approx(v_params / f_params, rel=1e-3)  # fp32 gradients of those


@pytest.mark.parametrize("preset", ["deepseek-v3", "mixtral-8x7b"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv", "dualpipev"])
def test_a_rank_of_several_stages_is_priced_near_the_worst_rank(preset, schedule):
    """An MoE model under a multi-stage schedule is priced on a few ranks (the ends, the fullest, the one
    with the most MoE blocks), not on each: within 1% of the worst of all ranks; DeepSeek-V3's
    interleaved pp4 peaks on rank 1 (its MoE blocks, more micro-batches in flight than rank 3)."""
    w = Workload(from_preset(preset), 4096, 256)
    for pp in (4, 8):
        c = Candidate("zero3", 2, 1, pp, schedule=schedule, virtual_stages=2, grad_accum=32, ep=2)
        worst = max(stage_memory(w, c, r).total for r in range(pp))
        assert gpu_memory(w, c).total == pytest.approx(worst, rel=0.01), pp
    if preset == "deepseek-v3" and schedule == "interleaved":
        c = Candidate("zero3", 2, 1, 4, schedule=schedule, virtual_stages=2, grad_accum=32, ep=2)
        assert gpu_memory(w, c).total == max(stage_memory(w, c, r).total for r in range(4))


def test_split_backward_replicates_through_fsdp2():
    """ddp under zb, zbv and dualpipev runs on FSDP2 (the run's engine): the plan prices that."""
    assert Candidate("ddp", 2, pp=2, schedule="1f1b", grad_accum=4).implementation == "DDP"
    for schedule in ("zb", "zbv", "dualpipev"):
        c = Candidate("ddp", 2, pp=2, schedule=schedule, virtual_stages=2, grad_accum=4)
        assert c.uses_fsdp and c.implementation == "FSDP2", schedule


def test_schedule_runs_mirrors_validate_pipeline():
    for layers, pp, virtual, schedule, m in itertools.product(
            (4, 6, 8), (2, 3, 4), (1, 2, 3), ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"),
            (1, 2, 3, 4, 6, 8, 9, 16)):
        try:
            validate_pipeline(layers, pp, virtual, schedule, m)
            stage_layers(layers, pp, stages_per_rank(schedule, virtual))  # the stages split the layers
            runs = True
        except ConfigError:
            runs = False
        assert schedule_runs(layers, pp, virtual, schedule, m) == runs, (layers, pp, virtual, schedule, m)


def test_explain_shows_the_schedules_terms():
    plan = search(Workload(from_preset("8b"), 8192, 128), Cluster(lookup("H100-SXM")))
    i = next(i for i, r in enumerate(plan.candidates)
             if r["pp_schedule"] == "zb" and r["pp"] == 2)
    text = explain(plan, i)
    for words in ("F, B, W per micro-batch", "max(0, (p−1)(F+B−W)/v) (zb)", "bubble time / (m·(F+B+W)",
                  "first B's run, their W's deferred", "engine torch (FSDP2)", "receive buffers",
                  "input gradients"):
        assert words in text, words
    j = next(i for i, r in enumerate(plan.candidates) if r["pp_schedule"] == "zbv")
    assert "max(0, (p−1)(F'+B'−2W')) (zbv)" in explain(plan, j)


def test_search_emits_a_v_schedule_that_runs(tmp_path, capsys, monkeypatch):
    """On two CPU ranks the fastest pipelined layout is zbv; --emit writes it beside the recommendation
    and `loom train --dry-run` takes the file as written."""
    cluster = local_cluster(device.load(DATA / "device_cpu.json"), 2)
    w = Workload(from_preset("small"), 256, 16, "fp32")
    plan = search(w, cluster)
    piped = [r for r in plan.candidates if r["pp"] > 1 and r["fits"]]
    fastest = max(piped, key=lambda r: r["tokens_per_s"])
    assert fastest["pp_schedule"] == "zbv" and fastest["pp_virtual_stages"] == 2
    same = [r for r in piped if r["pp_schedule"] == "1f1b" and r["grad_accum"] == fastest["grad_accum"]
            and r["strategy"] == fastest["strategy"]]
    assert same and fastest["pipeline_bubble"] < 0.5 * same[0]["pipeline_bubble"]
    cfg = load_config(None, ["model.preset=small", "data.seq_len=256", "train.batch_size=16"])
    emit_all(str(tmp_path / "run.toml"), cfg, plan, cluster, w.shape, None, quiet=True)
    emitted = [p for p in tmp_path.glob("*.toml") if 'pp_schedule = "zbv"' in p.read_text()]
    assert emitted, "no zbv among the emitted files"
    monkeypatch.chdir(tmp_path)
    rc = main(["train", str(emitted[0]), "--dry-run", "--nproc", "2", "--set", "data.source=stdlib",
               "--set", "data.tokenizer=byte"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "pipeline: 2 stages × 2 stages per rank (V), zbv, " in out
    assert "bubble max(0, (p−1)(F'+B'−2W')) / (m(F+B+W) + bubble) = " in out


def test_dualpipev_is_searched_for_a_mixture_of_experts_only():
    """Its compute overlap is not credited, so it prices above zbv; its reason is an MoE's all-to-all."""
    moe = ModelShape("moe", vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                     moe_experts=8, moe_top_k=2, moe_hidden=32, moe_shared_hidden=32, moe_dense_first=1)
    cluster = local_cluster(device.load(DATA / "device_cpu.json"), 2)
    for shape, searched in ((moe, True), (from_preset("small"), False)):
        schedules = {c.schedule for c in enumerate_candidates(Workload(shape, 128, 16, "fp32"), cluster)}
        assert ("dualpipev" in schedules) == searched and "zbv" in schedules, shape.name


def test_interleaved_is_searched_where_the_layers_do_not_divide():
    """5 layers over pp 2 × 2 stages: interleaved and zb × 2 are searched as for 4 or 6 layers (split
    1/2/1/1 as a run splits them), each layout validate_pipeline takes; not where the stages are more
    than the layers."""
    cluster = local_cluster(device.load(DATA / "device_cpu.json"), 2)
    for layers, searched in ((5, True), (6, True), (3, False)):
        shape = dataclasses.replace(from_preset("small"), n_layers=layers)
        layouts = {(c.schedule, c.virtual_stages, c.pp, c.grad_accum)
                   for c in enumerate_candidates(Workload(shape, 128, 16, "fp32"), cluster)}
        interleaved = {layout for layout in layouts if layout[0] == "interleaved"}
        assert bool(interleaved) == searched, layers
        for schedule, virtual, pp, m in layouts:
            if pp > 1:
                validate_pipeline(layers, pp, virtual, schedule, m)


def test_v_sends_per_micro_batch():
    """A V keeps its turn (stages p − 1 → p) on the last rank and both ends on rank 0: per micro-batch
    a rank sends 2 when p = 2 (measured by `loom train` on gloo: 8 sends for 4 micro-batches), 4 on a
    middle rank; round-robin v = 2 sends 2v − 1 = 3 at p = 2."""
    w = Workload(from_preset("small"), 256, 16, "fp32")
    for schedule, pp, sends in (("zbv", 2, 2), ("dualpipev", 4, 4), ("interleaved", 2, 3), ("zb", 4, 4)):
        c = Candidate("ddp", 1, pp=pp, schedule=schedule, virtual_stages=2, grad_accum=8)
        assert pp_sends(w, c)[1] == sends, schedule


def test_plain_ops_are_priced_where_the_weight_pass_takes_no_function():
    """On a torch whose split backward takes no autograd Function (2.11: weight_pass_takes_functions),
    loom's GPT runs plain ops and the full logits under zb, zbv and dualpipev, and only there: the plan
    prices each block's plain_ops_bytes_per_layer (measured on 2.11 by test_plan_measured's zbv cases:
    1.38 of the plan before it did) and the unchunked loss."""
    shape = from_preset("small")
    lean = Workload(shape, 256, 16, "bf16", loss_chunk=1024)
    plain = dataclasses.replace(lean, weight_pass_takes_functions=False)
    one_f_one_b = Candidate("zero3", 1, pp=2, schedule="1f1b", grad_accum=8)
    assert gpu_memory(plain, one_f_one_b) == gpu_memory(lean, one_f_one_b)
    assert (loss_chunk(plain, one_f_one_b), head_recomputed(plain, one_f_one_b)) == (1024, False)
    per_micro_batch = sum(plain_ops_bytes_per_layer(shape, 256, 1, 2))
    for schedule in ("zb", "zbv", "dualpipev"):
        c = Candidate("zero3", 1, pp=2, schedule=schedule, virtual_stages=2, grad_accum=8)
        assert plain_ops(plain, c) and not plain_ops(lean, c)
        assert (loss_chunk(plain, c), head_recomputed(plain, c), head_recomputed(lean, c)) == (0, False, True)
        for rank in range(2):  # every rank keeps its blocks' plain tensors for each live micro-batch
            more = stage_memory(plain, c, rank).activations - stage_memory(lean, c, rank).activations
            assert more >= per_micro_batch * shape.n_layers / 4, (schedule, rank, more)
        terms = Terms()
        stage_memory(plain, c, 0, terms=terms)
        assert any("plain ops per block" in line for line in terms.lines), schedule


def test_the_installed_torch_says_whether_plain_ops_run():
    """`loom plan` (no torch imported) reads the installed version; a run's plan asks torch itself
    (loom/train/record.py): on the torches CI runs (2.11, 2.13) the two agree."""
    assert [version_takes_functions(v) for v in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.0", "3.0.0",
                                                 "nightly")] == [False, False, True, True, True, True]
    from loom.parallel.pipeline import weight_pass_takes_functions as tried
    assert config_workload(load_config(None, []), from_preset("tiny")).weight_pass_takes_functions == tried()
    assert installed_torch_takes_functions() == tried()


def _moments(w: Workload, c: Candidate, rank: int) -> dict[str, tuple[float, float]]:
    moments: list = []
    stage_memory(w, c, rank, 0.0, moments=moments)
    return {name: (activations, buffers) for name, activations, buffers in moments}


def test_a_split_input_pass_keeps_every_saved_tensor_beside_its_norm_temporaries():
    """torch's B (stage_backward_input) retains the graph for W: the stage's bottom attention norm's
    backward runs beside every saved tensor, its input's gradient and four fp32 [s·b, h] temporaries
    (measured on gloo: the same 2.75 MB over the saved tensors, lean or plain, small at 256 tokens)."""
    shape = from_preset("small")
    for precision, e in (("bf16", 2), ("fp32", 4)):
        w = Workload(shape, 256, 8, precision)
        for schedule in ("zb", "zbv", "dualpipev"):
            c = Candidate("zero3", 1, pp=2, schedule=schedule, virtual_stages=2, grad_accum=8)
            m = _moments(w, c, 0 if schedule == "zb" else 1)  # a rank without the loss
            saved = m["backward's start"][0]
            assert m["pipeline input backward"] == (saved + 256 * shape.d_model * (16 + e),
                                                    m["pipeline steady"][1]), (schedule, precision)
        one_f_one_b = Candidate("zero3", 1, pp=2, schedule="1f1b", grad_accum=8)
        assert "pipeline input backward" not in _moments(w, one_f_one_b, 0)


def test_zero_bubble_stages_keep_16_bit_gradients_from_their_w_to_their_next_b():
    """FSDP2 in bf16 under zb and zbv: each stage's W leaves its gradients in the compute dtype until its
    next B's post-backward (the first stage's whole backward runs in W: none; the last stage's W reruns
    the chunked loss's backward, and zb's peaks in a W, the B's between adding the earlier ones: its
    head's alone). In the steady phase only (a W ran; the cool-down's
    B's run back to back), not in fp32, not under DualPipeV (whole backwards in its steady phase)."""
    shape = from_preset("small")
    P = {s: shape.stage_params(s, 4) for s in range(4)}  # noqa: N806
    head = 2 * shape.vocab_size * shape.d_model

    def held(schedule, rank, precision="bf16", loss_chunk=512):
        w = Workload(shape, 256, 8, precision, loss_chunk=loss_chunk)
        c = Candidate("zero3", 1, pp=2, schedule=schedule, virtual_stages=2, grad_accum=8)
        terms = Terms()
        stage_memory(w, c, rank, terms=terms)
        lines = [line for line in terms.lines if "16-bit gradients held" in line]
        return float(lines[0].rsplit("=", 1)[1].split()[0]) * 1e9 if lines else 0.0

    assert held("zbv", 1) == pytest.approx(2 * (P[1] + P[2]), rel=1e-3)  # stages 1 and 2
    assert held("zbv", 0) == pytest.approx(head, rel=1e-3)  # stage 0: none; stage 3: its head's
    assert held("zbv", 0, loss_chunk=0) == pytest.approx(2 * P[3], rel=1e-3)  # the full logits: all
    assert held("zb", 1) == held("zb", 1, loss_chunk=0) == pytest.approx(2 * P[1] + head, rel=1e-3)
    assert held("zbv", 1, "fp32") == held("dualpipev", 1) == 0.0


def test_input_gradients_are_held_where_a_send_holds_them():
    """Under a split schedule an input gradient stays on its receive buffer while its send to another
    rank is pending, to the step's end: m per such stage; a V's turn (stages p − 1 and p on rank p − 1)
    hands its own on (measured on gloo, zbv pp 2: one stage's m on rank 1, not two)."""
    w = Workload(from_preset("small"), 256, 8, "bf16")
    boundary = 256 * w.shape.d_model * 2
    for schedule, rank, stages in (("zbv", 1, 1), ("zbv", 0, 1), ("zb", 1, 2), ("zb", 0, 1)):
        c = Candidate("zero3", 1, pp=2, schedule=schedule, virtual_stages=2, grad_accum=8)
        terms = Terms()
        stage_memory(w, c, rank, terms=terms)
        line = next(line for line in terms.lines if line.lstrip().startswith("input gradients"))
        assert float(line.rsplit("=", 1)[1].split()[0]) * 1e9 == pytest.approx(8 * boundary * stages,
                                                                                 rel=1e-4), (schedule, rank)


def test_a_whole_backward_begins_in_the_top_blocks_swiglu():
    """1F1B's stage (not the last) starts its backward in its top block: swiglu_down's two f-wide
    gradients beside w2's; under FSDP2 in bf16 then the block's three weight gradients, kept in the
    compute dtype to its unit's post-backward, beside its ffn norm's temporaries, gate and up released
    (measured on gloo, small at 4 layers: 1.16 of the plan in bf16, 1.12 in fp32, without it). The last
    stage reaches it after its final norm's backward, with that norm's input gradient and its output, its
    head's other tensors gone (1.06 in fp32 without it); under zb the first stage's W, a whole backward
    (1.04)."""
    shape = from_preset("small")
    h, f, sb = shape.d_model, shape.ffn_hidden, 256
    c = Candidate("zero3", 1, pp=2, schedule="1f1b", grad_accum=8)
    bf16_top = max(2 * (2 * sb * f + h * f), 6 * h * f + sb * h * 18 - 4 * sb * f)
    for precision, e, top in (("fp32", 4, 4 * (2 * sb * f + h * f)), ("bf16", 2, bf16_top)):
        m = _moments(Workload(shape, 256, 8, precision), c, 0)
        assert m["pipeline top block backward"][0] == m["backward's start"][0] + top, precision
        last = _moments(Workload(shape, 256, 8, precision), c, 1)
        block = activation_bytes_per_layer(shape, 256, 1, e, kv_width=attention_kv_width(shape, e, "cuda"))
        boundary = sb * h * e  # its first block's input: the receive buffer
        arriving = output = sb * h * e  # the final norm's input gradient; the stage's output, which the
        # schedule holds to the backward's end
        top_last = 2 * block - boundary + arriving + output + top
        assert last["pipeline top block backward"][0] == pytest.approx(top_last), precision
        # under zb the first stage runs no B: its W runs the whole backward, the top block's as here
        zb = _moments(Workload(shape, 256, 8, precision), Candidate("zero3", 1, pp=2, schedule="zb",
                                                                    grad_accum=8), 0)
        assert zb["pipeline top block backward"][0] == zb["backward's start"][0] + top, precision


def test_an_output_a_send_holds_is_counted_once():
    """Under the multi-stage schedules torch waits on its sends at the step's end, each holding its
    tensor: a stage's output sent to another rank is among the sends held, not also among the saved
    tensors of its live micro-batches; 1F1B's one stage keeps it for its backward (fp32, small at 8
    layers: the saved tensors are the blocks' and, for 1F1B, the outputs; a later stage's first block
    keeps its receive buffer, not a tensor of its own)."""
    shape = from_preset("small", n_layers=8)
    w = Workload(shape, 256, 8, "fp32")
    kv_width = attention_kv_width(shape, 4, "cuda")  # (k and v as the device's attention kernel keeps them)
    block, output = activation_bytes_per_layer(shape, 256, 1, 4, kv_width=kv_width), 256 * shape.d_model * 4
    interleaved = Candidate("zero3", 1, pp=2, schedule="interleaved", virtual_stages=2, grad_accum=8)
    # stages 0 and 2; the later's first block keeps its receive buffer, counted among those
    moment = in_flight.rank_moments("interleaved", 2, 2, 8, 0)[0]
    saved = sum(ch.live * (2 * block - (output if ch.stage > 0 else 0.0)) for ch in moment)
    assert _moments(w, interleaved, 0)["backward's start"][0] == pytest.approx(saved)
    one_f_one_b = Candidate("zero3", 1, pp=2, schedule="1f1b", grad_accum=8)
    assert _moments(w, one_f_one_b, 0)["backward's start"][0] == pytest.approx(2 * (4 * block + output))


def test_a_later_stage_keeps_its_receive_buffer_not_a_copy():
    """A stage after the first feeds its receive buffer to its first block, whose attention norm keeps it for
    backward: that tensor is among the receive buffers, not a saved tensor of its own (measured on gloo,
    GPipe pp 2: the last stage's micro-batch one s·b·h·e below the plan's). GPipe's middle stage of 4 holds
    m micro-batches of its two blocks, its output kept, its input not."""
    shape = from_preset("small", n_layers=8)
    w = Workload(shape, 256, 8, "fp32")
    kv_width = attention_kv_width(shape, 4, "cuda")
    block, output = activation_bytes_per_layer(shape, 256, 1, 4, kv_width=kv_width), 256 * shape.d_model * 4
    gpipe = Candidate("zero3", 1, pp=4, schedule="gpipe", grad_accum=8)
    assert _moments(w, gpipe, 1)["backward's start"][0] == pytest.approx(8 * (2 * block + output - output))
    assert _moments(w, gpipe, 0)["backward's start"][0] == pytest.approx(8 * (2 * block + output))


def test_gpipe_first_backward_holds_no_accumulated_gradient():
    """GPipe's first backward follows every forward: it holds all m micro-batches but none of the unsharded
    gradients the backwards accumulate (FSDP2), nor one replica's (None from zero_grad); by its end every
    unit is gathered and its gradient made, beside m − 1 micro-batches (measured on gloo, pp 2 with one
    replica: zero3 0.87-0.90 and ddp 0.83-0.92 of the plan that held both at once)."""
    shape = from_preset("small", n_layers=4)
    w = Workload(shape, 256, 8, "fp32")
    stage_params = shape.stage_params(0, 2)
    block = activation_bytes_per_layer(shape, 256, 1, 4, kv_width=attention_kv_width(shape, 4, "cuda"))
    for strategy in ("zero3", "ddp"):
        moments = {schedule: _moments(w, Candidate(strategy, 1, pp=2, schedule=schedule, grad_accum=8), 0)
                   for schedule in ("gpipe", "1f1b")}
        gpipe, one_f_one_b = moments["gpipe"], moments["1f1b"]
        # the first backward's start: GPipe's buffers lack the stage's gradient (4 bytes a parameter)
        assert one_f_one_b["backward's start"][1] - gpipe["backward's start"][1] == pytest.approx(
            4 * stage_params), strategy
        assert "pipeline steady" not in gpipe
        start, end = gpipe["backward's start"], gpipe["pipeline backward's end"]
        bottom = block + 256 * 4 * (shape.d_model + 3 * shape.ffn_hidden)  # its SwiGLU's backward
        assert end[0] == pytest.approx(start[0] * 7 / 8 + bottom), strategy
        # every gradient made by then but its bottom block's and the embedding's (FSDP2: every unit gathered)
        embedding = shape.vocab_size * shape.d_model
        made = 4 * (stage_params - ((stage_params - embedding) / 2 + embedding))
        assert end[1] - start[1] == pytest.approx(made) if strategy == "ddp" else end[1] - start[1] >= made
        # the second backward's twin of each: one micro-batch fewer, every gradient made
        second_start = gpipe["gpipe second, backward's start"]
        assert second_start[0] == pytest.approx(start[0] * 7 / 8), strategy
        assert second_start[1] - start[1] == pytest.approx(4 * stage_params), strategy
        second = gpipe["gpipe second, pipeline backward's end"]  # every gradient, m − 2 micro-batches besides
        assert second[0] == pytest.approx(start[0] * 6 / 8 + bottom), strategy
        assert second[1] - start[1] >= 4 * stage_params, strategy


def test_the_final_norm_keeps_its_input_and_rstd():
    """lean_ops' RMSNorm keeps its input and each token's fp32 rstd, as a block's; the head keeps its input
    (the norm's output) and, chunked, each token's fp32 logsumexp, or computing its gradients in forward
    the input's fp32 gradient in its place, a pipeline's schedule holding the input, its output, besides
    (measured on gloo, fp32 pp 2: the last stage's micro-batch s·b·h·4 below the plan that kept an fp32
    copy of the norm's input besides)."""
    shape = from_preset("small")
    sb, h = 256, shape.d_model
    for e in (4, 2):
        norm = sb * (h * e + 4)
        assert head_saved_bytes(shape, 256, 1, e, chunk=128) == norm + sb * h * e + 4 * sb
        assert head_saved_bytes(shape, 256, 1, e, chunk=128, grad_in_forward=True) == norm + 4 * sb * h
        # a pipeline's last stage: its output, h, held by the schedule to its backward besides
        assert head_saved_bytes(shape, 256, 1, e, pipelined=True, chunk=128, grad_in_forward=True) \
            == norm + 4 * sb * h + sb * h * e


def test_1f1b_holds_a_backwards_input_gradient_in_its_send():
    """torch's 1F1B fires a backward's input-gradient send with the next forward's receive, holding the
    tensor till then: one s·b·h·e on every stage but the first, none on the first (measured on gloo, pp 2
    in bf16: the last stage's forward's end 1.08 of the plan without it)."""
    w = Workload(from_preset("small"), 256, 8, "bf16")

    def sends(rank: int) -> float:
        terms = Terms()
        stage_memory(w, Candidate("zero3", 1, pp=2, schedule="1f1b", grad_accum=8), rank, terms=terms)
        line = next((line for line in terms.lines if line.lstrip().startswith("sends held")), None)
        return float(line.rsplit("=", 1)[1].split()[0]) * 1e9 if line else 0.0

    assert sends(1) == pytest.approx(256 * w.shape.d_model * 2, rel=1e-4)
    assert sends(0) == 0.0
