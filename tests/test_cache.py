"""The paged latent cache (CPU, float32): reading a sequence's rows through a block table — any
blocks, in any order — gives exactly what the contiguous cache gives, in prefill and in decode;
slot -1 is never written; a shared prompt prefix is computed once and changes no output."""

import pytest
import torch
from tiny_configs import CONFIGS

from dsv2_lib import LLM, SamplingParams
from dsv2_lib.model.cache import LatentCache, PagedBatch, PagedLatentCache, SequenceBatch, block_bytes
from dsv2_lib.model.mla import write_latent_cache
from dsv2_lib.tools.random_checkpoint import write_random_checkpoint


@pytest.fixture(scope="module", params=["tiny", *sorted(CONFIGS)])
def llm(request, tmp_path_factory):
    if request.param == "tiny":
        return LLM("tiny", device="cpu", dtype="float32")
    path = write_random_checkpoint(CONFIGS[request.param], tmp_path_factory.mktemp(request.param), seed=3,
                                   dtype=torch.float32, std=0.05)
    return LLM(path, device="cpu", dtype="float32")


def paged_batch(tables, starts, lens, block_size, decode=False):
    """A PagedBatch whose new tokens' slots follow from the block tables."""
    slots = tuple(t[p // block_size] * block_size + p % block_size
                  for t, a, n in zip(tables, starts, lens) for p in range(a, a + n))
    return PagedBatch(tuple(starts), tuple(lens), tuple(map(tuple, tables)), block_size, slots, decode)


def run_both(llm, seqs, prefill, block_size, seed):
    """Logits of ``seqs`` (token lists, all fed together): first ``prefill`` tokens of each at once, then
    one token per step (teacher forcing), through the contiguous cache and through a paged cache whose
    blocks are a random permutation of the pool. Returns (contiguous, paged) logits, one list per step."""
    model, cfg, n = llm.model, llm.config, max(map(len, seqs))
    per_seq = -(-n // block_size)
    perm = torch.randperm(per_seq * len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(len(seqs))]
    contiguous = LatentCache(cfg, len(seqs), n, torch.float32, "cpu")
    paged = PagedLatentCache(cfg, per_seq * len(seqs), block_size, torch.float32, "cpu")
    got = {"contiguous": [], "paged": []}
    for pos in range(prefill, n + 1):
        live = [i for i, s in enumerate(seqs) if len(s) >= pos]
        start = 0 if pos == prefill else pos - 1
        ids = torch.tensor([t for i in live for t in seqs[i][start:pos]])
        lens = [pos - start] * len(live)
        decode = pos > prefill
        batches = {"contiguous": SequenceBatch(tuple(live), (start,) * len(live), tuple(lens), decode),
                   "paged": paged_batch([tables[i] for i in live], [start] * len(live), lens, block_size, decode)}
        for kind, cache in (("contiguous", contiguous), ("paged", paged)):
            got[kind].append(model.compute_logits(model(ids, batches[kind], cache)))
    return got["contiguous"], got["paged"]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_equals_contiguous_prefill_and_teacher_forced_decode(llm, block_size):
    vocab = llm.config.vocab_size
    g = torch.Generator().manual_seed(block_size)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (23, 40, 17)]
    contiguous, paged = run_both(llm, seqs, prefill=12, block_size=block_size, seed=block_size)
    for a, b in zip(contiguous, paged):
        assert torch.equal(a, b)


def test_write_skips_slot_minus_one():
    cache = torch.zeros(8, 3)
    batch = PagedBatch((0, 0), (2, 1), ((1,), (0,)), 4, (5, -1, 2))
    write_latent_cache(cache, batch, torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3]))
    assert cache[5].tolist() == [1.0] * 3 and cache[2].tolist() == [3.0] * 3
    assert cache.abs().sum() == 12  # nothing else written


def test_block_table_is_int32_padded_with_minus_one():
    batch = paged_batch([[3, 0, 2], [1]], [33, 0], [1, 5], 16, decode=False)
    assert batch.block_table.dtype == torch.int32
    assert batch.block_table.tolist() == [[3, 0, 2], [1, -1, -1]]
    assert batch.context_lens == (34, 5)
    assert batch.packed_context_rows.tolist() == [*range(48, 64), *range(0, 16), 32, 33, *range(16, 21)]


def test_host_built_indices_positions_and_max_slot():
    batch = paged_batch([[3, 0, 2], [1]], [33, 0], [1, 5], 16, decode=False)
    assert batch.positions().dtype == torch.int64 and batch.positions().tolist() == [33, 0, 1, 2, 3, 4]
    assert batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.tolist() == list(batch.slots)
    assert batch.slots == (33, 16, 17, 18, 19, 20) and batch.max_slot == 33
    rows = batch.context_rows  # [num_seqs, max_context], padded with row 0
    assert rows.dtype == torch.int64 and rows.shape == (2, 34)
    assert rows[0].tolist() == [*range(48, 64), *range(0, 16), 32, 33]
    assert rows[1].tolist() == [*range(16, 21)] + [0] * 29
    empty = PagedBatch((), (), (), 16, ())
    assert empty.positions().shape == (0,) and empty.max_slot == -1
    assert empty.packed_context_rows.shape == (0,) and empty.block_table.shape == (0, 0)


def test_cache_sized_in_mib_and_checks():
    cfg = CONFIGS["lite"]
    one = block_bytes(cfg, torch.float32, 4) / 2**20
    cache = PagedLatentCache.from_mib(cfg, 3.5 * one, torch.float32, "cpu", block_size=4)
    assert cache.num_blocks == 3 and cache.layer(0).shape == (12, cfg.cache_row_dim)
    with pytest.raises(ValueError, match="holds no block"):
        PagedLatentCache.from_mib(cfg, 0.5 * one, torch.float32, "cpu", block_size=4)
    with pytest.raises(ValueError, match=r"sequence 0 has 5 tokens but its block table only 1 blocks of 4"):
        cache.check_fits(PagedBatch((0,), (5,), ((0,),), 4, (0, 1, 2, 3, 4)))
    with pytest.raises(IndexError, match="outside the pool of 3 blocks"):
        cache.check_fits(paged_batch([[3]], [0], [2], 4))


# ---- prefix caching through the engine --------------------------------------------------------


def test_a_shared_system_prompt_is_prefilled_once():
    system = list(range(3, 43))  # 40 tokens: two full blocks of 16 are shared, 8 tokens are not
    prompts = [system + [100 + i] * (i + 1) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cached = LLM("tiny", device="cpu", dtype="float32")
    plain = LLM("tiny", device="cpu", dtype="float32", prefix_caching=False)
    outs = [o.token_ids for o in cached.generate(prompts, params)]
    assert outs == [o.token_ids for o in plain.generate(prompts, params)]
    total = sum(map(len, prompts))
    assert plain.last_stats.scheduler.prefill_tokens == total
    assert cached.last_stats.scheduler.prefix_hit_tokens == 2 * 32
    assert cached.last_stats.scheduler.prefill_tokens == total - 2 * 32
    assert cached.last_stats.blocks.prefix_hit_blocks == 4
