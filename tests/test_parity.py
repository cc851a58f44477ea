"""Parity with transformers' DeepseekV2ForCausalLM (the oracle), float32 on the CPU.

Both engines load the same safetensors files. Tolerances: both compute in fp32 with different
operation orders (fused einsum vs SDPA, fp32 softmax, our fp32 expert accumulation), so logits
agree to ~1e-5 relative; we assert 1e-4 absolute on logits of magnitude ~1.
"""

import pytest
import torch
from tiny_configs import CONFIGS
from transformers import DeepseekV2ForCausalLM

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.model.cache import LatentCache, PagedBatch, PagedLatentCache, SequenceBatch
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(our LLM, transformers model, config name) loaded from one fp32 random checkpoint."""
    cfg = CONFIGS[request.param]
    path = write_random_checkpoint(cfg, tmp_path_factory.mktemp(request.param), seed=7, dtype=torch.float32, std=0.05)
    ours = LLM(path, device="cpu", dtype="float32")
    theirs = DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, theirs, request.param


def prompt(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_every_position(pair):
    ours, theirs, _ = pair
    ids = prompt(40, ours.config.vocab_size)
    torch.testing.assert_close(ours.logits(ids), hf_logits(theirs, ids), atol=ATOL, rtol=0)


def test_teacher_forced_decode_through_the_cache(pair):
    """Prefill 10 tokens, then feed 30 more one at a time through the absorbed latent decode path."""
    ours, theirs, _ = pair
    ids = prompt(40, ours.config.vocab_size, seed=1)
    want = hf_logits(theirs, ids)
    model = ours.model
    cache = LatentCache(ours.config, 1, len(ids), torch.float32, "cpu")
    h = model(torch.tensor(ids[:10]), SequenceBatch((0,), (0,), (10,)), cache)
    got = [model.compute_logits(h)]
    for pos in range(10, len(ids)):
        h = model(torch.tensor([ids[pos]]), SequenceBatch((0,), (pos,), (1,), decode=True), cache)
        got.append(model.compute_logits(h))
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_teacher_forced_decode_through_a_paged_cache(pair):
    """As above, through a paged cache of blocks of 4 tokens whose block table is a random permutation."""
    ours, theirs, _ = pair
    ids = prompt(40, ours.config.vocab_size, seed=4)
    want = hf_logits(theirs, ids)
    model, bs = ours.model, 4
    table = tuple(torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist())
    cache = PagedLatentCache(ours.config, 10, bs, torch.float32, "cpu")

    def step(start, n):
        slots = tuple(table[p // bs] * bs + p % bs for p in range(start, start + n))
        batch = PagedBatch((start,), (n,), (table,), bs, slots, decode=start > 0)
        return model.compute_logits(model(torch.tensor(ids[start:start + n]), batch, cache))

    got = [step(0, 10)] + [step(pos, 1) for pos in range(10, len(ids))]
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_greedy_tokens_match_generate(pair):
    ours, theirs, _ = pair
    ids = prompt(12, ours.config.vocab_size, seed=2)
    out = ours.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():
        t = torch.tensor([ids])
        ref = theirs.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                              eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.finish_reason == "length"


def test_batched_generation_equals_one_at_a_time(pair):
    """Prompts of different lengths decoded together give what each gives alone."""
    ours, _, _ = pair
    prompts = [prompt(n, ours.config.vocab_size, seed=n) for n in (3, 17, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in ours.generate(prompts, params)]
    alone = [ours.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_save_pretrained_shards_load_identically(pair, tmp_path):
    """transformers' own save_pretrained output (small shards + index) loads to the same logits."""
    ours, theirs, _ = pair
    theirs.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    again = LLM(tmp_path, device="cpu", dtype="float32")
    ids = prompt(20, ours.config.vocab_size, seed=3)
    assert torch.equal(again.logits(ids), ours.logits(ids))
