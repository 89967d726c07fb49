"""What a model's shape allows of a parallel layout: the pipeline's stages over its layers, the
tensor-parallel degree over its heads, FFN and vocabulary, all-to-all context parallelism over its
heads, expert parallelism over its experts. Pure Python (no torch): `loom train` checks these before
ranks start, and `loom plan` checks a config's own layout against the shape it plans."""

from __future__ import annotations

from collections.abc import Sequence

from loom.config import PP_SCHEDULES, V_SCHEDULES, Config, pipeline_microbatches, stage_sizes, stages_per_rank
from loom.errors import ConfigError


def check_layout(cfg: Config, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab: int,
                 max_seq_len: int | None, tied: bool) -> None:
    """What `cfg`'s parallel layout asks of the model's shape: its pipeline splits the layers, TP divides the
    heads, the FFN and the vocabulary, all-to-all CP the heads, and the sequence fits the model (unless
    `max_seq_len` is None: the planner prices any length, which model.max_seq_len can then allow)."""
    p = cfg.parallel
    if p.pp > 1:
        validate_pipeline(n_layers, p.pp, p.pp_virtual_stages, p.pp_schedule, pipeline_microbatches(p),
                          tie_embeddings=tied, split=p.pp_stage_layers)
    if p.tp > 1:
        check_tp_shapes(n_heads, n_kv_heads, ffn_hidden, vocab, p.tp)
    if p.cp > 1 and p.cp_mode == "alltoall" and n_heads % (p.cp * p.tp):
        raise ConfigError(f"parallel.cp_mode = 'alltoall' gives each cp rank n_heads / (cp × tp) heads, but "
                          f"{n_heads} heads do not divide by {p.cp} × {p.tp}; set parallel.cp_mode=ring, or "
                          f"a cp that divides {n_heads // p.tp} (k/v heads cp does not divide are repeated)")
    if max_seq_len is not None and cfg.data.seq_len > max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds the model's max_seq_len "
                          f"{max_seq_len}; lower data.seq_len or set model.max_seq_len")


def check_experts(cfg: Config, experts: int, what: str = "the model") -> None:
    """Expert parallelism needs experts it can split evenly."""
    ep = cfg.parallel.ep
    if ep > 1 and experts == 0:
        raise ConfigError(f"parallel.ep = {ep} splits a mixture of experts, but {what} has none "
                          f"(model.moe_experts = 0); set parallel.ep=1, or model.moe_experts (e.g. 8)")
    if experts % ep:
        raise ConfigError(f"model.moe_experts = {experts} cannot be split evenly over parallel.ep = {ep} "
                          f"ranks; pick an ep that divides {experts}")


def check_tp_shapes(n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab_size: int, tp: int) -> None:
    """Every split dimension must divide by tp; one line naming the one that does not."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_hidden", ffn_hidden),
                        ("vocab_size", vocab_size)):
        if value % tp:
            divisors = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            raise ConfigError(f"parallel.tp = {tp} does not divide model.{name} = {value}; "
                              f"use tp in {divisors[-6:]} or change the model")


def validate_pipeline(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int,
                      *, tie_embeddings: bool = False, split: Sequence[int] = ()) -> None:
    """Raise a one-line ConfigError for a pipeline setup that cannot run (checks the batch not at all)."""
    for name, value in (("pp", pp), ("pp_virtual_stages", virtual), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
    if schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is unknown; choose one of: "
                          f"{', '.join(PP_SCHEDULES)}")
    if pp > n_layers:
        raise ConfigError(f"parallel.pp = {pp} is more than the model's {n_layers} layers; "
                          f"use pp ≤ {n_layers}")
    if schedule in V_SCHEDULES and virtual > 2:
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} runs exactly two stages per rank (a V), but "
            f"parallel.pp_virtual_stages = {virtual}; set it to 2 (or 1), or use 'zb' or 'interleaved' "
            f"for {virtual} stages per rank")
    local = stages_per_rank(schedule, virtual)
    refuse_tied_embeddings(tie_embeddings, pp * local, "set model.tie_embeddings=false")
    if schedule in V_SCHEDULES and 2 * pp > n_layers:
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} splits the model into 2 × pp = {2 * pp} stages (two per "
            f"rank, in a V), more than its {n_layers} layers; use pp ≤ {n_layers // 2} or the 1f1b schedule")
    if schedule == "interleaved" and virtual < 2:
        raise ConfigError(
            f"parallel.pp_schedule = 'interleaved' needs parallel.pp_virtual_stages ≥ 2, got {virtual}; "
            "raise it or use the 1f1b schedule"
        )
    if virtual != 1 and schedule in ("gpipe", "1f1b"):
        raise ConfigError(
            f"parallel.pp_virtual_stages = {virtual} needs a schedule that runs several stages per rank "
            f"(interleaved, zb, zbv, dualpipev); set it to 1 for {schedule!r}"
        )
    # Layers that do not divide into the stages split as config.stage_sizes says, in any schedule
    refuse_more_stages_than_layers(n_layers, pp, local)
    if split:
        _check_split(split, n_layers, pp * local)
    if schedule in ("1f1b", "interleaved", "zb") and microbatches < pp:
        raise ConfigError(
            f"parallel.microbatches = {microbatches} is fewer than parallel.pp = {pp}, "
            f"which the {schedule} schedule needs; use microbatches ≥ {pp}"
        )
    if schedule in ("interleaved", "zb") and microbatches % (microbatches // pp):
        # torch runs the micro-batches in rounds of microbatches // pp; they must divide evenly.
        raise ConfigError(
            f"parallel.microbatches = {microbatches} is not a multiple of {microbatches // pp} "
            f"(microbatches // pp), which the {schedule} schedule needs; use a multiple of pp = {pp}"
        )
    if schedule in V_SCHEDULES and microbatches < 2 * pp:
        raise ConfigError(
            f"parallel.microbatches = {microbatches} is fewer than the {2 * pp} stages of the {schedule} "
            f"schedule (two per rank), which it needs; use microbatches ≥ 2 × pp = {2 * pp}"
        )


def refuse_more_stages_than_layers(n_layers: int, pp: int, local: int) -> None:
    """Every stage holds at least one block (`local`: stages per rank)."""
    if pp * local < 1 or pp * local > n_layers:
        raise ConfigError(
            f"{pp * local} pipeline stages (pp {pp} × virtual {local}) do not fit the model's "
            f"{n_layers} layers; use at most one stage per layer"
        )


def refuse_tied_embeddings(tied: bool, num_stages: int, fix: str) -> None:
    """The embedding (first stage) and the head (last stage) cannot share one weight across ranks."""
    if tied and num_stages > 1:
        raise ConfigError(f"pipeline parallelism cannot split tied embeddings; {fix}")


def _check_split(split: Sequence[int], n_layers: int, stages: int) -> None:
    """parallel.pp_stage_layers: one block count per stage, each at least one, summing to the model's."""
    shown = list(split)
    if len(shown) != stages:
        raise ConfigError(f"parallel.pp_stage_layers = {shown} gives {len(shown)} stages, but the pipeline "
                          f"runs {stages}; give {stages} block counts in stage order, or leave it empty")
    if min(shown) < 1:
        raise ConfigError(f"parallel.pp_stage_layers = {shown} leaves a stage without blocks; give each "
                          f"stage at least one")
    if sum(shown) != n_layers:
        even = list(stage_sizes(n_layers, stages))
        raise ConfigError(f"parallel.pp_stage_layers = {shown} sums to {sum(shown)} blocks, but the model "
                          f"has {n_layers}; give counts that sum to {n_layers}, e.g. {even}")
