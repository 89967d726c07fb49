"""Config inputs that are not errors (docs/bad-input.md has the ones that are): a `--set` value TOML
reads as a date or time is a string key's text, and `loom config show` prints TOML that loads back
whatever text a `--set` held."""

from __future__ import annotations

import pytest

from loom.config import load_config
from loom.config_show import show_config


@pytest.mark.parametrize("key, text", [("data.source", "2024-01-01"), ("data.source", "07:32:00"),
                                       ("model.init_from", "1979-05-27T07:32:00Z"),
                                       ("data.text_field", "2024-01-01 07:32:00")])
def test_a_string_key_takes_a_date_or_time_as_written(key, text):
    section, field = key.split(".")
    assert getattr(getattr(load_config(None, [f"{key}={text}"]), section), field) == text


def test_config_show_keeps_a_set_with_line_breaks_in_its_one_line_header(tmp_path):
    overrides = ["data.source=x\n[train]\nsteps = 99", "train.seed=3"]
    cfg = load_config(None, overrides)
    text = show_config(cfg, None, overrides)
    header = text.splitlines()[0]
    assert header.startswith("# loom config: defaults ← --set ") and "\\n[train]\\nsteps = 99" in header
    path = tmp_path / "shown.toml"
    path.write_text(text)
    again = load_config(path)  # loads back: the header's text was not read as TOML
    assert again == cfg and again.train.steps == 60 and again.data.source == "x\n[train]\nsteps = 99"
