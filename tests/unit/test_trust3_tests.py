"""Fast in-process checks for mistakes that only a spawned-rank test (or a golden text) used to catch:
MoE capacity with top_k > 1, the GPU ledger's partition where every kind of time overlaps every
other, clipping over grads on several meshes, a resumed map-style loader, the LoRA merge's scale,
the Hugging Face export's RoPE row order, and the planner's TP-replicated parameters (issue 38)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.models.gpt.config import preset

# -- MoE capacity: ceil(factor · top_k · T / E) -----------------------------------------------------

def test_capacity_counts_every_choice_of_top_k_2():
    from loom.models.gpt.moe import MoE

    cfg = dataclasses.replace(preset("tiny-moe"), moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0)
    block = MoE(cfg)
    # one sequence of 6 tokens, 2 choices each: capacity ceil(1 · 2 · 6 / 4) = 3 (without top_k: 2);
    # expert 0 is chosen by every token (6 times), expert 1 by tokens 0-2, expert 2 by tokens 3-5
    chosen = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2], [2, 0], [0, 2]]).view(1, 6, 2)
    keep = block.capacity_keep(chosen).view(6, 2).tolist()
    assert keep == [[True, True], [True, True], [True, True], [False, True], [True, False], [False, True]]
    assert sum(map(sum, keep)) == 9  # 3 + 3 + 3: every expert full, expert 0's last three dropped


# -- the GPU ledger: compute, exposed comm, IO and idle add up where every pair overlaps ----------

def _kernel(name: str, start: float, dur: float, cat: str = "kernel", stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start * 1000,
            "dur": dur * 1000}


NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
MEMCPY = ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy")


def _overlapping_step() -> list[dict]:
    """One 100 ms step (times in ms): compute 10-30 and 70-80 · NCCL 20-50 and 75-85 · memcpy
    25-60 and 78-90: IO under compute (25-30, 78-80), under exposed comm (30-50, 80-85) and alone
    (50-60, 85-90); comm under compute (20-30, 75-80) · idle 0-10, 60-70, 90-100."""
    return [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 100, "tid": 11,
             "ts": 0, "dur": 100_000},
            _kernel("ampere_sgemm_128x64_tn", 10, 20), _kernel("reduce_kernel", 70, 10),
            _kernel(NCCL, 20, 30, stream=20), _kernel(NCCL, 75, 10, stream=20),
            _kernel(MEMCPY[0], 25, 35, MEMCPY[1], stream=9), _kernel(MEMCPY[0], 78, 12, MEMCPY[1], stream=9)]


def _by_ms(events: list[dict]) -> dict:
    """The partition counted 1 ms at a time, by precedence: compute, then comm, then IO, else idle."""
    spans = {"compute": [], "comm": [], "io": []}
    for ev in events[1:]:
        kind = "io" if ev["cat"] == MEMCPY[1] else "comm" if ev["name"].startswith("nccl") else "compute"
        spans[kind].append((ev["ts"] / 1000, (ev["ts"] + ev["dur"]) / 1000))
    count = dict.fromkeys(("compute", "comm", "io", "idle"), 0.0)
    for ms in range(100):
        t = ms + 0.5
        inside = [k for k, s in spans.items() if any(a <= t < b for a, b in s)]
        count[inside[0] if inside else "idle"] += 1.0
    return count


def test_gpu_ledger_partition_where_every_kind_overlaps_every_other():
    from loom.observe.ledger import rank_ledger

    events = _overlapping_step()
    (s,) = rank_ledger(events, 0)["steps"]
    want = _by_ms(events)
    assert want == {"compute": 30.0, "comm": 25.0, "io": 15.0, "idle": 30.0}  # the fixture as documented
    assert (s["compute_ms"], s["comm_exposed_ms"], s["io_ms"], s["idle_ms"]) == (
        want["compute"], want["comm"], want["io"], want["idle"])
    assert s["comm_hidden_ms"] == 15.0  # 20-30 and 75-80
    assert sum(s["shares"].values()) == pytest.approx(100.0)
    assert s["shares"] == {"compute": 30.0, "comm_exposed": 25.0, "io": 15.0, "idle": 30.0}


# -- clipping: the global norm over grads on several meshes ---------------------------------------

def test_clip_norm_over_two_meshes_is_the_root_of_the_squares(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.train.optim import clip_grad_norm

    mesh = init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(torch.tensor([3.0, 0.0]), mesh, [Shard(0)])
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.grad = torch.tensor([0.0, 4.0])
    # two groups (a DTensor mesh and plain tensors), norms 3 and 4: the global norm is 5, not 7
    assert clip_grad_norm([sharded, plain], 1.0).item() == pytest.approx(5.0)
    scaled = torch.cat([sharded.grad.full_tensor(), plain.grad])
    assert torch.allclose(scaled, torch.tensor([0.6, 0.0, 0.0, 0.8]), rtol=1e-5, atol=0)


# -- a resumed map-style loader continues at its global batch -------------------------------------

def test_resumed_loader_continues_at_the_checkpoints_step():
    from loom.config import Config
    from loom.data.loader import build_loaders

    cfg = Config()
    cfg.train.batch_size, cfg.train.grad_accum, cfg.train.steps = 4, 2, 6
    cfg.data.num_workers = 0
    windows = torch.arange(40).view(40, 1)  # window i is [i]: a batch names its windows

    def steps(start_step: int, rank: int = 0, dp: int = 1) -> list[list[int]]:
        loader = build_loaders(cfg, windows, None, rank, dp, False, start_step).train
        micro = [b.flatten().tolist() for b in loader]
        return [micro[i] + micro[i + 1] for i in range(0, len(micro), 2)]

    fresh = steps(0)
    assert len(fresh) == 6 and len({w for s in fresh for w in s}) == 24
    assert steps(4) == fresh[4:]
    assert steps(3, rank=1, dp=2) == [s[2:] for s in fresh[3:]]  # rank 1's half of each global batch


# -- the LoRA merge: W + (alpha / r) · B A ---------------------------------------------------------

def test_merged_export_scales_the_update_by_alpha_over_rank(monkeypatch, tmp_path):
    from loom.train import export_lora

    torch.manual_seed(0)
    w, a, b = torch.randn(8, 6), torch.randn(4, 6), torch.randn(8, 4)
    name = "layers.0.attention.wq"
    monkeypatch.setattr(export_lora, "read_base", lambda *_: {f"{name}.weight": w.clone()})
    meta = {"config": "[lora]\nrank = 4\nalpha = 16.0\n"}
    tensors = {f"{name}.lora_A": a, f"{name}.lora_B": b}
    out = export_lora.merged_tensors(meta, tmp_path, tensors, {f"{name}.weight": (8, 6)}, None)
    torch.testing.assert_close(out[f"{name}.weight"], w + 4.0 * (b @ a))  # alpha / r = 16 / 4


# -- the Hugging Face export's q/k rows: Llama's rotate-half RoPE gives loom's rotations -----------

def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's RoPE: pairs (i, i + D/2), cos/sin repeated over both halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * torch.cat([cos, cos], -1) + rotated * torch.cat([sin, sin], -1)


def test_hf_export_q_and_k_rows_rotate_as_llama_rotates_them():
    from loom.models.gpt.lean_ops import apply_rope
    from loom.models.gpt.llama_layout import hf_state_dict
    from loom.models.gpt.model import build_model, rope_tables

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    exported = hf_state_dict(dict(model.state_dict()), cfg)
    x, t, d = torch.randn(5, cfg.d_model), 5, cfg.head_dim
    cos, sin = rope_tables(d, t, cfg.rope_theta)
    for loom_name, hf, heads in (("wq", "q_proj", cfg.n_heads), ("wk", "k_proj", cfg.n_kv_heads)):
        w = model.state_dict()[f"layers.0.attention.{loom_name}.weight"]
        theirs = exported[f"model.layers.0.self_attn.{hf}.weight"]
        assert not torch.equal(theirs, w)  # reordered
        ours = apply_rope((x @ w.T).view(1, t, heads, d), torch.stack([cos, sin]))[0]
        llama = _rotate_half((x @ theirs.T).view(t, heads, d), cos[:, None], sin[:, None])
        # the same rotated vectors, each head's rows in Llama's order: loom's pair (2i, 2i+1) at (i, i + D/2)
        order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        torch.testing.assert_close(llama, ours[..., order], atol=1e-5, rtol=1e-5)


# -- the planner: TP ranks hold the norms' gains whole ---------------------------------------------

def test_tp_memory_holds_the_replicated_norm_gains_whole():
    from loom.plan.candidate import Candidate, Workload
    from loom.plan.memory import stage_memory
    from loom.plan.shapes import ModelShape

    # d 64, 4 blocks, vocabulary 1000: Ψ = 325,184 (tests/unit/test_plan_formulas.py), R = 4·2·64 + 64
    shape = ModelShape("hand", vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_hidden=192)
    psi, replicated = 325_184, 4 * 2 * 64 + 64
    assert shape.num_params == psi
    per_tp_rank = (psi - replicated) / 2 + replicated
    assert per_tp_rank == 162_880
    for strategy, n in (("ddp", 1), ("zero3", 2)):
        m = stage_memory(Workload(shape, 32, 8, "bf16"), Candidate(strategy, 2, tp=2), 0)
        assert (m.params, m.grads, m.optimizer) == (4 * per_tp_rank / n, 4 * per_tp_rank / n,
                                                     8 * per_tp_rank / n), strategy


# -- a folder of traces is one run's ranks ----------------------------------------------------------

def test_equal_sized_traces_of_two_ranks_and_one_without_a_world_are_analyzed(tmp_path):
    from analysis_inputs import write_trace

    from loom.observe.ledger import analyze_dir

    info = {"backend": "gloo", "rank": 0, "world_size": 2, "pg_count": 1}
    a = write_trace(tmp_path / "rank0.json", distributedInfo=info)
    b = write_trace(tmp_path / "rank1.json", distributedInfo=dict(info, rank=1))
    write_trace(tmp_path / "rank2.json", distributedInfo={})  # no world recorded: nothing to disagree with
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    out = analyze_dir(tmp_path, workers=1)
    assert sorted(out["ranks"]) == ["0", "1", "2"]
    assert all("_world_size" not in led for led in out["ranks"].values())
