"""The "Build it" exercises cannot rot: each chapter's hidden solution passes its autograder, a planted
wrong answer fails with a message that names the case and what differs, and a swapped-in piece really
runs inside the engine."""
import math
import re

import pytest
import torch
from notebook_solutions import solutions

from dsv2_lib.engine import sampling
from dsv2_lib.engine.block_manager import block_hash
from dsv2_lib.lessons.exercises import EXERCISES, _neox_rope, check, generate_with, grade, swapped
from dsv2_lib.ops import moe_routing, norm, rope
from dsv2_lib.ops.mla_decode import balanced_segments
from dsv2_lib.tools import roofline

SOLUTIONS = solutions("check")


def test_every_exercise_has_a_solution_in_its_chapter():
    assert set(SOLUTIONS) == set(EXERCISES)
    for name, (chapter, _) in SOLUTIONS.items():
        assert chapter.startswith(EXERCISES[name].chapter + "_"), f"{name}: solution in {chapter}"


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_solution_passes(name, capsys):
    passed, line = grade(name, SOLUTIONS[name][1])
    assert passed and line.startswith(f"✓ {name}: all "), line
    check(name, SOLUTIONS[name][1])
    assert capsys.readouterr().out == line + "\n"


_ref_rms, _ref_route, _ref_filter = norm.rms_norm_reference, moe_routing.route, sampling.filter_logits


def _no_weight(x, weight, eps):
    return _ref_rms(x, torch.ones_like(weight), eps)


def _skeleton_rms(x, weight, eps):
    raise NotImplementedError


def _softmax_after_topk(logits, cfg):  # picks by logit, then softmax over the k picked only
    values, ids = logits.float().sort(dim=-1, descending=True, stable=True)
    return values[:, :cfg.num_experts_per_tok].softmax(-1), ids[:, :cfg.num_experts_per_tok]


def _unpadded_align(ids, n_experts, block):
    return moe_routing.moe_align_reference(ids, n_experts, 1)


def _top_p_inclusive(logits, params):  # drops the token that crosses top_p instead of keeping it
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        drop = sorted_logits.softmax(-1).cumsum(-1) > params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def _unchained_prefix(cache, prompt, block_size):  # names each block alone: a block's tokens anywhere would match
    hits = []
    for i in range((len(prompt) - 1) // block_size):
        name = block_hash(None, prompt[i * block_size:(i + 1) * block_size])
        if name not in cache:
            break
        hits.append((name, cache[name]))
    return hits


def _slot_is_the_worker(per, first, workers):  # two partials of one worker would share a slot
    return [(i, b, t0, t1, None if slot is None else i) for i, b, t0, t1, slot in balanced_segments(per, first, workers)]


def _no_overlap_check(path):  # parses well, but accepts overlapping tensors
    from dsv2_lib.core.safetensors_io import SafetensorsFormatError, read_header
    try:
        return read_header(path)
    except SafetensorsFormatError as e:
        if "overlaps" not in str(e):
            raise
        return 0, {}, {}


def _wrapping_embedding(ids, weight):  # a negative id wraps around to the last rows instead of failing
    return weight[ids.long()]


def _latent_not_normalised(x, q_proj, kv_a_proj, kv_a_norm, kv_b_proj, heads, rope_dim):  # skips kv_a_layernorm
    T, c = x.shape[0], kv_a_norm.shape[0]
    q = (x @ q_proj.T).view(T, heads, -1)
    q_nope, q_pe = q.split([q.shape[-1] - rope_dim, rope_dim], dim=-1)
    latent, k_pe = (x @ kv_a_proj.T).split([c, rope_dim], dim=-1)
    kv = (latent @ kv_b_proj.T).view(T, heads, -1)
    k_nope, v = kv.split([q_nope.shape[-1], kv.shape[-1] - q_nope.shape[-1]], dim=-1)
    return q_nope, q_pe, latent, k_pe, k_nope, v


def _online(q, k, v, start, scale, tile=16, rescale=True, mask=True):  # section 3's recurrence, with two switches
    n, h = q.shape[:2]
    pos = torch.arange(start, start + n)
    m, l, acc = torch.full((h, n), float("-inf")), torch.zeros(h, n), torch.zeros(h, n, v.shape[-1])
    for j in range(0, k.shape[0], tile):
        s = torch.einsum("qhd,khd->hqk", q, k[j:j + tile]) * scale
        if mask:
            s = s.masked_fill(torch.arange(j, j + s.shape[-1])[None, :] > pos[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        c = torch.exp(m - m_new) if rescale else torch.ones_like(m)
        p = torch.exp(s - m_new[..., None])
        l, acc, m = l * c + p.sum(dim=-1), acc * c[..., None] + torch.einsum("hqk,khd->hqd", p, v[j:j + tile]), m_new
    return (acc / l[..., None]).transpose(0, 1)


def _no_rescale(q, k, v, start, scale, tile=16):  # forgets exp(m_old - m_new) when the running max grows
    return _online(q, k, v, start, scale, tile, rescale=False)


def _no_causal_mask(q, k, v, start, scale, tile=16):  # every query sees every key, its future included
    return _online(q, k, v, start, scale, tile, mask=False)


def _swapped_halves(x):  # silu(up) * gate
    i = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., i:].float()) * x[..., :i].float()).to(x.dtype)


def _chunks_merged_alike(query, cache, slots, lengths, scale, d_c):  # each chunk's softmax, averaged: no lse weights
    outs = []
    for b, (slot, n) in enumerate(zip(slots, lengths)):
        rows = cache[slot, :n].float()
        parts = [((query[b].float() @ rows[s:s + 64].T) * scale).softmax(-1) @ rows[s:s + 64, :d_c]
                 for s in range(0, n, 64)]
        outs.append(torch.stack(parts).mean(0) if parts else torch.zeros(query.shape[1], d_c))
    return torch.stack(outs)


def _reserves_one_row_too_many(num_blocks, block_size, running, prompt_len, max_tokens):  # forgets the -1
    blocks = lambda rows: -(-rows // block_size)  # noqa: E731
    return sum(blocks(m) for _, m in running) + blocks(prompt_len + max_tokens) <= num_blocks


def _ignores_the_table(block_table, positions, block_size):  # contiguous slots, as if blocks were 0, 1, 2, ...
    return list(positions)


def _prompts_before_decodes(budget, decoding, partial, waiting):  # prompt chunks first: decodes stall behind them
    if budget < 1:
        raise ValueError("budget")
    chunk = min(partial, budget)
    left, admitted = budget - chunk, []
    for length in waiting:
        if left < 1:
            break
        admitted.append(min(length, left))
        left -= admitted[-1]
    return min(decoding, left), chunk, admitted


def _reads_every_expert(cfg, batch, context, bytes_per_value=2):  # all routed experts, whatever the batch
    c = roofline.parameter_counts(cfg)
    weights = c["total"] - c["embedding"] - c["lm_head"] + cfg.vocab_size * cfg.hidden_size
    return float((weights + batch * cfg.hidden_size + batch * context * cfg.num_hidden_layers * cfg.cache_row_dim)
                 * bytes_per_value)


PLANTED = {"decode_bytes": (_reads_every_expert, "expected"), "read_header": (_no_overlap_check, "must be refused"), "embedding": (_wrapping_embedding, "must be refused"),
           "mla_projections": (_latent_not_normalised, "the result[2]"), "online_attention": (_no_rescale, "expected"),
           "silu_and_mul": (_swapped_halves, "expected"), "split_kv_decode": (_chunks_merged_alike, "expected"),
           "slot_mapping": (_ignores_the_table, "expected"), "prefix_hits": (_unchained_prefix, "expected"), "reserve_admits": (_reserves_one_row_too_many, "expected"),
           "rms_norm": (_no_weight, "the result"), "rope": (_neox_rope, "the NeoX pairing"),
           "route": (_softmax_after_topk, "the result[0]"), "moe_align": (_unpadded_align, "shape"),
           "filter_logits": (_top_p_inclusive, "expected"), "balanced_segments": (_slot_is_the_worker, "expected"),
           "step_tokens": (_prompts_before_decodes, "expected")}


def test_the_online_attention_grader_needs_the_causal_mask_and_takes_the_recurrence_done_right():
    assert grade("online_attention", _online)[0]
    passed, line = grade("online_attention", _no_causal_mask)
    assert not passed and "after 12 cached tokens" in line, line


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_a_planted_wrong_answer_fails_with_a_useful_message(name):
    wrong, words = PLANTED[name]
    passed, line = grade(name, wrong)
    assert not passed
    assert re.match(rf"✗ {name}, case \d+ of \d+ \(.+\): ", line) and words in line, line
    assert "Traceback" not in line


def test_the_skeleton_and_a_crash_are_reported_in_words():
    assert grade("rms_norm", _skeleton_rms) == (False, "✗ rms_norm: not implemented yet (the skeleton still raises "
                                                  "NotImplementedError)")
    passed, line = grade("rms_norm", lambda x, weight, eps: torch.cat([x, weight]))
    assert not passed and "case 1 of" in line and "raised RuntimeError" in line, line
    with pytest.raises(KeyError, match="no exercise 'norm'; the exercises are"):
        grade("norm", _skeleton_rms)


@pytest.mark.parametrize("name", sorted(n for n, e in EXERCISES.items() if e.engine))
def test_the_engine_calls_every_swappable_piece(name):
    """generate_with is no demonstration unless the tiny model really runs the reader's function."""
    import importlib

    module, attr = EXERCISES[name].engine.split(":")
    own = getattr(importlib.import_module(module), attr)
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    assert "identical to the engine's own" in generate_with(name, spy, max_tokens=2)
    assert calls, f"the engine never called {EXERCISES[name].engine}"
    assert getattr(importlib.import_module(module), attr) is own


def test_swapped_replaces_the_engine_function_and_restores_it():
    calls = []

    def spy(x, weight, eps):
        calls.append(x.shape)
        return _ref_rms(x, weight, eps)

    assert "identical to the engine's own" in generate_with("rms_norm", spy, max_tokens=3)
    assert calls, "the engine never called the swapped-in function"
    assert norm.rms_norm_reference is _ref_rms and moe_routing.route is _ref_route and sampling.filter_logits is _ref_filter
    assert "part from the engine's at token" in generate_with("rms_norm", _no_weight, max_tokens=8)
    assert "not written yet" in generate_with("rms_norm", _skeleton_rms, max_tokens=2)
    assert norm.rms_norm_reference is _ref_rms, "a skeleton's NotImplementedError left the engine swapped"
    with pytest.raises(ValueError, match="no engine function"):
        with swapped("reserve_admits", _reserves_one_row_too_many):
            pass
    assert rope.apply_rope_reference_ is not _neox_rope


def test_a_list_of_the_wrong_length_names_the_missing_or_extra_item():
    def drops_the_last(per, first, workers):
        return balanced_segments(per, first, workers)[:-1]

    def repeats_the_last(per, first, workers):
        segments = balanced_segments(per, first, workers)
        return segments + segments[-1:]

    for wrong, words in ((drops_the_last, "is missing"), (repeats_the_last, "is extra")):
        passed, line = grade("balanced_segments", wrong)
        assert not passed
        assert re.search(rf"the result: (\d+) items, expected (\d+); item \d+ {words}: \(", line), line


def test_a_float_may_differ_from_the_reference_by_roundings_only():
    """A sum taken in another order differs in its last bits and passes; a real error does not."""
    from dsv2_lib.lessons.exercises import _difference
    assert _difference(0.1 + 0.2 + 0.3, 0.3 + 0.2 + 0.1, exact=False) is None
    assert "expected 4900000000.0, got 4900004900.0 (rtol 1e-12)" in _difference(4.9000049e9, 4.9e9, exact=False)
    assert _difference(0.1 + 0.2 + 0.3, 0.3 + 0.2 + 0.1, exact=True) is not None


def test_a_masked_element_must_stay_masked():
    """Where the reference has -inf, a finite value is an error however loose the tolerance (|g - inf| <= inf)."""
    from dsv2_lib.lessons.exercises import _difference
    want = torch.tensor([0.5, float("-inf"), float("inf")])
    assert _difference(want.clone(), want, exact=False) is None
    assert "result[1]: expected -inf, got -0.25" in _difference(torch.tensor([0.5, -0.25, float("inf")]), want, exact=False)
    assert "result[2]: expected inf, got -inf" in _difference(torch.tensor([0.5, float("-inf"), float("-inf")]), want,
                                                               exact=False)
    assert "result[0]: expected 0.5, got -inf" in _difference(torch.tensor([float("-inf")] * 3), want, exact=False)


def test_rebinding_instead_of_writing_in_place_is_named():
    """x = rotated(x) leaves the caller's tensors as they were: the grader says so instead of listing values."""
    def rebinds(q_pe, k_pe, positions, cache):
        q_pe = q_pe * 2  # a new tensor: the caller's q_pe is untouched
    passed, line = grade("rope", rebinds)
    assert not passed and "unchanged: assign into them" in line, line


def test_rounding_every_step_to_16_bits_fails_the_silu_grader():
    """silu(gate) * up in bf16 rounds twice; the reference rounds once from fp32: within a tolerance, but not
    the same bits, and the chapter is about the difference."""
    def twice(x):
        i = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :i]) * x[..., i:]
    passed, line = grade("silu_and_mul", twice)
    assert not passed and "round once at the end" in line, line


def test_the_slot_mapping_grader_refuses_a_negative_position():
    """Python's table[-1] would quietly give the last block's row: the reader's function must refuse it."""
    def naive(block_table, positions, block_size):  # past the table: IndexError; but -1 wraps around
        return [block_table[p // block_size] * block_size + p % block_size for p in positions]
    passed, line = grade("slot_mapping", naive)
    assert not passed and "negative position" in line and "must be refused" in line, line


def test_the_rms_norm_grader_needs_transformers_rounding_order_and_eps_inside_the_root():
    """Scaling by the weight in fp32 and rounding once is within a bf16 tolerance, but not transformers' bits;
    eps added outside the square root is invisible until the mean square is near eps."""
    def round_once(x, weight, eps):
        xf = x.float()
        return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def eps_outside(x, weight, eps):
        xf = x.float()
        return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)

    passed, line = grade("rms_norm", round_once)
    assert not passed and "then multiply by the weight" in line, line
    passed, line = grade("rms_norm", eps_outside)
    assert not passed and "mean square near eps" in line, line


def test_the_read_header_grader_needs_the_offsets_checked_against_the_data():
    """A parser that checks the header length, dtypes, byte counts and overlaps, but trusts the offsets to
    lie inside the data and to cover it, accepts a truncated file: the grader must refuse it."""
    import json
    import struct
    from pathlib import Path

    from dsv2_lib.core.safetensors_io import DTYPE_SIZES, TensorInfo

    def trusting(path):
        raw = Path(path).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        if 8 + n > len(raw):
            raise ValueError("the header runs past the end of the file")
        header, infos = json.loads(raw[8:8 + n]), {}
        metadata = header.pop("__metadata__", {})
        for name, entry in header.items():
            if entry["dtype"] not in DTYPE_SIZES:
                raise ValueError(f"{name}: unknown dtype")
            start, end = entry["data_offsets"]
            if end - start != math.prod(entry["shape"]) * DTYPE_SIZES[entry["dtype"]]:
                raise ValueError(f"{name}: byte count")
            if any(start < other.end and other.start < end for other in infos.values()):
                raise ValueError(f"{name}: overlap")
            infos[name] = TensorInfo(entry["dtype"], tuple(entry["shape"]), start, end)
        return n, metadata, infos

    passed, line = grade("read_header", trusting)
    assert not passed and "a truncated file (must be refused)" in line, line


def test_a_kernel_that_skips_an_element_or_stores_past_the_end_is_named():
    """The kernel exercises fill out (and a guard after it) with a marked NaN: what a kernel left unwritten
    or wrote past the end is named, instead of a comparison with whatever memory held; a NaN the kernel
    computed (0 * inf: eps forgotten on a row of zeros) is a stored value, compared with the reference."""
    from dsv2_lib.lessons.kernel_exercises import FILL_BITS, GUARD, _nan_out, _never_stored, _stored_outside

    out, guard = _nan_out((2, 3), "cpu")
    assert out.shape == (2, 3) and guard.shape == (GUARD,) and out.isnan().all() and guard.isnan().all()
    want = torch.arange(6.0).view(2, 3)
    out.copy_(want)
    assert _never_stored(out, want) is None and _stored_outside(guard) is None
    out[0, 1] = torch.tensor(0.0) * torch.tensor(float("inf"))  # computed: stored, if wrong
    assert _never_stored(out, want) is None
    out.view(torch.int32)[1, 2] = FILL_BITS
    assert "out[1, 2] was never stored (1 of 6 elements" in _never_stored(out, want)
    guard[3] = float("nan")  # any store past the end, a NaN too
    assert "stored 1 value(s) past the end of out, the first 4 float(s) past it" in _stored_outside(guard)


def test_the_filter_logits_grader_needs_the_tokens_removed():
    """Dividing by the temperature alone keeps every token: the cases with top-k or top-p must fail it."""
    passed, line = grade("filter_logits", lambda logits, params: logits.float() / params.temperature)
    assert not passed and "expected -inf, got" in line, line
