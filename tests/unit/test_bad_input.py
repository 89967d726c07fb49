"""The bad-input catalogue (docs/bad-input.md), one test per row.

Every row of the catalogue's tables names a case by its id, defined here or in a
tests/unit/bad_input_cases_*.py module (the harness is tests/bad_input.py); each test produces
that bad input for real and checks that loom answers with one line containing the row's message.
The doc and the tests cannot drift: an id in one and not the other fails
`test_catalogue_lists_exactly_the_tested_cases`, and a changed message fails its case.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from bad_input import (
    BY_ID,
    CASES,
    DOC,
    ROOT,
    ROWS,
    TINY,
    XFAIL,
    Ctx,
    assert_message,
    case,
    cli,
    expected_pieces,
)

import loom.cli
import loom.launch
from loom.train import faults

# Every area's cases register themselves on import.
for _module in sorted(Path(__file__).parent.glob("bad_input_cases_*.py")):
    importlib.import_module(_module.stem)


# ---------------------------------------------------------------------------------------------
# config: the file, --set, types, choices, ranges


@case("config-file-missing")
def _(c: Ctx) -> str:
    return c.train(str(c.tmp / "nope.toml"))


@case("config-invalid-toml")
def _(c: Ctx) -> str:
    path = c.tmp / "bad.toml"
    path.write_text("[train\nsteps = 3\n")
    return c.train(str(path))


@case("config-unknown-section")
def _(c: Ctx) -> str:
    return c.config("trian.steps=3")


@case("config-unknown-key")
def _(c: Ctx) -> str:
    return c.config("train.stepz=3")


@case("config-key-in-other-section")
def _(c: Ctx) -> str:
    return c.config("train.strategy=ddp")


@case("config-key-outside-section")
def _(c: Ctx) -> str:
    path = c.tmp / "flat.toml"
    path.write_text("steps = 3\n")
    return c.train(str(path))


@case("config-unknown-key-in-file")
def _(c: Ctx) -> str:
    path = c.tmp / "run.toml"
    path.write_text("[parallel]\nstrategi = 'ddp'\n")
    return c.train(str(path))


@case("config-set-syntax")
def _(c: Ctx) -> str:
    return c.train("--set", "train.steps")


@case("config-wrong-type")
def _(c: Ctx) -> str:
    return c.train("--set", "train.steps=abc")


@case("config-wrong-type-float")
def _(c: Ctx) -> str:
    return c.config("train.batch_size=1.5")


@case("config-bad-choice")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.strategy=zero4")


@case("config-bad-choice-precision")
def _(c: Ctx) -> str:
    return c.config("train.precision=bf61")


@case("config-preempt-signal")
def _(c: Ctx) -> str:
    return c.config("train.preempt_signal=TERM")


@case("config-on-ckpt-error")
def _(c: Ctx) -> str:
    return c.train("--set", "train.on_ckpt_error=ignore")


@case("config-zero-steps")
def _(c: Ctx) -> str:
    return c.train("--set", "train.steps=0")


@case("config-negative-batch")
def _(c: Ctx) -> str:
    return c.config("train.batch_size=-8")


@case("config-zero-grad-accum")
def _(c: Ctx) -> str:
    return c.config("train.grad_accum=0")


@case("config-nonpositive-lr")
def _(c: Ctx) -> str:
    return c.config("train.lr=0")


@case("config-adam-beta")
def _(c: Ctx) -> str:
    return c.train("--set", "train.beta1=2")


@case("config-negative-weight-decay")
def _(c: Ctx) -> str:
    return c.config("train.weight_decay=-0.1")


@case("config-negative-warmup")
def _(c: Ctx) -> str:
    return c.config("train.warmup_steps=-3")


@case("config-negative-grad-clip")
def _(c: Ctx) -> str:
    return c.config("train.grad_clip=-1")


@case("config-min-lr-ratio")
def _(c: Ctx) -> str:
    return c.config("train.min_lr_ratio=2")


@case("config-negative-workers")
def _(c: Ctx) -> str:
    return c.config("data.num_workers=-1")


@case("config-negative-ckpt-every")
def _(c: Ctx) -> str:
    return c.config("train.ckpt_every=-5")


@case("config-eval-fraction")
def _(c: Ctx) -> str:
    return c.config("data.eval_fraction=1.5")


@case("config-profile-too-long")
def _(c: Ctx) -> str:
    return c.config("profile.enabled=true", "train.steps=3")


@case("config-batch-not-divisible")
def _(c: Ctx) -> str:
    return c.train("--set", "train.batch_size=5", nproc=2)


@case("config-seq-len-over-max")
def _(c: Ctx) -> str:
    return c.train("--set", "data.seq_len=256")


@case("config-unknown-preset")
def _(c: Ctx) -> str:
    return c.train("--set", "model.preset=huge")


@case("config-d-model-heads")
def _(c: Ctx) -> str:
    return c.train("--set", "model.d_model=66")


@case("config-kv-heads")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_kv_heads=3")


@case("config-vocab-below-tokenizer")
def _(c: Ctx) -> str:
    return c.train("--set", "model.vocab_size=100")


# ---------------------------------------------------------------------------------------------
# parallel degrees


@case("parallel-tp-heads")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.tp=3", nproc=3)


@case("parallel-tp-kv-heads")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_kv_heads=1", "--set", "parallel.tp=2", nproc=2)


@case("parallel-tp-ffn")
def _(c: Ctx) -> str:
    return c.train("--set", "model.ffn_hidden=129", "--set", "parallel.tp=2", nproc=2)


@case("parallel-tp-vocab")
def _(c: Ctx) -> str:
    return c.train("--set", "model.vocab_size=257", "--set", "parallel.tp=2", nproc=2)


@case("parallel-pp-over-layers")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=4", nproc=4)


@case("parallel-1f1b-microbatches")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.microbatches=1", nproc=2)


@case("parallel-interleaved-layers")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_layers=3", "--set", "parallel.pp=2",
                   "--set", "parallel.pp_schedule=interleaved",
                   "--set", "parallel.pp_virtual_stages=2", nproc=2)


@case("parallel-interleaved-one-virtual")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_schedule=interleaved", nproc=2)


@case("parallel-virtual-without-interleaved")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_virtual_stages=2", nproc=2)


@case("parallel-v-microbatches")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_layers=4", "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=zbv",
                   "--set", "parallel.microbatches=2", nproc=2)


@case("parallel-v-over-layers")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_layers=3", "--set", "parallel.pp=2",
                   "--set", "parallel.pp_schedule=dualpipev", "--set", "parallel.microbatches=4", nproc=2)


@case("parallel-v-three-stages")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_schedule=zbv",
                   "--set", "parallel.pp_virtual_stages=3", nproc=2)


@case("parallel-stage-layers-count")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_stage_layers=[1, 1, 1]", nproc=2)


@case("parallel-stage-layers-sum")
def _(c: Ctx) -> str:
    return c.train("--set", "model.n_layers=4", "--set", "parallel.pp=2",
                   "--set", "parallel.pp_stage_layers=[3, 2]", nproc=2)


@case("parallel-stage-layers-empty-stage")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_stage_layers=[2, 0]", nproc=2)


@case("parallel-split-backward-op-checkpointing")
def _(c: Ctx) -> str:
    return c.config("parallel.pp=2", "parallel.pp_schedule=zb", "parallel.activation_checkpointing=op",
                    world=2)


@case("parallel-split-backward-reshard")
def _(c: Ctx) -> str:
    return c.config("parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.microbatches=4",
                    "parallel.reshard_after_forward=true", world=2)


@case("parallel-pp-schedule")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.pp_schedule=zigzag", nproc=2)


@case("parallel-pp-tied-embeddings")
def _(c: Ctx) -> str:
    return c.train("--set", "model.tie_embeddings=true", "--set", "parallel.pp=2", nproc=2)


@case("parallel-pp-fp16")
def _(c: Ctx) -> str:
    return c.config("parallel.pp=2", "train.precision=fp16", world=2)


@case("parallel-pp-batch")
def _(c: Ctx) -> str:
    return c.config("parallel.pp=2", "parallel.microbatches=4", "train.batch_size=6", world=2)


@case("parallel-fsdp-unit-negative")
def _(c: Ctx) -> str:
    return c.config("parallel.fsdp_unit_mb=-1", world=2)


@case("parallel-degrees-world")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.pp=2", "--set", "parallel.tp=3", nproc=4)


@case("parallel-cp-seq-len")
def _(c: Ctx) -> str:
    return c.config("parallel.cp=2", "data.seq_len=30", world=2)


@case("parallel-cp-world")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.cp=4", nproc=2)


@case("parallel-cp-alltoall-heads")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.cp=2", "--set", "parallel.cp_mode=alltoall", "--set", "model.n_heads=1",
                   "--set", "model.n_kv_heads=1", nproc=2)


@case("moe-top-k-over-experts")
def _(c: Ctx) -> str:
    return c.train("--set", "model.preset=tiny-moe", "--set", "model.moe_top_k=9")


@case("moe-experts-ep")
def _(c: Ctx) -> str:
    return c.train("--set", "model.preset=tiny-moe", "--set", "model.moe_experts=6", "--set",
                   "parallel.strategy=zero3", "--set", "parallel.ep=4", nproc=4)


@case("moe-ep-dense-model")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.strategy=zero3", "--set", "parallel.ep=2", nproc=2)


@case("moe-ep-world")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero3", "parallel.ep=4", "parallel.tp=2", world=4)


@case("moe-ep-zero1")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero1", "parallel.ep=2", world=2)


@case("moe-ep-deepspeed")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero3", "parallel.engine=deepspeed", "parallel.ep=2", world=2)


@case("moe-ep-cp")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero3", "parallel.ep=2", "parallel.cp=2", world=4)


@case("moe-hf-ep")
def _(c: Ctx) -> str:
    from test_moe_hf import make_qwen_moe

    folder = c.tmp / "qwen3_moe"
    make_qwen_moe(folder, "qwen3_moe")
    return c.train("--set", f'model.init_from="{folder}"', "--set", "parallel.strategy=zero3", "--set",
                   "parallel.ep=2", nproc=2)


@case("moe-dense-first-all")
def _(c: Ctx) -> str:
    return c.train("--set", "model.preset=tiny-moe", "--set", "model.moe_dense_first=2")


@case("parallel-cp-mode-unknown")
def _(c: Ctx) -> str:
    return c.config("parallel.cp_mode=ulysses")


@case("data-packing-stream")
def _(c: Ctx) -> str:
    return c.train("--set", "data.packing=documents")


@case("parallel-tp-zero")
def _(c: Ctx) -> str:
    return c.config("parallel.tp=0")


@case("parallel-hsdp-dims")
def _(c: Ctx) -> str:
    return c.train("--set", "parallel.strategy=hsdp", "--set", "parallel.dp_replicate=3",
                   "--set", "parallel.dp_shard=2", nproc=4)


@case("parallel-hsdp-one-replica")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=hsdp", world=4)


@case("parallel-offload-cpu")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero3", "parallel.offload=cpu", "train.device=cpu")


@case("parallel-offload-ddp")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=ddp", "parallel.offload=cpu")


@case("parallel-sp-seq-len")
def _(c: Ctx) -> str:
    return c.train("--set", "data.seq_len=33", "--set", "parallel.tp=2",
                   "--set", "parallel.sequence_parallel=true", nproc=2)


@case("parallel-zero1-tp-fp16")
def _(c: Ctx) -> str:
    return c.config("parallel.strategy=zero1", "parallel.tp=2", "train.precision=fp16", world=2)


@case("engine-unknown")
def _(c: Ctx) -> str:
    return c.config("parallel.engine=megatron")


@case("engine-offload-on-torch")
def _(c: Ctx) -> str:
    return c.config("parallel.offload_optimizer=cpu")


DS = ("parallel.engine=deepspeed",)


@case("engine-deepspeed-missing")
def _(c: Ctx) -> str:
    import importlib.util

    real = importlib.util.find_spec
    c.monkeypatch.setattr(importlib.util, "find_spec",
                          lambda name, *a: None if name == "deepspeed" else real(name, *a))
    return c.config(*DS)


@case("engine-deepspeed-hsdp")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.strategy=hsdp")


@case("engine-deepspeed-tp")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.tp=2", world=2)


@case("engine-deepspeed-cp")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.cp=2", world=2)


@case("engine-deepspeed-checkpointing")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.activation_checkpointing=full")


@case("engine-deepspeed-fsdp-offload")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.offload=cpu")


@case("engine-offload-optimizer-ddp")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.strategy=ddp", "parallel.offload_optimizer=cpu")


@case("engine-offload-params-zero2")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.strategy=zero2", "parallel.offload_params=cpu")


@case("engine-nvme-no-path")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.offload_optimizer=nvme")


@case("engine-nvme-not-writable")
def _(c: Ctx) -> str:
    return c.config(*DS, "parallel.offload_optimizer=nvme", 'parallel.nvme_path="/proc/loom"')


@case("engine-nvme-no-libaio")
def _(c: Ctx) -> str:
    import ctypes.util

    c.monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    return c.config(*DS, "parallel.offload_optimizer=nvme", f'parallel.nvme_path="{c.tmp}"')


@case("engine-deepspeed-config-missing")
def _(c: Ctx) -> str:
    return c.config(*DS, 'parallel.deepspeed_config="nope.json"')


@case("engine-deepspeed-config-json")
def _(c: Ctx) -> str:
    bad = c.tmp / "ds.json"
    bad.write_text('{"zero_optimization": ')
    return c.config(*DS, f'parallel.deepspeed_config="{bad}"')


@case("engine-deepspeed-config-unknown-key")
def _(c: Ctx) -> str:
    bad = c.tmp / "ds.json"
    bad.write_text('{"zero_optimization": {"stagee": 2}}')
    return c.config(*DS, f'parallel.deepspeed_config="{bad}"')


# ---------------------------------------------------------------------------------------------
# pretrained models (model.init_from)


def _tiny_llama(folder: Path, vocab: int = 256, **changes) -> Path:
    """A 2-layer Llama saved as transformers does (config.json + safetensors)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if changes:
        import json

        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, **changes}))
    return folder


@case("model-init-from-missing")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{c.tmp / "no-model"}"')


@case("model-init-from-no-config")
def _(c: Ctx) -> str:
    (c.tmp / "weights").mkdir()
    return c.train("--set", f'model.init_from="{c.tmp / "weights"}"')


@case("model-init-from-architecture")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_tiny_llama(c.tmp / "m", model_type="gpt2")}"')


@case("model-init-from-mismatch")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_tiny_llama(c.tmp / "m", intermediate_size=48)}"')


@case("model-init-from-shape-override")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_tiny_llama(c.tmp / "m")}"', "--set", "model.d_model=64")


@case("model-tokenizer-over-embedding")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_tiny_llama(c.tmp / "m", vocab=200)}"')


# ---------------------------------------------------------------------------------------------
# data


@case("data-missing-source")
def _(c: Ctx) -> str:
    return c.train("--set", f'data.source="{c.tmp / "no" / "corpus.txt"}"')


@case("data-empty-file")
def _(c: Ctx) -> str:
    (c.tmp / "empty.txt").write_text("")
    return c.train("--set", f'data.source="{c.tmp / "empty.txt"}"')


@case("data-empty-dir")
def _(c: Ctx) -> str:
    (c.tmp / "corpus").mkdir()
    return c.train("--set", f'data.source="{c.tmp / "corpus"}"')


@case("data-glob-no-match")
def _(c: Ctx) -> str:
    return c.train("--set", f'data.source="{c.tmp / "*.txt"}"')


@case("data-bin-in-dir")
def _(c: Ctx) -> str:
    (c.tmp / "mixed").mkdir()
    (c.tmp / "mixed" / "a.txt").write_text("some text\n")
    np.arange(10, dtype=np.uint16).tofile(c.tmp / "mixed" / "tokens.bin")
    return c.train("--set", f'data.source="{c.tmp / "mixed"}"')


@case("data-corpus-too-small-for-batch")
def _(c: Ctx) -> str:
    (c.tmp / "small.txt").write_text("tiny corpus " * 20)  # 240 tokens: 7 windows of 33
    return c.train("--set", f'data.source="{c.tmp / "small.txt"}"', "--set", "train.batch_size=16")


@case("data-corpus-too-small-for-window")
def _(c: Ctx) -> str:
    (c.tmp / "short.txt").write_text("hello")
    return c.train("--set", f'data.source="{c.tmp / "short.txt"}"')


@case("data-bin-dtype-choice")
def _(c: Ctx) -> str:
    return c.config("data.bin_dtype=int8")


@case("data-bin-dtype-size")
def _(c: Ctx) -> str:
    (c.tmp / "odd.bin").write_bytes(b"\x01\x02\x03")
    return c.train("--set", f'data.source="{c.tmp / "odd.bin"}"')


@case("data-bin-empty")
def _(c: Ctx) -> str:
    (c.tmp / "empty.bin").write_bytes(b"")
    return c.train("--set", f'data.source="{c.tmp / "empty.bin"}"')


@case("data-bin-token-over-vocab")
def _(c: Ctx) -> str:
    np.full(4096, 300, dtype=np.uint16).tofile(c.tmp / "tokens.bin")
    return c.train("--set", f'data.source="{c.tmp / "tokens.bin"}"')


@case("data-records-missing-text-field")
def _(c: Ctx) -> str:
    (c.tmp / "notes.jsonl").write_text('{"body": "hello"}\n{"body": "world"}\n')
    return c.train("--set", f'data.source="{c.tmp / "notes.jsonl"}"')


@case("data-records-empty")
def _(c: Ctx) -> str:
    (c.tmp / "empty.jsonl").write_text("")
    return c.train("--set", f'data.source="{c.tmp / "empty.jsonl"}"')


@case("data-sft-without-completion")
def _(c: Ctx) -> str:
    (c.tmp / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    return c.train("--set", f'data.source="{c.tmp / "sft.jsonl"}"', "--set", "data.format=sft")


@case("data-bpe-vocab-too-small")
def _(c: Ctx) -> str:
    return c.train("--set", "data.tokenizer=bpe", "--set", "data.bpe_vocab_size=100",
                   "--set", f'data.cache_dir="{c.tmp / "cache"}"')


# ---------------------------------------------------------------------------------------------
# launch


@case("launch-nproc-zero")
def _(c: Ctx) -> str:
    return c.train(nproc=0)


@case("launch-nproc-too-many")
def _(c: Ctx) -> str:
    return c.train(nproc=1000)


@case("launch-nnodes-without-endpoint")
def _(c: Ctx) -> str:
    return c.train("--nnodes", "2")


@case("launch-endpoint-malformed")
def _(c: Ctx) -> str:
    return c.train("--nnodes", "2", "--rdzv-endpoint", "node0")


@case("launch-endpoint-port-range")
def _(c: Ctx) -> str:
    return c.train("--nnodes", "2", "--rdzv-endpoint", "node0:70000")


@case("launch-node-rank-range")
def _(c: Ctx) -> str:
    return c.train("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29500")


@case("launch-max-restarts")
def _(c: Ctx) -> str:
    return c.train("--max-restarts", "-1")


@case("launch-port-in-use")
def _(c: Ctx) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        return c.train("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}")


# ---------------------------------------------------------------------------------------------
# run directory


@case("run-dir-exists")
def _(c: Ctx) -> str:
    (c.tmp / "run").mkdir()
    (c.tmp / "run" / "metrics.jsonl").write_text("{}\n")
    return c.train()


@case("run-dir-overwrite-elastic-nodes")
def _(c: Ctx) -> str:
    return c.train("--overwrite", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{loom.launch.free_port()}")


@case("run-dir-overwrite-with-resume-auto")
def _(c: Ctx) -> str:
    return c.train("--overwrite", "--resume", "auto")


@case("run-dir-overwrite-own-checkpoint")
def _(c: Ctx) -> str:
    run = c.tmp / "run"
    shutil.copytree(c.step_2, run / "checkpoints" / "step_2")
    return c.train("--overwrite", "--resume", str(run / "checkpoints" / "step_2"), "--set", "train.steps=4")


@case("run-dir-is-a-file")
def _(c: Ctx) -> str:
    (c.tmp / "run").write_text("not a directory")
    return c.train("--overwrite")


@case("run-dir-is-a-file-no-overwrite")
def _(c: Ctx) -> str:
    (c.tmp / "run").write_text("not a directory")
    return c.train()


# ---------------------------------------------------------------------------------------------
# checkpoints and resume


@case("ckpt-resume-missing")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.tmp / "old" / "checkpoints" / "step_9"), "--set", "train.steps=4")


@case("ckpt-unfinished-tmp")
def _(c: Ctx) -> str:
    tmp = c.tmp / "old" / "checkpoints" / ".tmp-step_3"
    shutil.copytree(c.step_2, tmp)
    return c.train("--resume", str(tmp), "--set", "train.steps=4")


@case("ckpt-not-a-checkpoint")
def _(c: Ctx) -> str:
    (c.tmp / "notes").mkdir()
    (c.tmp / "notes" / "readme.txt").write_text("hello")
    return c.train("--resume", str(c.tmp / "notes"), "--set", "train.steps=4")


@case("ckpt-run-dir-without-checkpoint")
def _(c: Ctx) -> str:
    (c.tmp / "old" / "checkpoints").mkdir(parents=True)
    return c.train("--resume", str(c.tmp / "old"), "--set", "train.steps=4")


@case("ckpt-meta-damaged")
def _(c: Ctx) -> str:
    copy = c.tmp / "old" / "checkpoints" / "step_2"
    shutil.copytree(c.step_2, copy)
    (copy / "meta.json").write_text('{"step": 2, "conf')
    return c.train("--resume", str(copy), "--set", "train.steps=4")


@case("ckpt-truncated-data")
def _(c: Ctx) -> str:
    copy = c.tmp / "old" / "checkpoints" / "step_2"
    shutil.copytree(c.step_2, copy)
    data = copy / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    return c.train("--resume", str(copy), "--set", "train.steps=4")


@case("resume-run-config-damaged")
def _(c: Ctx) -> str:
    run = c.tmp / "old"
    shutil.copytree(c.ckpt_run, run)
    (run / "config.toml").write_text("[train\nsteps = 4\n")
    return c.train("--resume", "auto", out=run)


@case("resume-auto-without-out")
def _(c: Ctx) -> str:
    return cli("train", "--nproc", "1", *c.base(), "--resume", "auto", capsys=c.capsys)


@case("ckpt-model-shape")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=4", "--set", "model.d_model=128")


@case("ckpt-model-preset")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=4", "--set", "model.preset=small")


@case("ckpt-batch-size-changed")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=4", "--set", "train.batch_size=8")


@case("ckpt-seq-len-changed")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=4", "--set", "data.seq_len=64")


@case("ckpt-seed-changed")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=4", "--set", "train.seed=7")


@case("ckpt-nothing-left")
def _(c: Ctx) -> str:
    return c.train("--resume", str(c.step_2), "--set", "train.steps=2")


def _crafted(c: Ctx, kind: str) -> str:
    from crafted import craft

    marker = c.tmp / "MARKER"
    path = craft(kind, c.step_2, c.tmp / "old" / "checkpoints" / "step_2", marker)
    message = c.train("--resume", str(path), "--set", "train.steps=4")
    assert not marker.exists()
    return message


@case("ckpt-non-tensor-entry")
def _(c: Ctx) -> str:
    return _crafted(c, "byte-entry")


@case("ckpt-entry-dtype")
def _(c: Ctx) -> str:
    return _crafted(c, "wrong-dtype")


@case("ckpt-extra-entry")
def _(c: Ctx) -> str:
    return _crafted(c, "extra-entry")


@case("ckpt-metadata-global")
def _(c: Ctx) -> str:
    return _crafted(c, "metadata-global")


# ---------------------------------------------------------------------------------------------
# faults


@case("plan-explain-range")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--explain", "100000", capsys=c.capsys)


@case("plan-profile-unreadable")
def _(c: Ctx) -> str:
    bad = c.tmp / "device.json"
    bad.write_text("{not json")
    c.monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(bad))
    return cli("plan", capsys=c.capsys)


@case("faults-malformed")
def _(c: Ctx) -> str:
    os.environ["LOOM_FAULTS"] = "explode@3"
    return c.train("--set", "train.steps=2")


@case("faults-bad-step")
def _(c: Ctx) -> str:
    os.environ["LOOM_FAULTS"] = "kill@three:1"
    return c.train("--set", "train.steps=2")


# ---------------------------------------------------------------------------------------------
# Fixtures and the tests


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each case in its own folder, with the environment restored (a world-of-one run sets RANK,
    MASTER_PORT, ...; left set, the next `loom train` would think it is a torchrun rank), and no
    ranks ever launched: every case must fail before that."""
    saved = dict(os.environ)
    os.environ.pop("LOOM_FAULTS", None)
    faults.planted.cache_clear()
    monkeypatch.chdir(tmp_path)

    def no_launch(spec, args):
        raise AssertionError(f"loom would have launched {spec.world_size} rank(s) for: {args}")

    monkeypatch.setattr(loom.launch, "relaunch", no_launch)
    try:
        yield
    finally:
        from loom.parallel.mesh import shutdown

        shutdown()
        faults.planted.cache_clear()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory, corpus) -> Path:
    """A real 2-step world-of-one run of the tiny model: RUN/checkpoints/step_2."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    saved = dict(os.environ)
    os.environ.pop("LOOM_FAULTS", None)
    faults.planted.cache_clear()
    try:
        rc = loom.cli.main(["train", "--nproc", "1", "--out", str(run), *TINY,
                            "--set", f'data.source="{corpus}"', "--set", "train.steps=2"])
    finally:
        from loom.parallel.mesh import shutdown

        shutdown()
        os.environ.clear()
        os.environ.update(saved)
    assert rc == 0 and (run / "checkpoints" / "step_2" / "meta.json").is_file()
    return run


def test_catalogue_lists_exactly_the_tested_cases():
    assert DOC.is_file(), f"{DOC} is missing"
    ids = [row.id for row in ROWS]
    assert len(ids) >= 30
    assert len(ids) == len(set(ids)), (f"duplicate ids in {DOC.name}: "
                                       f"{sorted({i for i in ids if ids.count(i) > 1})}")
    assert set(ids) == set(CASES), (f"in the doc only: {sorted(set(ids) - set(CASES))}; "
                                    f"tested only: {sorted(set(CASES) - set(ids))}")
    for row in ROWS:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", row.id), f"id {row.id!r} is not a short slug"
        assert row.input and expected_pieces(row.message), f"row {row.id} has an empty input or message"


def test_message_pieces_are_matched_in_order():
    assert_message("cannot resume from /x/step_2: a = 1", "`cannot resume from …: a = 1`")
    with pytest.raises(AssertionError):
        assert_message("b then a", "a … b")
    with pytest.raises(AssertionError):
        assert_message("two\nlines", "two")


@pytest.mark.parametrize("case_id", [
    pytest.param(i, marks=pytest.mark.xfail(reason=XFAIL[i], strict=True)) if i in XFAIL else i
    for i in CASES])
def test_bad_input(case_id, tmp_path, corpus, capsys, request):
    row = BY_ID.get(case_id)
    assert row is not None, f"case {case_id} has no row in {DOC.name}"
    message = CASES[case_id](Ctx(tmp_path, corpus, capsys, request))
    assert isinstance(message, str) and message
    assert_message(message, row.message)


def test_readme_counts_the_catalogue():
    """The README's figure is the catalogue's row count, not a number written once."""
    said = re.findall(r"every bad input tried \((\d+) cases\)",
                      (ROOT / "README.md").read_text(encoding="utf-8"))
    assert said == [str(len(ROWS))], f"README says {said}, docs/bad-input.md has {len(ROWS)} rows"
