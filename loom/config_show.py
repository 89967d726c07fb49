"""`loom config show`: the resolved config as TOML, each key under its doc line.

The doc lines are the comments written beside each field of loom/config.py's dataclasses (the
comment on the field's line, else the comment lines right above it; a section's is its class
docstring), read from the source itself, so that they cannot drift from it. A model key that sets a
field of loom's GPT takes that field's comment (loom/models/gpt/config.py) where there is one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import tokenize
from typing import Any

from loom.config import Config, ModelConfig, _toml_key, _toml_value
from loom.models.gpt.config import GPTConfig, preset


def class_docs(cls: type) -> dict[str, str]:
    """Each field of a dataclass → its comment (joined into one line; "" when it has none)."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    comments = {tok.start[0]: (tok.start[1], tok.string.lstrip("#").strip())
                for tok in tokens if tok.type == tokenize.COMMENT}

    def alone(row: int) -> bool:  # a comment on a line of its own
        return row in comments and not lines[row - 1][:comments[row][0]].strip()

    docs = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        row = node.lineno
        if row in comments and not alone(row):
            docs[node.target.id] = comments[row][1]
            continue
        above = []
        while alone(row - 1):
            row -= 1
            above.insert(0, comments[row][1])
        docs[node.target.id] = " ".join(above)
    return docs


def _sections() -> dict[str, type]:
    return {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


@functools.cache
def field_docs() -> dict[str, str]:
    """"section.key" → its doc line, for every key of the config."""
    gpt = class_docs(GPTConfig)
    docs = {}
    for section, cls in _sections().items():
        for key, doc in class_docs(cls).items():
            docs[f"{section}.{key}"] = (gpt.get(key) or doc) if section == "model" else doc
    return docs


def section_doc(cls: type) -> str:
    """A section's docstring, on one line ("" for the dataclass's generated one)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def show_config(cfg: Config, path: str | None = None, overrides: list[str] = ()) -> str:
    """The TOML text: what it was resolved from, then every section and key, each under its doc line.
    A key that is unset (None) is shown commented out: a model shape with the preset's value (unless
    model.init_from gives the shape), any other as unset. Loading the text gives `cfg` back."""
    docs = field_docs()
    origin = " ← ".join(["defaults", *([_one_line(path)] if path else []),
                         *(f"--set {_one_line(o)}" for o in overrides)])
    lines = [f"# loom config: {origin}", ""]
    for section, cls in _sections().items():
        if section_doc(cls):
            lines.append(f"# {section_doc(cls)}")
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            if docs[f"{section}.{key}"]:
                lines.append(f"# {docs[f'{section}.{key}']}")
            lines.append(_key_line(cfg, section, key, value))
        lines.append("")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    """`text` for a TOML comment: a line break (or any other control character) escaped, so that the
    rest of it is not read as TOML."""
    return text if text.isprintable() else repr(text)


def _key_line(cfg: Config, section: str, key: str, value: Any) -> str:
    if value is not None:
        return f"{_toml_key(key)} = {_toml_value(value)}"
    if section == "model" and key in {f.name for f in dataclasses.fields(GPTConfig)}:
        if cfg.model.init_from:
            return f"# {key}: model.init_from's"
        m: ModelConfig = cfg.model
        if key == "vocab_size" and cfg.data.tokenizer not in ("auto", "byte"):  # (task.model_config)
            return f"# {key}: data.tokenizer's"
        shape = preset(m.preset)  # an unknown preset: the one line train gives
        return f"# {key} = {_toml_value(getattr(shape, key))}  (preset {m.preset}'s)"
    return f"# {key}: unset"
