"""data.mix's weights as draws (loom/data/mix.py): each source is drawn in its weight's share, for
any finite positive weights, the largest a float holds included (their sum would overflow)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data.mix import draw_sources

CHUNKS = 10  # of 4,096 draws each: a share within 0.015 is 6 standard deviations


def shares(weights: list[float]) -> np.ndarray:
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no inf, no 0/0 on the way
        chunks = draw_sources(weights, seed=0)
        drawn = np.concatenate([next(chunks) for _ in range(CHUNKS)])
    return np.bincount(drawn, minlength=len(weights)) / len(drawn)


def test_each_source_is_drawn_in_its_weights_share():
    assert shares([3.0, 1.0]) == pytest.approx([0.75, 0.25], abs=0.01)


def test_the_largest_weights_are_drawn_alike():
    assert shares([1e308, 1e308]) == pytest.approx([0.5, 0.5], abs=0.01)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=1e-3, max_value=1.7e308), min_size=1, max_size=4))
def test_any_positive_weights_give_their_shares(weights):
    want = np.asarray(weights) / max(weights)
    assert np.allclose(shares(weights), want / want.sum(), atol=0.015)
