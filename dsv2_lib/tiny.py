"""Build the embedded ``"tiny"`` model in ``dsv2_lib/assets/tiny``: config, random weights, tokenizer.

Run ``python -m dsv2_lib.tiny`` to rebuild it. The weights are seeded, so a rebuild gives the same
bytes; the tokenizer is a byte-level BPE trained on a few Python standard-library modules (text that
every machine with Python has). A later chapter replaces the random weights with trained ones.
"""
from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from .config import TINY
from .llm import EMBEDDED_MODELS
from .random_checkpoint import write_random_checkpoint
from .tokenizer import BOS, EOS

SEED = 1234
CORPUS_MODULES = ("textwrap", "string", "argparse", "json.decoder", "difflib", "fractions")


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE trained on ``texts``, with BOS = id 0 and EOS = id 1 (DeepSeek-V2's special
    tokens), adding BOS in front of every encoded text. Deterministic for the same inputs."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def build(directory: Path = EMBEDDED_MODELS["tiny"]) -> Path:
    write_random_checkpoint(TINY, directory, seed=SEED)
    tok = train_tokenizer([inspect.getsource(importlib.import_module(m)) for m in CORPUS_MODULES], TINY.vocab_size)
    assert tok.token_to_id(BOS) == TINY.bos_token_id and tok.token_to_id(EOS) == TINY.eos_token_id[0]
    tok.save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": TINY.bos_token_id, "eos_token_id": TINY.eos_token_id[0]}, indent=2) + "\n"
    )
    return directory


if __name__ == "__main__":
    print(f"wrote {build()}")
