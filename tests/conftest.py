"""Shared fixtures: a small real text corpus, so no test needs a download."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A few stdlib modules' source as one text file."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(inspect.getsource(json) + inspect.getsource(inspect)[:60_000])
    return path
