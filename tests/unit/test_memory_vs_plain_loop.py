"""One rank's step peak (issue 39's memory goal, CPU form): `loom train` with ddp on one rank holds what
a hand-written loop over the same model holds, measured by the same tracker (torch's MemTracker, as
loom's memory.json measures a CPU step). With one replica loom runs no DDP: its buckets would keep the
gradients' 4Ψ through the next forward, the step's activation peak, where the plain loop has freed
them (zero_grad(set_to_none=True))."""

from __future__ import annotations

import torch
from in_process import world_of_one

from loom.config import load_config
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.observe.rank_memory import global_peak_tracker
from loom.train.driver import train

BATCH, SEQ, CHUNK = 8, 128, 512
# Parameters heavy beside the activations, so that 4Ψ is a fifth of the peak: it cannot hide in the band.
MODEL = {"preset": "small", "n_layers": 2}


def _plain_loop_peak() -> int:
    cfg = preset(MODEL["preset"], n_layers=MODEL["n_layers"])
    model = build_model(cfg, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
        model(tokens, targets=tokens, loss_chunk=CHUNK).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's states exist from here on, as in loom's tracked second step
    tracker = global_peak_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return int(sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values()))


def test_one_rank_ddp_peaks_as_a_plain_loop(corpus):
    cfg = load_config(None, [
        f"model.preset={MODEL['preset']}", f"model.n_layers={MODEL['n_layers']}", f'data.source="{corpus}"',
        f"data.seq_len={SEQ}", "data.num_workers=0", "data.eval_fraction=0.05", "train.steps=3",
        f"train.batch_size={BATCH}", f"train.loss_chunk={CHUNK}", "train.eval_batches=0",
        "parallel.strategy=ddp", "train.optimizer_impl=foreach"])
    with world_of_one():
        loom_peak = train(cfg, None, quiet=True).memory[0]["peak_bytes"]
    plain = _plain_loop_peak()
    model = build_model(preset(MODEL["preset"], n_layers=MODEL["n_layers"]))
    num_params = sum(q.numel() for q in model.parameters())
    assert 4 * num_params > 0.1 * plain  # the bucket this guards against would show
    said = f"loom {loom_peak / 2**20:.2f} MiB, plain loop {plain / 2**20:.2f} MiB"
    assert abs(loom_peak / plain - 1) < 0.02, said


def test_the_plan_frees_one_replicas_gradients_until_backward():
    """The planner's side: a one-replica ddp (or zero1) step holds its gradients only from backward on,
    so its buffers at the peak are 4Ψ below two replicas' (whose DDP buckets stay allocated); under
    gradient accumulation the later micro-steps hold them, as DDP's do."""
    from loom.plan.candidate import Candidate, Workload
    from loom.plan.memory import stage_memory
    from loom.plan.shapes import from_preset

    w = Workload(from_preset("small"), SEQ, BATCH)
    for strategy in ("ddp", "zero1"):
        one, two = (stage_memory(w, Candidate(strategy, dp, micro_batch=BATCH // dp), 0, device="cpu")
                    for dp in (1, 2))
        assert one.grads == two.grads > 0
        assert two.buffers - one.buffers == one.grads, strategy
    accumulating = stage_memory(w, Candidate("ddp", 1, micro_batch=BATCH // 2, grad_accum=2), 0, device="cpu")
    halves = stage_memory(w, Candidate("ddp", 2, micro_batch=BATCH // 2), 0, device="cpu")
    assert accumulating.buffers >= halves.buffers
