"""Text <-> token ids through the ``tokenizers`` library (a checkpoint's ``tokenizer.json``)."""
from __future__ import annotations

from pathlib import Path

import tokenizers


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
