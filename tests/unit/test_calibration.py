"""The planner against published training runs (loom/plan/published.py): every row within ±20%,
and within ±25% when held out of the fit; the rows' models and conversions true to their
sources, and docs/calibration.md current."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from loom.plan import efficiency
from loom.plan.hardware import CATALOG, lookup
from loom.plan.published import ROWS, megatron_model_flops
from loom.plan.published_memory import GIB, MEMORY_ROWS, MEMORY_TOLERANCE
from loom.plan.shapes import ModelShape

ROOT = Path(__file__).resolve().parents[2]


def bench():
    path = ROOT / "bench" / "calibration_table.py"
    spec = importlib.util.spec_from_file_location("calibration_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row_id(row) -> str:
    return f"{ROWS.index(row) + 1}-{row.shape.name}-{row.gpus}x{row.gpu}".replace(" ", "")


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_planned_within_20_percent_of_published(row):
    planned = row.planned()
    ratio = planned / row.tokens_per_s
    assert 0.8 <= ratio <= 1.2, (f"{row.cite} {row.shape.name}: planned {planned:,.0f} vs published "
                                 f"{row.tokens_per_s:,.0f} tokens/s (× {ratio:.3f}); refit with "
                                 f"python bench/calibration_table.py --fit")


def test_document_is_current():
    text = (ROOT / "docs" / "calibration.md").read_text()
    assert text == bench().render(), "docs/calibration.md is stale: run python bench/calibration_table.py"


def test_layouts_span_their_gpus_and_batch():
    for row in ROWS:
        c = row.layout
        assert c.world == row.gpus, row.source
        assert c.dp * c.micro_batch * c.grad_accum == row.global_batch, (row.source, row.shape.name)


@pytest.mark.parametrize("row", [r for r in ROWS if r.mfu], ids=row_id)
def test_rows_reproduce_their_sources_mfu(row):
    """tokens/s × loom's FLOPs per token gives back the MFU the source printed: the shapes are the
    sources' models (torchtitan's count adds the input embedding to 6N: 5% on Llama 3 8B)."""
    flops = row.tokens_per_s * row.shape.flops_per_token(row.seq_len)
    assert flops / (row.gpus * lookup(row.gpu).bf16_tflops * 1e12) == pytest.approx(row.mfu, rel=0.06)


def test_gpt_shapes_count_megatrons_flops():
    """A 4h GeLU MLP written as loom's SwiGLU with ffn = 8d/3: Megatron's model FLOPs within 0.1%."""
    for row in ROWS:
        shape = row.shape
        if shape.n_kv_heads == shape.n_heads and shape.ffn_hidden == round(8 * shape.d_model / 3):
            assert row.shape.flops_per_token(row.seq_len) == pytest.approx(
                megatron_model_flops(row.shape, row.seq_len), rel=1e-3)


def test_compute_fraction_grows_with_width_toward_the_family_value():
    gpu = CATALOG["H100-SXM"]
    narrow, wide = (ModelShape("m", d_model=d, n_layers=1, n_heads=1, n_kv_heads=1) for d in (1024, 16384))
    frac_max = efficiency.FAMILY["H100-SXM"][0]
    assert efficiency.compute_fraction(gpu, narrow) < efficiency.compute_fraction(gpu, wide) < frac_max
    assert efficiency.compute_fraction(gpu, None) == frac_max
    assert efficiency.compute_fraction(gpu, ModelShape("p", params_only=10**9)) == frac_max
    assert efficiency.compute_fraction(gpu, wide, tp=8) == efficiency.compute_fraction(gpu, wide)
    # More FLOPs per byte (the same GPU with slower memory): a lower fraction at the same width.
    slow = dataclasses.replace(gpu, name="H100-slow", hbm_tbps=gpu.hbm_tbps / 2)  # not in FAMILY: DEFAULT
    assert efficiency.DEFAULT[0] == frac_max
    assert efficiency.compute_fraction(slow, narrow) < efficiency.compute_fraction(gpu, narrow)
    assert efficiency.compute_fraction(CATALOG["B200"], None) == efficiency.DEFAULT[0]


def test_constants_are_the_fit():
    """efficiency.py holds what `bench/calibration_table.py --fit` finds (to its printed digits)."""
    values, _ = bench().fit()
    got = {"A100": efficiency.A100, "H100": efficiency.H100, "D0_SCALE": efficiency.D0_SCALE,
           "LINK": efficiency.LINK}
    assert got == pytest.approx(values, rel=0.01)


def test_rows_held_out_of_the_fit_within_25_percent():
    """Out of sample: each row priced by the constants fitted to the other rows (5 folds, row i in
    fold i mod 5, each fit from mid-range constants). ±25%: the ±20% band of the in-sample check
    plus the 5% the constants move when a fifth of the rows is withheld. Measured: worst 0.768
    (row 30, torchtitan's cross-node FSDP, 0.833 in sample), rms log ratio 0.108 against 0.098 in
    sample: no row is priced well only because the constants were fitted to it."""
    import math
    import statistics

    held = bench().held_out()
    assert sorted(held) == list(range(1, len(ROWS) + 1))
    outside = {n: round(q, 3) for n, q in held.items() if not 0.75 <= q <= 1.25}
    assert not outside, f"held-out rows outside ±25%: {outside}"
    rms = math.sqrt(statistics.fmean(math.log(q) ** 2 for q in held.values()))
    in_sample = math.sqrt(statistics.fmean(math.log(r.planned() / r.tokens_per_s) ** 2 for r in ROWS))
    assert rms <= 1.25 * in_sample, (rms, in_sample)


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: r.cite.split(", ")[-1].replace(" ", ""))
def test_planned_memory_within_tolerance_of_published(row):
    """torchtitan's measured peaks per GPU, priced as torchtitan ran them (full logits, its op
    policy): within MEMORY_TOLERANCE."""
    assert abs(row.ratio() - 1) <= MEMORY_TOLERANCE, (row.cite, row.planned_bytes() / GIB, row.memory_gib)


def test_loom_fits_torchtitans_8b_run_below_its_measured_peak():
    """Issue 26's goal: Llama-3.1-8B on 8 H100s, FSDP, 2 × 8192 tokens per GPU, op-level AC, as
    loom runs it (chunked loss), is planned below torchtitan's measured 82.4 GiB."""
    row = MEMORY_ROWS[0]
    assert row.gpus == 8 and row.local_batch == 2 and row.activation_checkpointing == "op"
    assert row.planned_bytes(as_loom_runs_it=True) < row.memory_gib * GIB
