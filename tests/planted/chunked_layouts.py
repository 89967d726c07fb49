"""Planted bugs in the chunked loss under TP (vocabulary-parallel), PP (the last stage's head in the
schedule's loss), SFT masks and the planner's pricing of them (issue 26, item 2)."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_chunked_loss.py"
LAYOUTS = "tests/distributed/test_chunked_loss_ranks.py::test_chunked_loss_is_exact_under_every_layout"
TP = (f"{LAYOUTS}[tp2]",)
CL = "loom/models/chunked_loss.py"
STEP = "loom/train/step.py"

BUGS = [
    Bug("tp-lse-not-combined", "the logsumexp's sums of exp (and target logits) stay per vocab shard", CL,
        '    sums = funcol.all_reduce(sums, "sum", shard.group).wait()\n', "", TP),
    Bug("tp-max-per-shard", "each shard shifts its exp by its own max, then the sums are added", CL,
        'top = funcol.all_reduce(logits.max(dim=-1).values, "max", shard.group).wait()',
        "top = logits.max(dim=-1).values", TP),
    Bug("tp-input-grad-not-summed", "the head input's gradient is taken as replicated, not summed", CL,
        "h = x.to_local(grad_placements=[Partial()])", "h = x.to_local()", TP),
    Bug("tp-one-hot-on-shard-zero", "backward puts every target's -1 in the first shard's rows", CL,
        "local, owned = _local_targets(t, vocab_start, g.shape[1])",
        "local, owned = _local_targets(t, 0, g.shape[1])", TP),
    Bug("tp-target-below-shard-owned", "a target below this shard's rows counts as this shard's", CL,
        "owned = (local >= 0) & (local < rows)", "owned = local < rows", TP),
    Bug("tp-mask-ignored", "the vocabulary-parallel head averages an SFT batch over every token", CL,
        "chunked_cross_entropy(h, local, targets, loss_chunk, masked, reduction, shard,",
        "chunked_cross_entropy(h, local, targets, loss_chunk, False, reduction, shard,",
        (f"{LAYOUTS}[sft-tp2-sp]",)),
    Bug("pp-last-stage-emits-logits", "under a pipeline the last stage still emits the full logits", STEP,
        "    if cfg.train.loss_chunk <= 0 or not isinstance(stage, GPT) or plain_ops():",
        "    if cfg.train.loss_chunk >= 0 or not isinstance(stage, GPT) or plain_ops():",
        (f"{LAYOUTS}[pp2]", f"{UNIT}::test_a_last_stage_under_the_chunked_loss_emits_its_norm_output")),
    Bug("pp-sft-mean-not-sum", "the pipeline's SFT loss is each micro-batch's mean, not its token sum", STEP,
        '        reduction = "sum" if sft else "mean"\n', '        reduction = "mean"\n',
        (f"{LAYOUTS}[sft-pp2]",)),
    Bug("gpt-head-positional-targets", "GPT passes the targets positionally: the TP plan's hook drops them",
        "loom/models/gpt/model.py",
        "return self.output(h, targets=targets, loss_chunk=loss_chunk, masked=masked)",
        "return self.output(h, targets, loss_chunk=loss_chunk, masked=masked)", TP),
    Bug("plan-tp-chunk-full-vocab", "the plan prices a chunk's logits over the whole vocabulary under TP",
        "loom/plan/shapes.py",
        "* shape.vocab_size / tp * (4 + (elem if elem < 4 else 0))",
        "* shape.vocab_size * (4 + (elem if elem < 4 else 0))",
        (f"{UNIT}::test_the_plan_prices_one_chunk_of_logits",)),
    Bug("plan-pp-not-chunked", "the plan prices a pipeline's last stage with the full logits",
        "loom/plan/memory.py",
        "    chunk = loss_chunk(w, c)\n",
        "    chunk = loss_chunk(w, c) if not pipelined else 0\n",
        (f"{UNIT}::test_the_plan_prices_one_chunk_of_logits",)),
    Bug("tp-chunk-exp-copies", "the vocabulary-parallel chunk's exp makes two more fp32 copies of the logits",
        "loom/models/chunked_loss.py",
        "logits.sub_(top[:, None]).exp_().sum(dim=-1)",
        "(logits - top[:, None]).exp().sum(dim=-1)",
        ("tests/distributed/test_plan_measured.py::test_activation_peak_where_the_model_drifted[tp2-sp-bf16-vocab]",)),
]
