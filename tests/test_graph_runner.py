"""The CUDA-graph runner's host side, on the CPU: sizes, the buffers a replay reads, the checks, and a step
laid out as graph entries (one per token, prompt chunks included) computing what the eager passes compute."""
from dataclasses import replace

import pytest
import torch

from dsv2_lib import LLM, TINY
from dsv2_lib.engine.block_manager import PENDING, BlockManager
from dsv2_lib.engine.graph_runner import BUCKETS, DecodeBuffers, DecodeGraphRunner, StaticDecodeBatch, bucket
from dsv2_lib.engine.model_runner import graph_entries
from dsv2_lib.engine.scheduler import Scheduler
from dsv2_lib.model.cache import PagedBatch, PagedLatentCache


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 17, 128, 129, 256, 257, 512)] == \
        [1, 2, 3, 4, 5, 12, 24, 128, 192, 256, 384, 512]
    assert bucket(3, (8, 2)) == 8
    with pytest.raises(ValueError, match="513 exceeds the largest CUDA-graph size 512"):
        bucket(513)
    assert BUCKETS == tuple(sorted(BUCKETS))


def step():
    """Three decode entries over a pool of 16-row blocks: positions 0, 17 and 40."""
    tables = [(5,), (2, 7), (1, 3, 4)]
    starts = [0, 17, 40]
    slots = [t[s // 16] * 16 + s % 16 for t, s in zip(tables, starts)]
    return [11, 12, 13], starts, tables, slots


def test_buffers_hold_what_the_paged_batch_derives_and_pad_the_rest():
    ids, starts, tables, slots = step()
    buf = DecodeBuffers.allocate(4, 5, "cpu")
    buf.fill(ids, starts, tables, slots)
    ref = PagedBatch(starts=tuple(starts), lens=(1, 1, 1), block_tables=tuple(tables), block_size=16,
                     slots=tuple(slots), decode=True)
    lengths, bound = ref.attention_lengths()
    assert bound is None and buf.lengths[:3].tolist() == list(lengths) == [1, 18, 41]
    assert torch.equal(buf.positions[:3], ref.positions())
    assert torch.equal(buf.slot_mapping[:3], ref.slot_mapping)
    assert torch.equal(buf.block_table[:3, :3], ref.block_table) and (buf.block_table[:3, 3:] == -1).all()
    assert buf.input_ids.tolist() == ids + [0]
    # the padding entry: token 0 at position 0, writes no row, attends over nothing, has no blocks
    assert (buf.slot_mapping[3], buf.lengths[3], buf.positions[3]) == (-1, 0, 0) and (buf.block_table[3] == -1).all()
    # a smaller step in the same buffers leaves nothing of the larger one behind
    buf.fill([9], [3], [(6,)], [99])
    assert buf.lengths.tolist() == [4, 0, 0, 0] and buf.slot_mapping.tolist() == [99, -1, -1, -1]
    assert (buf.block_table[1:] == -1).all() and buf.block_table[0, 0] == 6


def test_fill_writes_only_the_columns_in_use_and_leaves_no_stale_block_behind():
    # a table as wide as a long max_len; steps of changing size and table lengths, as the scheduler makes
    g = torch.Generator().manual_seed(0)
    n, width = 8, 640
    buf = DecodeBuffers.allocate(n, width, "cpu")
    for _ in range(60):
        B = int(torch.randint(1, n + 1, (1,), generator=g))
        lens = torch.randint(1, 40, (B,), generator=g).tolist()
        tables = [torch.randint(0, 10_000, (k,), generator=g).tolist() for k in lens]
        buf.fill([1] * B, [16 * k - 1 for k in lens], tables, [t[-1] * 16 + 15 for t in tables])
        want = torch.full((n, width), -1, dtype=torch.int32)
        for b, t in enumerate(tables):
            want[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        assert torch.equal(buf.block_table, want)
        assert buf.columns == max(lens)


def test_static_batch_reads_the_buffers_and_passes_the_model_host_checks():
    cache = PagedLatentCache(TINY, num_blocks=8, block_size=16, dtype=torch.float32, device="cpu", max_len=100)
    buf = DecodeBuffers.allocate(4, -(-100 // 16), "cpu")
    batch = StaticDecodeBatch.over(buf, cache)
    cache.check_fits(batch)  # the placeholders are legal: one token each, in block 0, no row written
    assert batch.decode and batch.host_checked and batch.num_tokens == 4 and batch.last_position == 99
    assert batch.positions() is buf.positions and batch.slot_mapping is buf.slot_mapping
    assert batch.block_table is buf.block_table and batch.attention_lengths() == (buf.lengths, 100)
    assert not PagedBatch((0,), (1,), ((0,),), 16, (0,)).host_checked


def test_runner_needs_a_gpu_and_refuses_what_the_graph_cannot_check():
    cpu_cache = PagedLatentCache(TINY, num_blocks=4, block_size=16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="need the model and cache on a GPU"):
        DecodeGraphRunner(None, cpu_cache)

    runner = DecodeGraphRunner.__new__(DecodeGraphRunner)  # its checks, without a GPU
    runner.cache = PagedLatentCache(TINY, num_blocks=4, block_size=16, dtype=torch.float32, device="cpu", max_len=64)
    runner.width, runner.vocab = 4, 100
    good = ([1], [20], [(0, 1)], [17])
    runner.check(*good)
    for bad, message in [
        (([100], [20], [(0, 1)], [17]), "token id 100 outside the vocabulary"),
        (([1], [64], [(0, 1, 2, 3)], [17]), "needs 65 cached tokens; the cache holds 64"),
        (([1], [20], [(0,)], [17]), "has 21 tokens but its block table only 1 blocks"),
        (([1], [20], [(0, 9)], [17]), r"block table \(0, 9\) outside the pool of 4 blocks"),
        (([1], [20], [(0, 1)], [64]), "a slot is outside the pool's 64 rows"),
        (([1], [20], [(0, 1, 2, 3, 0)], [17]), "a table of 5 blocks; the buffers hold 4"),
        (([1, 2], [20], [(0, 1)], [17]), "2 tokens, 1 starts"),
    ]:
        with pytest.raises((ValueError, IndexError), match=message):
            runner.check(*bad)


def mixed_step(llm, cache):
    """A scheduler step with decode items and a newcomer's prompt chunk: two requests prefilled and
    decoded once, then a third (sharing the first's 16-token prefix) admitted beside their decodes."""

    sched = Scheduler(BlockManager(cache.num_blocks, cache.block_size))
    runner = llm.runner
    prompts = [list(range(2, 22)), list(range(40, 47)), [*range(2, 18), *range(90, 101)]]
    for p in prompts[:2]:
        sched.add_request(p, 8)
    for _ in range(2):  # the two prompts, then one decode step each
        work = sched.schedule()
        picks = runner.step(work, cache).argmax(-1).tolist()
        sched.update(work, picks)
    sched.add_request(prompts[2], 8)
    work = sched.schedule()
    return work


def test_a_step_laid_out_as_graph_entries_one_per_token():

    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=4)
    cache = llm.runner.cache
    work = mixed_step(llm, cache)
    assert [w.prefill for w in work] == [False, False, True]
    chunk = work[2]
    assert chunk.positions.start == 16 and len(chunk.token_ids) == 11  # 16 prompt tokens found in the prefix cache
    e = graph_entries(work)
    assert e.token_ids == [work[0].token_ids[0], work[1].token_ids[0], *range(90, 101)]
    assert e.starts == [21, 8, *range(16, 27)]
    assert e.slots == [*work[0].slots, *work[1].slots, *chunk.slots]
    assert e.block_tables == [work[0].block_table, work[1].block_table] + [chunk.block_table] * 11
    assert e.samples == [0, 1, 12] and e.sources == [-1] * 13
    # one step ahead: a decode token still PENDING names its request's row of the step before's picks

    ahead = [replace(work[0], token_ids=(PENDING,)), work[1], chunk]
    assert graph_entries(ahead, {work[0].request.id: 1, work[1].request.id: 0}).sources == [1] + [-1] * 12


def test_graph_entries_compute_the_same_step_as_the_eager_passes():
    """What a replay computes, checked on the CPU in fp32: the step's tokens as decode entries of one
    PagedBatch (each attending over its first position + 1 rows, prompt tokens included) give the same
    logits and cache rows as the runner's eager passes (the decode items, then the prompt chunk through
    prefill attention): the entries keep attention causal."""

    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_mib=4)
    cache = llm.runner.cache
    work = mixed_step(llm, cache)
    before = cache.rows.clone()
    want = llm.runner.step(work, cache)
    want_rows = cache.rows.clone()
    cache.rows.copy_(before)
    e = graph_entries(work)
    batch = PagedBatch(starts=tuple(e.starts), lens=(1,) * len(e.starts), block_tables=tuple(e.block_tables),
                       block_size=cache.block_size, slots=tuple(e.slots), decode=True)
    got = llm.model.compute_logits(llm.model(torch.tensor(e.token_ids), batch, cache))[e.samples]
    assert want.shape == got.shape == (3, llm.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.rows, want_rows, rtol=1e-5, atol=1e-5)
    # the chunk's entries attend causally: with its tokens in another order the last entry's logits change
    batch_rev = PagedBatch(starts=tuple(e.starts[:2]) + tuple(reversed(e.starts[2:])), lens=batch.lens,
                           block_tables=batch.block_tables, block_size=cache.block_size,
                           slots=tuple(e.slots[:2]) + tuple(reversed(e.slots[2:])), decode=True)
    cache.rows.copy_(before)
    other = llm.model.compute_logits(llm.model(torch.tensor(e.token_ids), batch_rev, cache))[e.samples]
    assert not torch.allclose(other[2], want[2], atol=1e-3)
