"""Text <-> token ids through the ``tokenizers`` library (a checkpoint's ``tokenizer.json``)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

BOS = "<｜begin▁of▁sentence｜>"  # DeepSeek-V2's special tokens (fullwidth bars, "▁" for spaces)
EOS = "<｜end▁of▁sentence｜>"


class Tokenizer:
    """A byte-level BPE tokenizer; ``encode`` adds BOS when the tokenizer's post-processor says so.
    ``chat_template``: the checkpoint's Jinja chat template (``None``: DeepSeek-V2-Chat's format, built in)."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None):
        self._tok, self.chat_template = tok, chat_template

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory (and the ``chat_template`` of its
        ``tokenizer_config.json``, if any), or ``None`` if it has no ``tokenizer.json``."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path}: cannot read tokenizer: {e}") from None
        config, template = Path(directory) / "tokenizer_config.json", None
        if config.is_file():
            try:
                template = json.loads(config.read_text()).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise ValueError(f"{config}: not a JSON object: {e}") from None
            if template is not None and not isinstance(template, str):
                raise ValueError(f"{config}: chat_template must be a string, got {type(template).__name__} "
                                 "(several named templates are not supported)")
        return cls(tok, template)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """A conversation as prompt text: the checkpoint's template rendered as transformers renders it
        (a sandboxed Jinja environment), else :func:`apply_chat_template`. The text holds the BOS: encode
        it with ``add_special_tokens=False``."""
        if self.chat_template is None:
            return apply_chat_template(messages, add_generation_prompt)
        _check_messages(messages)
        from jinja2 import StrictUndefined, TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS)
        except TemplateError as e:
            raise ValueError(f"the checkpoint's chat_template failed on these messages: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self):
        """An incremental decoder: a function of each next token id that returns the text it completes
        (``""`` while the text ends inside a UTF-8 character); the pieces add up to :meth:`decode`'s text."""
        stream = DecodeStream(skip_special_tokens=True)
        return lambda token: stream.step(self._tok, token) or ""

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
    _check_messages(messages)
    parts = [BOS]
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"User: {content}\n\n")
        else:
            parts.append(f"Assistant: {content}{EOS}")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


def _check_messages(messages: list[dict[str, str]]) -> None:
    """Refuse a conversation that is not a non-empty list of ``{"role", "content"}`` dicts with a known
    role and text content, naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"a conversation is a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: a message is a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: content must be a string, got {type(m.get('content')).__name__}")
        if m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"message {i}: role {m.get('role')!r}; expected 'system', 'user' or 'assistant'")
