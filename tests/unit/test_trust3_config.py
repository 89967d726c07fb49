"""Config files (issue 38, config): a UTF-8 byte-order mark is accepted; `[[train]]` is named."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, inert_settings, load_config, validate


def test_a_config_file_starting_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 7\n")
    assert load_config(path).train.steps == 7


def test_an_array_of_tables_is_named_with_its_fix(tmp_path):
    path = tmp_path / "array.toml"
    path.write_text("[[train]]\nsteps = 7\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: [[train]] is an array of tables; write [train]"


def test_the_size_check_counts_training_state_not_fp32_weights_alone(monkeypatch):
    """16 bytes a parameter (weights, grads, AdamW) as the planner counts: a model whose fp32
    weights fit in 20 GB but whose training state does not is refused before anything is built."""
    from loom.config import validate

    pages = 20e9 / 4096
    monkeypatch.setattr("loom.config.os.sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else pages)
    cfg = load_config(None, ["model.d_model=8192", "model.n_heads=64", "model.ffn_hidden=28672",
                             "model.n_layers=2", "parallel.strategy=ddp"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1, cuda_available=False)
    said = "1,698,734,080 parameters, 27 GB of weights, grads and AdamW states (ddp) per rank"
    assert said in str(e.value), str(e.value)
    assert "more than this machine's 20 GB of memory" in str(e.value)


@pytest.mark.parametrize("sets, world, noted", [
    (("parallel.strategy=zero3", "parallel.dp_replicate=2"), 2, ["parallel.dp_replicate = 2 has no effect"]),
    (("parallel.strategy=ddp", "parallel.dp_shard=2"), 2, ["parallel.dp_shard = 2 has no effect"]),
    (("parallel.microbatches=4", "parallel.pp_schedule=gpipe"), 1,
     ["parallel.microbatches = 4 has no effect with parallel.pp = 1", "parallel.pp_schedule = 'gpipe'"]),
    (("parallel.sequence_parallel=true",), 1, ["parallel.sequence_parallel = true has no effect"]),
    (("parallel.cp_mode=alltoall",), 1, ["parallel.cp_mode = 'alltoall' has no effect"]),
    (("parallel.pp_virtual_stages=2",), 1, ["parallel.pp_virtual_stages = 2 has no effect with parallel.pp"]),
    (("parallel.ac_every=3",), 1, ["parallel.ac_every = 3 has no effect with parallel.activation_"]),
    (("parallel.activation_checkpointing=full", "parallel.ac_every=3"), 1, ["parallel.ac_every = 3 has no"]),
    (("parallel.strategy=ddp", "parallel.fsdp_unit_mb=50", "parallel.fsdp_prefetch=2",
      "parallel.reshard_after_forward=false"), 2,
     ["parallel.reshard_after_forward = false has no effect with parallel.strategy = ddp",
      "parallel.fsdp_unit_mb = 50.0 has no effect", "parallel.fsdp_prefetch = 2 has no effect"]),
    (("parallel.strategy=zero1", "parallel.fsdp_prefetch=2"), 2, ["parallel.fsdp_prefetch = 2 has no"]),
    (("parallel.nvme_path=/scratch",), 1, ["parallel.nvme_path = '/scratch' has no effect without NVMe"]),
    (("parallel.dualpipev_overlap=false",), 1, ["parallel.dualpipev_overlap = false has no effect"]),
    (("model.moe_top_k=4", "model.moe_aux_loss_coef=0.1"), 1,
     ["model.moe_top_k = 4 has no effect on a dense model", "model.moe_aux_loss_coef = 0.1 has no effect"]),
    (("model.preset=tiny-moe", "model.moe_experts=0", "model.moe_top_k=1"), 1,
     ["model.moe_top_k = 1 has no effect on a dense model"]),
    # read by the layout: no note
    (("parallel.activation_checkpointing=selective", "parallel.ac_every=3"), 1, []),
    (("parallel.strategy=zero3", "parallel.fsdp_unit_mb=50", "parallel.fsdp_prefetch=2",
      "parallel.reshard_after_forward=false"), 2, []),
    (("parallel.strategy=ddp", "parallel.tp=2", "parallel.fsdp_unit_mb=50"), 2, []),  # ddp on FSDP2 under TP
    (("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"), 2, []),
    (("model.preset=tiny-moe", "model.moe_top_k=4"), 1, []),
    (("model.moe_experts=4", "model.moe_top_k=1"), 1, []),
    (("parallel.strategy=hsdp", "parallel.dp_replicate=2"), 4, []),
    (("parallel.pp=2", "parallel.microbatches=4", "parallel.pp_schedule=gpipe"), 2, []),
    (("parallel.tp=2", "parallel.sequence_parallel=true"), 2, []),
    (("parallel.cp=2", "parallel.cp_mode=alltoall"), 2, []),
    ((), 1, []),
])
def test_a_key_the_layout_never_reads_gets_a_note(sets, world, noted):
    cfg = load_config(None, ["model.preset=tiny", "data.seq_len=32", "train.batch_size=8", *sets])
    notes = inert_settings(cfg, validate(cfg, world, cuda_available=False, this_machine=False))
    assert len(notes) == len(noted)
    for note, start in zip(notes, noted, strict=True):
        assert note.startswith(start)


def test_a_layout_pinned_by_set_is_priced_beside_the_plan(capsys):
    """`loom plan --set parallel.strategy=ddp --set parallel.tp=8` on a bare model: the plan's batch is
    its own, but the layout asked about is priced on it, not silently replaced by the search's pick."""
    import loom.cli

    assert loom.cli.main(["plan", "--gpu", "H100-SXM", "--model", "8b", "--set", "parallel.strategy=ddp",
                          "--set", "parallel.tp=8"]) == 0
    out = capsys.readouterr().out
    assert "your config (ddp tp8, micro-batch 128 × 1)" in out and "does not fit" in out
    loom.cli.main(["plan", "--gpu", "H100-SXM", "--model", "8b", "--set", "parallel.strategy=ddp",
                   "--set", "parallel.tp=8", "--set", "train.grad_accum=3"])
    assert "is not priced: the plan's batch of 128 sequences does not split over dp × grad_accum = 3" in \
        capsys.readouterr().out
