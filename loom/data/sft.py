"""Supervised fine-tuning examples: which text of a record carries the loss.

A record is cut into text segments, each with or without the loss:
- prompt/completion fields: the prompt (no loss), then the completion (loss);
- a `messages` list [{role, content}] rendered with the tokenizer's chat template (in bounds:
  chat_template.py): every assistant turn carries the loss (what the template writes for it, its
  end-of-turn marker included), and everything before it does not. Each assistant turn is found
  by rendering the conversation up to it with the generation prompt, then with it: the difference
  is the turn. Messages after the last assistant turn teach nothing and are dropped.
Segments are tokenized separately, so the loss mask follows segment edges exactly; the EOS that
ends each example carries the loss (the model learns to stop).
"""

from __future__ import annotations

from typing import Any

from loom.data.chat_template import ChatTemplate
from loom.data.records import json_kind
from loom.errors import ConfigError, LoomError

Segments = list[tuple[str, bool]]  # (text, carries the loss)


def _text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        what = "no" if value is None else f"{json_kind(value)} as its"
        raise LoomError(f"{where} has {what} '{name}'; every SFT record needs a string '{name}'")
    return value


def prompt_completion(prompt: Any, completion: Any, fields: Any, where: str) -> Segments:
    completion = _text(completion, fields.completion, where)
    if not completion:
        raise LoomError(f"{where} has an empty '{fields.completion}'; every SFT record needs a completion")
    prompt = "" if prompt is None else _text(prompt, fields.prompt, where)
    return [(prompt, False), (completion, True)]


def _content(content: Any, at: str) -> str:
    """A message's content: a string, or a list of parts (OpenAI's and Hugging Face's format) whose
    text parts are joined; an image or other part has no text to train on."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"a '{kind}' part" if isinstance(kind, str) else json_kind(part)
                raise LoomError(f"{at}: content[{j}] is {what}, not a text part "
                                f"{{\"type\": \"text\", \"text\": ...}}; loom trains on text only: remove "
                                f"the part or the record")
            texts.append(part["text"])
        return "".join(texts)
    what = "no content" if content is None else f"{json_kind(content)} as its content"
    raise LoomError(f"{at} has {what}; give it a string, or a list of text parts")


def _message(m: dict, i: int, name: str, where: str) -> dict:
    """Message i of a record, its role checked and its content made a string (for any template)."""
    at = f"{where}: {name}[{i}]"
    if not isinstance(m["role"], str) or not m["role"]:
        raise LoomError(f"{at} has {json_kind(m['role'])} {m['role']!r} as its role; a role is a name "
                        f"such as 'user' or 'assistant'")
    return {**m, "content": _content(m.get("content"), at)}


def chat(messages: Any, template: ChatTemplate | None, fields: Any, where: str) -> Segments:
    if template is None:
        raise ConfigError(f"{where} has '{fields.messages}', which needs the tokenizer's chat_template, and "
                          f"this tokenizer has none; give a tokenizer.json whose tokenizer_config.json has "
                          f"one, or records with '{fields.prompt}'/'{fields.completion}'")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise LoomError(f"{where}: '{fields.messages}' must be a list of {{role, content}} objects")
    messages = [_message(m, i, fields.messages, where) for i, m in enumerate(messages)]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise LoomError(f"{where} has no assistant message in '{fields.messages}', so there is no completion "
                        f"to train on; every SFT record needs one")
    segments: Segments = []
    done = ""
    for i in turns:
        before = template.render(messages[:i], True, where)
        after = template.render(messages[:i + 1], False, where)
        if not (before.startswith(done) and after.startswith(before)):
            raise LoomError(f"{where}: the chat template does not render the conversation up to message {i} "
                            f"as the start of the conversation with it, so the assistant's turn cannot be "
                            f"found; use '{fields.prompt}'/'{fields.completion}' records instead")
        segments += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    return segments
