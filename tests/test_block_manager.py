"""The paged-cache block manager (CPU, pure Python): pool sizing, lazy allocation at block boundaries,
slots, reuse of freed blocks, exhaustion errors, prefix caching (hits, misses, partial blocks, reference
counts, eviction order) and statistics, with exact expectations; then a randomized invariant test."""
import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv2_lib.core.config import DEEPSEEK_V2_LITE
from dsv2_lib.engine.block_manager import PENDING, BlockManager, BlockPoolExhausted, block_hash
from dsv2_lib.model.cache import block_bytes, blocks_in_mib

# ---- sizing -------------------------------------------------------------------------------------


def test_block_bytes_of_deepseek_v2_lite():
    # 16 tokens x 27 layers x 576 values (512 latent + 64 k_pe) x 2 bytes
    assert block_bytes(DEEPSEEK_V2_LITE, torch.bfloat16) == 16 * 27 * 576 * 2 == 497_664
    assert block_bytes(DEEPSEEK_V2_LITE, torch.float32, block_size=32) == 4 * 497_664


def test_pool_sized_in_mib_rounds_down():
    assert blocks_in_mib(DEEPSEEK_V2_LITE, torch.bfloat16, 128) == 269  # 269 x 497,664 = 133.9 MB <= 128 MiB
    bm = BlockManager.from_mib(DEEPSEEK_V2_LITE, torch.bfloat16, 128)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (269, 16, 269)
    assert BlockManager.from_mib(DEEPSEEK_V2_LITE, torch.bfloat16, 1).num_blocks == 2


def test_pool_too_small_for_one_block_is_an_error():
    with pytest.raises(ValueError, match=r"0.1 MiB holds no block: one block of 16 tokens takes 0.475 MiB"):
        BlockManager.from_mib(DEEPSEEK_V2_LITE, torch.bfloat16, 0.1)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0)


# ---- allocation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, blocks", [(1, 1), (15, 1), (16, 1), (17, 2), (33, 3)])
def test_lazy_allocation_at_block_boundaries(n, blocks):
    bm = BlockManager(8)
    assert bm.add_sequence("a", list(range(n))) == 0  # empty cache: nothing to reuse
    assert bm.block_table("a") == [] and bm.num_free_blocks == 8  # nothing allocated before it is needed
    assert bm.blocks_needed(n, "a") == blocks
    assert bm.append_slots("a", list(range(n))) == list(range(n))  # blocks 0, 1, 2 in order: slot == position
    assert bm.block_table("a") == list(range(blocks))
    assert bm.num_free_blocks == 8 - blocks
    # One more token takes a new block only if the last one is full.
    grows = n % 16 == 0
    assert bm.blocks_needed(1, "a") == int(grows)
    assert bm.append_slots("a", [7]) == [n]
    assert len(bm.block_table("a")) == blocks + grows
    assert bm.num_tokens("a") == n + 1


def test_slot_is_block_times_block_size_plus_offset():
    bm = BlockManager(8, block_size=16)
    bm.add_sequence("a", [1] * 16)
    bm.add_sequence("b", [2] * 3)
    assert bm.append_slots("a", [1] * 16) == list(range(0, 16))  # block 0
    assert bm.append_slots("b", [2] * 3) == [16, 17, 18]  # block 1
    assert bm.append_slots("a", [1, 1]) == [32, 33]  # a's token 16 starts a new block: block 2, offset 0
    assert bm.block_table("a") == [0, 2] and bm.block_table("b") == [1]


def test_freed_blocks_are_reused():
    bm = BlockManager(4, block_size=4, prefix_caching=False)
    for seq, n in [("a", 6), ("b", 2)]:
        bm.add_sequence(seq, [0] * n)
        bm.append_slots(seq, [0] * n)
    assert bm.block_table("a") == [0, 1] and bm.block_table("b") == [2]
    bm.free("a")
    assert bm.num_free_blocks == 3
    bm.add_sequence("c", [5] * 8)
    assert bm.append_slots("c", [5] * 8) == [0, 1, 2, 3, 4, 5, 6, 7]  # a's blocks, before the untouched block 3
    assert bm.block_table("c") == [0, 1]
    assert bm.stats().peak_used_blocks == 3


def test_exhaustion_names_sequence_tokens_and_free_blocks_and_changes_nothing():
    bm = BlockManager(2, block_size=16)
    bm.add_sequence("a", [0] * 20)
    bm.append_slots("a", [0] * 20)
    bm.add_sequence("b", [1])
    assert not bm.can_allocate(1, "b") and not bm.can_allocate(1)
    with pytest.raises(BlockPoolExhausted, match=re.escape(
            "sequence 'b' needs 1 new block(s) of 16 tokens for 1 more token(s) (it holds 0 tokens in 0 blocks), "
            "but only 0 of 2 blocks are free")):
        bm.append_slots("b", [1])
    assert bm.num_tokens("b") == 0 and bm.block_table("b") == []
    # a's last block has 12 free rows: 12 more tokens fit without a block, 13 do not.
    assert bm.can_allocate(12, "a") and not bm.can_allocate(13, "a")
    with pytest.raises(BlockPoolExhausted, match=r"sequence 'a' needs 1 new block\(s\) of 16 tokens for 13 more "
                                                 r"token\(s\) \(it holds 20 tokens in 2 blocks\)"):
        bm.append_slots("a", [0] * 13)
    assert bm.num_tokens("a") == 20
    assert bm.append_slots("a", [0] * 12) == list(range(20, 32))
    bm.free("a")
    assert bm.append_slots("b", [1]) == [16]  # both of a's blocks are cached; its tail, block 1, is evicted first


def test_a_sequence_id_is_used_once():
    bm = BlockManager(2)
    bm.add_sequence(7, [1])
    with pytest.raises(ValueError, match="sequence 7 already exists"):
        bm.add_sequence(7, [1])


# ---- prefix caching -----------------------------------------------------------------------------

A = list(range(10))  # block size 4: full blocks [0..3], [4..7], then a partial [8, 9]


def with_a(num_blocks=10, **kw) -> BlockManager:
    bm = BlockManager(num_blocks, block_size=4, **kw)
    assert bm.add_sequence("a", A) == 0
    bm.append_slots("a", A)
    assert bm.block_table("a") == [0, 1, 2]
    return bm


def test_block_names_chain_over_the_prefix():
    assert block_hash(None, [4, 5, 6, 7]) == block_hash(None, [4, 5, 6, 7])
    assert block_hash(None, [4, 5, 6, 7]) != block_hash(block_hash(None, [0, 1, 2, 3]), [4, 5, 6, 7])
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])


def test_prompt_sharing_full_blocks_reuses_them_and_counts_references():
    bm = with_a()
    assert bm.blocks_to_admit(A[:8] + [50, 51, 52], 11) == 1  # 3 blocks, 2 of them held by a: free of charge
    assert bm.add_sequence("b", A[:8] + [50, 51, 52]) == 8  # prefill starts at position 8
    assert bm.block_table("b") == [0, 1]
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 0]
    assert bm.append_slots("b", [50, 51, 52]) == [12, 13, 14]  # a fresh block 3: nothing shared is written
    s = bm.stats()
    assert (s.used_blocks, s.prefix_hit_blocks, s.prefix_hit_tokens) == (4, 2, 8)
    bm.free("a")
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert bm.stats().used_blocks == 3  # a's partial block 2 went back; the shared ones stay with b
    bm.free("b")
    s = bm.stats()
    assert (s.used_blocks, s.free_blocks, s.evictable_blocks) == (0, 10, 2)  # blocks 0, 1 keep their rows


def test_partial_blocks_are_never_shared():
    bm = with_a()
    # Same 10 tokens plus one: the rows of a's partial block 2 are equal, but it is not shared.
    assert bm.add_sequence("c", A + [99]) == 8
    assert bm.block_table("c") == [0, 1]
    assert bm.append_slots("c", [8, 9, 99]) == [12, 13, 14]


def test_the_last_prompt_token_is_always_computed():
    bm = with_a()
    # An 8-token prompt equal to a's two full blocks reuses only the first: its last token needs logits.
    assert bm.add_sequence("d", A[:8]) == 4
    assert bm.append_slots("d", A[4:8]) == [12, 13, 14, 15]
    # d's block 3 now equals a's block 1; block 1 stays the cached copy, block 3 stays private.
    bm.free("d")
    assert bm.stats().evictable_blocks == 0 and bm.ref_count(3) == 0


def test_misses():
    bm = with_a()
    assert bm.add_sequence("e", [100] + A[1:]) == 0  # the first block differs
    # The second block's tokens match a's, but after a different first block: names chain, so no hit.
    assert bm.add_sequence("f", [9, 9, 9, 9] + A[4:8] + [1]) == 0
    assert bm.add_sequence("g", A[:4] + [4, 5, 6, 0, 1]) == 4  # first block hits, second misses
    assert bm.stats().prefix_hit_blocks == 1


def test_freed_cached_blocks_are_hit_again_until_evicted_tail_first():
    bm = BlockManager(4, block_size=4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    bm.add_sequence("a", prompt)
    bm.append_slots("a", prompt)
    bm.free("a")
    s = bm.stats()
    assert (s.free_blocks, s.evictable_blocks) == (4, 3)
    # Reusing the whole cached prefix costs 3 blocks taken back from the evictable ones, plus a fresh one.
    assert bm.blocks_to_admit(prompt, 13) == 4
    # An unrelated 8-token sequence takes the unnamed block 3 first, then evicts a's *last* full block.
    bm.add_sequence("b", [50] * 8)
    assert bm.append_slots("b", [50] * 8) == [12, 13, 14, 15, 8, 9, 10, 11]
    assert bm.block_table("b") == [3, 2]
    assert bm.stats().evictions == 1
    # a's prompt again: blocks 0 and 1 are still there, block 2's rows are gone.
    assert bm.add_sequence("c", prompt) == 8
    assert bm.block_table("c") == [0, 1]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 1]
    s = bm.stats()
    assert (s.free_blocks, s.evictable_blocks, s.prefix_hit_blocks, s.prefix_hit_tokens) == (0, 0, 2, 8)


def test_forget_cached_empties_the_prefix_cache_but_not_the_blocks_sequences_hold():
    bm = BlockManager(6, block_size=4)
    prompt, other = list(range(9)), list(range(100, 105))  # 2 full blocks + 1 token; 1 full block + 1
    for seq, p in (("a", prompt), ("b", other)):
        bm.add_sequence(seq, p)
        bm.append_slots(seq, p)
    bm.free("a")
    assert bm.stats().evictable_blocks == 2
    bm.forget_cached()
    s = bm.stats()
    assert (s.evictable_blocks, s.free_blocks, s.used_blocks) == (0, 4, 2)
    assert bm.add_sequence("c", prompt) == 0  # a's blocks are plain free blocks now
    assert bm.add_sequence("d", other[:4] + [7]) == 4  # b still holds its full block: still named, still hit


def test_eviction_is_least_recently_released_first():
    bm = BlockManager(4, block_size=2)
    for seq, prompt in [("x", [1, 1, 0]), ("y", [2, 2, 0])]:
        bm.add_sequence(seq, prompt)
        bm.append_slots(seq, prompt)
    assert bm.block_table("x") == [0, 1] and bm.block_table("y") == [2, 3]  # blocks 0 and 2 are full, named
    bm.free("y")
    bm.free("x")
    assert bm.stats().evictable_blocks == 2
    # 6 tokens: the unnamed blocks 1 and 3 first, then the least recently released named one, y's block 2.
    bm.add_sequence("z", [7] * 6)
    assert bm.append_slots("z", [7] * 6) == [2, 3, 6, 7, 4, 5]
    assert bm.block_table("z") == [1, 3, 2] and bm.stats().evictions == 1
    assert bm.add_sequence("x2", [1, 1, 5]) == 2 and bm.add_sequence("y2", [2, 2, 5]) == 0


def test_prefix_caching_off_never_shares():
    bm = with_a(prefix_caching=False)
    assert bm.add_sequence("b", A) == 0
    bm.free("a")
    s = bm.stats()
    assert (s.evictable_blocks, s.prefix_hit_blocks, s.free_blocks) == (0, 0, 10)


# ---- randomized invariants ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 4), caching=st.booleans(), data=st.data())
def test_random_operations_keep_the_pool_consistent(num_blocks, block_size, caching, data):
    """Random add / append / free on a small pool with a two-letter alphabet (so prefixes repeat).
    A shadow cache records the token written to each slot; every sequence must read its own tokens
    back through its block table at every step, which fails if a block is double-allocated, a shared
    block is written, or a cached block is evicted while in use."""
    bm = BlockManager(num_blocks, block_size, prefix_caching=caching)
    rows: dict[int, int] = {}  # slot -> token written there
    seqs: dict[int, list[int]] = {}  # id -> its tokens that have slots
    tokens = st.lists(st.integers(0, 1), min_size=1, max_size=12)

    def write(seq, new):
        free_before = bm.num_free_blocks
        if bm.blocks_needed(len(new), seq) > free_before:
            with pytest.raises(BlockPoolExhausted):
                bm.append_slots(seq, new)
            assert bm.num_free_blocks == free_before and bm.num_tokens(seq) == len(seqs[seq])
            return
        slots = bm.append_slots(seq, new)
        assert len(set(slots)) == len(slots)
        for slot, t in zip(slots, new):
            assert bm.ref_count(slot // block_size) == 1  # nobody else holds a block being written
            rows[slot] = t
        seqs[seq] += new

    for step in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "append", "free", "forget"] if seqs else ["add", "forget"]))
        if op == "add":
            prompt = data.draw(tokens)
            cached = bm.add_sequence(step, prompt)
            assert cached % block_size == 0 and cached < len(prompt)
            seqs[step] = prompt[:cached]
            write(step, prompt[cached:])
        elif op == "append":
            write(data.draw(st.sampled_from(sorted(seqs))), data.draw(tokens))
        elif op == "free":
            seq = data.draw(st.sampled_from(sorted(seqs)))
            bm.free(seq)
            del seqs[seq]
        else:
            bm.forget_cached()
            assert bm.stats().evictable_blocks == 0

        held = Counter()
        for seq, toks in seqs.items():
            table = bm.block_table(seq)
            assert len(table) == -(-len(toks) // block_size) and len(set(table)) == len(table)
            assert [rows[table[p // block_size] * block_size + p % block_size] for p in range(len(toks))] == toks
            held.update(table)
            if len(toks) % block_size:  # a partly filled last block belongs to this sequence alone
                assert bm.ref_count(table[-1]) == 1
        assert all(bm.ref_count(b) == held[b] for b in range(num_blocks))
        s = bm.stats()
        assert s.used_blocks == len(held) and s.used_blocks + s.free_blocks == num_blocks
        assert s.peak_used_blocks >= s.used_blocks
        assert s.evictable_blocks <= s.free_blocks and (caching or s.evictable_blocks == 0)


def test_a_block_with_a_pending_token_is_named_once_the_token_is_known():
    """An engine one step ahead gives a slot to a token it has not read back yet (PENDING). The block it
    fills cannot be named (a name stands for its tokens) until set_token says what the token is."""
    bm = BlockManager(8, 4)
    bm.add_sequence("a", [1, 2, 3])
    bm.append_slots("a", [1, 2, 3])
    bm.append_slots("a", [PENDING])  # block 0 is full, its last token unknown
    assert bm.blocks_to_admit([1, 2, 3, 9, 5], 5) == 2  # no prefix hit: nothing named yet
    with pytest.raises(ValueError, match="holds token 3, not a pending one"):
        bm.set_token("a", 2, 7)
    bm.set_token("a", 3, 9)
    assert bm.blocks_to_admit([1, 2, 3, 9, 5], 5) == 1
    assert bm.add_sequence("b", [1, 2, 3, 9, 5]) == 4 and bm.block_table("b") == bm.block_table("a")
    assert bm.add_sequence("c", [1, 2, 3, 8, 5]) == 0  # another last token: another block
