"""Text <-> token ids through the ``tokenizers`` library (a checkpoint's ``tokenizer.json``)."""
from __future__ import annotations

from pathlib import Path

import tokenizers

BOS = "<｜begin▁of▁sentence｜>"  # DeepSeek-V2's special tokens (fullwidth bars, "▁" for spaces)
EOS = "<｜end▁of▁sentence｜>"


class Tokenizer:
    """A byte-level BPE tokenizer; ``encode`` adds BOS when the tokenizer's post-processor says so."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self._tok = tok

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, or ``None`` if it has no ``tokenizer.json``."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path}: cannot read tokenizer: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def apply_chat_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """A conversation as the prompt text DeepSeek-V2-Chat was trained on.

    ``messages`` is a list of ``{"role": "system" | "user" | "assistant", "content": str}``. The
    format is the ``chat_template`` of DeepSeek-V2-Chat's ``tokenizer_config.json`` (also printed
    in the "Chat Template" section of its model card): BOS; a system prompt as its text and a
    blank line; each user turn as ``"User: {content}\n\n"``; each assistant turn as
    ``"Assistant: {content}"`` and EOS; finally ``"Assistant:"`` (no space) when
    ``add_generation_prompt``, for the model to continue. The BOS is part of the text, so encode the
    result with ``add_special_tokens=False`` (or the tokenizer adds a second BOS).
    """
    parts = [BOS]
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string, got {type(content).__name__}")
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"User: {content}\n\n")
        elif role == "assistant":
            parts.append(f"Assistant: {content}{EOS}")
        else:
            raise ValueError(f"message {i}: role {role!r}; expected 'system', 'user' or 'assistant'")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)
