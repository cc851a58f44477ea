"""DeepSeekMoE: an fp32 softmax router picks ``k`` of ``E`` routed experts per token; two shared
experts see every token.

``route``, ``moe_align_reference`` and ``routed_experts`` are the PyTorch reference (the semantic
definition: sort the choices by expert, one matmul pair per expert). ``topk_softmax``, ``moe_align``
and ``moe_experts`` dispatch to the CUDA kernels of ``kernels_cu/moe.cu`` for CUDA tensors:

* router: one warp per token (softmax, greedy or group-limited top-k, renormalise or scale);
* alignment: the T·k choices sorted by expert, each expert's segment padded to a tile, no host sync;
* experts, four regimes chosen by the token count T (constants below):
  T <= ``GEMV_MAX_TOKENS`` (and every fp32 input): GEMV kernels that stream the selected experts'
  weights over the whole GPU; T <= ``SKINNY_MAX_TOKENS`` (16-bit, H and I multiples of 64): the skinny
  grouped GEMM, each selected expert's weights read once per tile of 8 of its tokens, the tokens as the
  mma's narrow side; beyond, bf16 from ``GROUPED_MM_MIN_TOKENS``: ``torch._grouped_mm`` (cuBLAS) on
  the aligned rows; otherwise our grouped tensor-core GEMM (``mma.sync``, 64-row tiles);
* combine: the weighted sum back to token order, in a fixed order (deterministic), plus the shared
  experts' output.

The GEMV regime has two kernels (``GEMV_KERNEL``): ``"per_choice"`` (default), whose gate|up launch has
one block row per (token, choice) and whose down launch one per token, each block over all of its
token's choices, so an expert chosen by several tokens is read once per choice; and ``"grouped"``:
the choices grouped by expert into work items of up to ``GEMV_TB`` tokens, so every selected expert's
weights are read once, the shared experts as more work items of the same launches, and the whole
layer for a few tokens as ``moe_decode`` (router GEMM, one router+items kernel, gate|up GEMV, down
GEMV, combine). Measured on the H200 the grouped one is slower at every size it takes (1 ... 16
tokens: 0.056 vs 0.043 ms at 1 token, 0.38 vs 0.29 at 16, routed experts alone): it stays for
chapter 08's lesson and for ``benchmarks/bench_moe.py``, which times both.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv2_lib.core import kernels, streams
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.core.dtypes import empty_param, upcast
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.model.mlp import MLP
from dsv2_lib.ops.activation import silu_and_mul

# Thresholds, from benchmarks/bench_moe.py on the H200 (it prints the sweep that re-sets them: every path
# forced at 1 ... 4096 tokens, and its recommendation). Measured 2026-11-29 (routed experts alone, ms):
# the per-choice GEMV wins up to 4 tokens (4: 0.105 vs skinny 0.110), the skinny GEMM from 8 to 128
# (8: 0.159 vs GEMV 0.169; 32: 0.294 vs torch._grouped_mm 0.383; 128: 0.362 vs 0.399),
# torch._grouped_mm beyond (256: 0.411 vs skinny 0.527) and beat our mma kernel at EVERY size, so bf16
# never takes the mma kernel; it remains the taught kernel and the fp16 path beyond the skinny range.
GEMV_MAX_TOKENS = 4          # up to this many tokens: the GEMV kernels
SKINNY_MAX_TOKENS = 128      # beyond the GEMV, up to this many tokens (16-bit): our skinny grouped GEMM
GROUPED_MM_MIN_TOKENS = 1    # beyond those, bf16 always takes torch._grouped_mm (measured faster than mma)
GROUPED_MM_ALIGN = 8         # rows per expert segment are padded to this for torch._grouped_mm
FP32_GEMV_MAX_TOKENS = 64    # fp32 has no tensor-core path here: GEMV kernels up to this, the reference beyond
GEMV_KERNEL = "per_choice"   # or "grouped" (each selected expert read once): slower on the H200, see above
GEMV_TB = 8                  # choices per work item of the grouped GEMV (GEMV_TB in moe.cu)
GEMV_WARPS = 4               # warps per block of the grouped GEMV kernels (1..8: __launch_bounds__(256))
GEMV_COLS_PER_WARP = 1       # output columns per warp of the grouped GEMV (grid y = cols / (warps * this))
SHARED_IN_ROUTER = False     # moe_decode: the shared experts' gate|up runs in the router kernel's launch
SHARED_STREAM_MAX_TOKENS = 16  # beyond the GEMV path (where the shared experts are choices of its launches),
# up to this many tokens the shared experts run on a side stream (streams.py): measured on the whole layer
# (bench_moe.py, 2026-11-29), 8 tokens 0.211 vs 0.222 ms, 16 tokens 0.260 vs 0.265; at 32 and 64 tokens the
# skinny GEMM streams at full bandwidth and the side stream slowed it (0.347 vs 0.337, 0.403 vs 0.334)
ROUTER_THREADS = 256         # block of moe_route_gemv (block 0 routes, one warp per token; the rest: shared gate|up)
TILE_M = 64                  # rows per tile of our grouped GEMM (BM in moe.cu)
SKINNY_ROWS = 8              # sorted rows (tokens) per tile of the skinny GEMM (moe.cu)
SKINNY_WARPS = 4             # warps per block of the skinny GEMM, 16 output columns each (moe.cu)
GEMM_N = {"gate_up": 64, "down": 128}  # output columns per block (BN/2 and BN in moe.cu)
GEMV_THREADS = 128           # threads per block of the per-choice GEMV kernels and moe_route_few (moe.cu)
GATE_UP_COLS = 2             # output columns per warp of the per-choice gate|up GEMV (moe.cu)
DOWN_COLS = 4                # output columns per block of the down GEMV + combine, all of a token's choices (moe.cu)
MAX_EXPERTS = 256            # 32 lanes x ROUTER_PER_LANE (moe.cu); also bounds moe_align's shared memory
MAX_TOPK = 32                # one lane per pick in the router
COMBINE_THREADS = 64         # threads per block of moe_combine (16 bytes of columns each)
ALIGN_THREADS = 1024         # moe_align runs as one block of 32 warps

MOE_CU = kernels.declare(
    "moe.cu",
    ["topk_softmax", "moe_align"]
    + [f"moe_gemm<{t}, {g}>" for t in ("__nv_bfloat16", "__half") for g in ("true", "false")]
    + [f"{k}<{t}>" for k in ("moe_route_few", "moe_gemv_gate_up", "moe_gemv_down_combine", "moe_combine",
                             "moe_route_gemv") for t in CUDA_TYPE.values()]
    + [f"moe_gemv_grouped<{t}, {g}>" for t in CUDA_TYPE.values() for g in ("true", "false")] + ["moe_gemv_items"]
    + [f"moe_skinny<{t}, {g}>" for t in ("__nv_bfloat16", "__half") for g in ("true", "false")],
)


def topk_lowest_id(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim, descending; among equal scores the lowest index first (a stable sort,
    so ties are decided the same way on every device and by the kernel)."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), indices[..., :k].contiguous()


def route(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: fp32 gate logits ``[T, E]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64).

    Softmax over all experts, then top-k: ``greedy`` over all experts, or ``group_limited_greedy``
    (keep the ``topk_group`` groups with the best single expert, pick top-k inside them). Then, as
    DeepSeek's own modelling code does it: renormalise the k weights when ``norm_topk_prob`` and
    k > 1, otherwise multiply them by ``routed_scaling_factor``.

    Ties: among equal scores the lowest expert id is picked first (and the lowest group id among
    groups with equal best scores), so the choice is defined even where ``torch.topk`` would not say.
    """
    scores = upcast(logits).softmax(dim=-1)
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "group_limited_greedy":
        t, e = scores.shape
        groups = scores.view(t, cfg.n_group, e // cfg.n_group)
        best_groups = topk_lowest_id(groups.amax(dim=-1), cfg.topk_group)[1]
        keep = torch.zeros(t, cfg.n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        scores = (groups * keep[..., None]).view(t, e)
    weights, ids = topk_lowest_id(scores, k)
    if k > 1 and cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def moe_align_reference(ids: torch.Tensor, n_experts: int, block: int):
    """Sort the ``T·k`` choices of ``ids [T, k]`` by expert and pad each expert's segment to ``block`` rows.

    Choice ``c = t·k + j`` is token ``t``'s ``j``-th pick. Returns four int32 tensors of fixed size
    (the worst case, so the GPU version needs no host synchronisation):

    * ``sorted_rows [cap]``: the choice at each sorted position, ``-1`` for padding; inside an expert's
      segment the choices keep their order (by token);
    * ``slot_of [T·k]``: the position of each choice in ``sorted_rows`` (its inverse);
    * ``tile_expert [max_tiles]``: the expert of each ``block``-row tile, ``-1`` past the last segment;
    * ``offsets [E + 1]``: where each expert's padded segment starts; ``offsets[E]`` = rows used.

    with ``max_tiles = (T·k + E·(block - 1)) // block`` and ``cap = max_tiles · block``.
    """
    flat = ids.flatten()
    n = flat.numel()
    if n and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"moe_align: expert ids must be in [0, {n_experts}), got {int(flat.min())}..{int(flat.max())}")
    dev = ids.device
    counts = torch.bincount(flat, minlength=n_experts)
    offsets = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum((counts + block - 1) // block * block, 0)
    max_tiles = (n + n_experts * (block - 1)) // block
    order = flat.argsort(stable=True)              # choices grouped by expert, in token order
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts       # unpadded start of each expert
    pos = offsets[:-1][expert] + torch.arange(n, device=dev) - first[expert]
    sorted_rows = torch.full((max_tiles * block,), -1, dtype=torch.int64, device=dev)
    sorted_rows[pos] = order
    slot_of = torch.empty(n, dtype=torch.int64, device=dev)
    slot_of[order] = pos
    tiles = torch.arange(max_tiles, device=dev) * block
    tile_expert = torch.searchsorted(offsets[1:], tiles, right=True)
    tile_expert[tiles >= offsets[-1]] = -1
    return tuple(t.to(torch.int32) for t in (sorted_rows, slot_of, tile_expert, offsets))


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])`` for ``x [T, H]``; experts stacked as
    ``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj [E, H, I]``.
    Accumulates in fp32 (or wider).

    Reference algorithm: sort the T·k (token, expert) choices by expert (``moe_align_reference`` with
    no padding), run each expert once on its rows, scatter-add back in fp32, round once.
    """
    t, k = ids.shape
    sorted_rows, _, _, offsets = moe_align_reference(ids, gate_up_proj.shape[0], 1)
    sorted_rows, offsets = sorted_rows.long(), offsets.tolist()
    out = torch.zeros(t, x.shape[1], dtype=upcast(x).dtype, device=x.device)
    for expert in range(gate_up_proj.shape[0]):
        rows = sorted_rows[offsets[expert] : offsets[expert + 1]]  # this expert's choices t*k + j
        if rows.numel() == 0:
            continue
        tokens = rows // k
        h = silu_and_mul(F.linear(x[tokens], gate_up_proj[expert]))  # [n, 2I] -> [n, I]
        y = upcast(F.linear(h, down_proj[expert])) * weights.flatten()[rows, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def gemv_items_reference(ids: torch.Tensor, n_experts: int, tb: int = GEMV_TB):
    """The work items of the grouped GEMV (``build_items`` in moe.cu) for ``ids [T, k]``.

    Returns ``sorted [n_valid]`` (the valid choices ``t·k + j`` sorted by expert, by token inside an
    expert; ids outside ``[0, E)`` are dropped) and ``items [n_items, 3]`` = (expert, first position in
    ``sorted``, count <= ``tb``): each expert's segment cut into pieces of at most ``tb`` choices, in
    expert order. int32. There are at most ``min(E, T·k) + T·k // tb`` items.
    """
    flat = ids.flatten()
    valid = (flat >= 0) & (flat < n_experts)
    order = torch.nonzero(valid).flatten()
    order = order[flat[order].argsort(stable=True)]
    counts = torch.bincount(flat[order], minlength=n_experts).tolist()
    items, start = [], 0
    for e, c in enumerate(counts):
        items += [(e, start + q, min(tb, c - q)) for q in range(0, c, tb)]
        start += c
    return order.to(torch.int32), torch.tensor(items, dtype=torch.int32, device=ids.device).view(-1, 3)


def _gemv_max_items(n: int, n_experts: int, tb: int = GEMV_TB) -> int:
    """Upper bound on the items of n choices: sum_e ceil(c_e / tb) <= min(E, n) + n // tb."""
    return min(n_experts, n) + n // tb


# ---- the CUDA path ---------------------------------------------------------------------------------
def topk_softmax(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The router (:func:`route`'s semantics): the ``topk_softmax`` kernel for fp32 CUDA logits ``[T, E]``.

    Returns (weights ``[T, k]`` fp32, ids ``[T, k]`` int64); other dtypes and CPU tensors take ``route``.
    """
    if not kernels.use_kernels(logits) or logits.dtype != torch.float32:
        return route(logits, cfg)
    t, e = logits.shape if logits.dim() == 2 else (None, None)
    kernels.check(logits, "topk_softmax logits", dtype=torch.float32, shape=(None, cfg.n_routed_experts))
    k = cfg.num_experts_per_tok
    if not 0 < k <= min(e, MAX_TOPK) or e > MAX_EXPERTS:
        raise ValueError(f"topk_softmax: needs 0 < k <= min(E, {MAX_TOPK}) and E <= {MAX_EXPERTS}, got k={k}, E={e}")
    if not _groups_fit(cfg):
        raise ValueError(f"topk_softmax: bad groups n_group={cfg.n_group}, topk_group={cfg.topk_group} for E={e}, k={k}")
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        warps = 4
        kernels.launch(MOE_CU.function("topk_softmax", logits.device), (-(-t // warps),), (32 * warps,),
                       (kernels.ptr(weights), kernels.ptr(ids), kernels.ptr(logits), np.int32(t), np.int32(e),
                        np.int32(k), *_router_args(cfg)))
    return weights, ids


def moe_align(ids: torch.Tensor, n_experts: int, block: int):
    """:func:`moe_align_reference` on the GPU: one block, three passes (count, prefix sum, stable
    scatter), outputs of the worst-case size, no host synchronisation. Ids outside ``[0, E)`` are
    dropped (slot ``-1``) instead of refused: checking them would need a sync."""
    if not kernels.use_kernels(ids):
        return moe_align_reference(ids, n_experts, block)
    kernels.check(ids, "moe_align ids", dtype=torch.int64, shape=(None, None))
    if not 0 < n_experts <= MAX_EXPERTS or block < 1:
        raise ValueError(f"moe_align: needs 0 < n_experts <= {MAX_EXPERTS} and block >= 1, got {n_experts}, {block}")
    n = ids.numel()
    max_tiles = (n + n_experts * (block - 1)) // block
    if max_tiles * block >= 1 << 31:
        raise ValueError(f"moe_align: {n} choices are too many for int32 positions")
    dev = ids.device
    sorted_rows = torch.empty(max_tiles * block, dtype=torch.int32, device=dev)
    slot_of = torch.empty(n, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    offsets = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    kernels.launch(MOE_CU.function("moe_align", dev), (1,), (ALIGN_THREADS,),
                   (kernels.ptr(sorted_rows), kernels.ptr(slot_of), kernels.ptr(tile_expert), kernels.ptr(offsets),
                    kernels.ptr(ids), np.int32(n), np.int32(n_experts), np.int32(block), np.int32(max_tiles),
                    np.int32(max_tiles * block)),
                   shared_mem=(32 * n_experts + n_experts + 1) * 4)
    return sorted_rows, slot_of, tile_expert, offsets


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, shared: torch.Tensor | None = None,
                shared_ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """``routed_experts(x, weights, ids, ...)`` (+ ``shared [T, H]``, the shared experts' output, added in
    x's dtype): the kernels for CUDA tensors, else the reference. ``shared_ready``: an event recorded
    after ``shared`` was written on another stream; the first kernel that reads ``shared`` waits for it,
    so the routed experts run meanwhile.

    ``x [T, H]``, ``weights [T, k]`` fp32, ``ids [T, k]`` int64, ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, all contiguous. The kernel path needs H and I multiples of 8, 16-byte
    aligned tensors and E <= 256 (else the reference); fp32 takes the GEMV kernels up to
    ``FP32_GEMV_MAX_TOKENS`` tokens and the reference (cuBLAS per expert) beyond: the tensor-core
    kernels here take bf16/fp16 only.
    """
    def ready(t: torch.Tensor | None) -> torch.Tensor | None:  # shared, once its stream has written it
        streams.join(shared_ready, x.device)
        return t

    def reference():
        out = routed_experts(x, weights, ids, gate_up_proj, down_proj)
        return out if shared is None else out + ready(shared)

    if not kernels.use_kernels(x) or x.dtype not in CUDA_TYPE:
        return reference()
    e, i2, h = gate_up_proj.shape if gate_up_proj.dim() == 3 else (0, 0, 0)
    i = i2 // 2
    t, k = ids.shape if ids.dim() == 2 else (0, 0)
    kernels.check(gate_up_proj, "moe_experts gate_up_proj", dtype=x.dtype, shape=(None, None, None), device=x.device)
    kernels.check(x, "moe_experts x", shape=(None, h))
    kernels.check(down_proj, "moe_experts down_proj", dtype=x.dtype, shape=(e, h, i), device=x.device)
    kernels.check(ids, "moe_experts ids", dtype=torch.int64, shape=(x.shape[0], None), device=x.device)
    kernels.check(weights, "moe_experts weights", dtype=torch.float32, shape=(t, k), device=x.device)
    if shared is not None:
        kernels.check(shared, "moe_experts shared", dtype=x.dtype, shape=(t, h), device=x.device)
    if i2 % 2 or not 0 < k <= e:
        raise ValueError(f"moe_experts: gate_up_proj [E, 2I, H] with 0 < k <= E, got {list(gate_up_proj.shape)}, k={k}")
    if e > MAX_EXPERTS or h % 8 or i % 8 \
            or not kernels.aligned16(x, gate_up_proj, down_proj) or (shared is not None and not kernels.aligned16(shared)) \
            or (x.dtype == torch.float32 and t > FP32_GEMV_MAX_TOKENS):
        return reference()
    if t == 0:
        return x.new_zeros(0, h) if shared is None else ready(shared).clone()
    if x.dtype == torch.float32 or t <= GEMV_MAX_TOKENS:
        if GEMV_KERNEL == "grouped" and _items_fit(t * k, e):
            return _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, moe_gemv_items(ids, e), shared=ready(shared))
        return gemv_down_combine(gemv_gate_up(x, gate_up_proj, ids), down_proj, ids, weights, ready(shared))
    if t <= SKINNY_MAX_TOKENS and h % 64 == 0 and i % 64 == 0:
        y, slot_of = skinny_experts(x, ids, gate_up_proj, down_proj)
    elif t >= GROUPED_MM_MIN_TOKENS and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        y, slot_of = _grouped_mm_experts(x, ids, gate_up_proj, down_proj)
    else:
        y, slot_of = _mma_experts(x, ids, gate_up_proj, down_proj)
    return _combine(y, weights, slot_of, ready(shared))


def gemv_gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``h [T·k, I]`` (``moe_gemv_gate_up``, inputs already checked): choice ``c = t·k + j`` gets
    ``silu(x[t] W_g^T) * (x[t] W_u^T)`` of expert ``ids[t, j]``, zeros for an id outside ``[0, E)``.
    ``out``: a buffer of at least T·k rows to write them into (:func:`moe_few`'s, whose later rows hold
    the shared experts' parts)."""
    (e, i2, h), (t, k) = gate_up_proj.shape, ids.shape
    hid = torch.empty(t * k, i2 // 2, dtype=x.dtype, device=x.device) if out is None else out
    kernels.launch(MOE_CU.function(f"moe_gemv_gate_up<{CUDA_TYPE[x.dtype]}>", x.device),
                   (t * k, -(-(i2 // 2) // (GEMV_THREADS // 32 * GATE_UP_COLS))), (GEMV_THREADS,),
                   (kernels.ptr(hid), kernels.ptr(x), kernels.ptr(gate_up_proj), kernels.ptr(ids), np.int32(k), np.int32(e),
                    np.int32(h), np.int32(i2 // 2)))
    return hid


def gemv_down_combine(hid: torch.Tensor, down_proj: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      shared: torch.Tensor | None, shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """``out [T, H]`` (``moe_gemv_down_combine``, inputs already checked): each choice's down projection
    ``hid[c] W_d^T`` (fp32, rounded once; an id outside ``[0, E)`` is dropped), and in the same launch the
    combine: the weighted sum of a token's choices in pick order, plus the shared experts: ``shared``,
    or with ``shared_down [H, P·I]`` the down projections of ``hid``'s P shared rows per token (rows
    ``T·k + t·P + p``), summed in fp32 and rounded once, as the shared MLP's down projection. One block
    per (token, ``DOWN_COLS`` columns) computes every choice of its token, so it combines them itself."""
    (e, h, i), (t, k) = down_proj.shape, ids.shape
    parts = 0 if shared_down is None else shared_down.shape[1] // i
    out = torch.empty(t, h, dtype=hid.dtype, device=hid.device)
    kernels.launch(MOE_CU.function(f"moe_gemv_down_combine<{CUDA_TYPE[hid.dtype]}>", hid.device), (t, -(-h // DOWN_COLS)),
                   (GEMV_THREADS,), (kernels.ptr(out), kernels.ptr(hid), kernels.ptr(down_proj), kernels.ptr(ids),
                                     kernels.ptr(weights), _ptr_or_null(shared), _ptr_or_null(shared_down), np.int32(k),
                                     np.int32(e), np.int32(h), np.int32(i), np.int32(parts)),
                   shared_mem=(k + parts) * DOWN_COLS * 4)
    return out


_COUNTERS: dict[int, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still point at them


def _arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """At least ``n`` zeroed uint32 counters on ``device``, kept for every later launch (each launch leaves
    them at zero). Made, or grown, outside a CUDA-graph capture: the first call of a size runs eagerly
    before a graph captures it (as the graph runner's warm-up does). An outgrown buffer is kept alive,
    since graphs captured earlier still use it."""
    buf = _COUNTERS.get(device.index)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"moe: {n} router arrival counters are needed during a CUDA-graph capture; "
                               "run the step once eagerly before capturing it")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[device.index] = buf
    return buf


def _ptr_or_null(t: torch.Tensor | None):
    return np.uint64(0) if t is None else kernels.ptr(t)


def _items_fit(n: int, n_experts: int) -> bool:
    """build_items keeps n ids and 3E counters in shared memory (48 KiB without opting in)."""
    return (n + 3 * n_experts) * 4 <= 48 * 1024


def _items_workspace(n: int, n_experts: int, dev):
    """(sorted [n], items [3 max_items], n_items [1], max_items): filled by build_items on the GPU."""
    max_items = _gemv_max_items(n, n_experts)
    return (torch.empty(n, dtype=torch.int32, device=dev), torch.empty(3 * max_items, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev), max_items)


def moe_gemv_items(ids: torch.Tensor, n_experts: int):
    """The grouped GEMV's work items of ``ids [T, k]`` on the GPU (one block, no host sync):
    ``(sorted, items, n_items, max_items)``; ``sorted[:n_valid]`` and ``items[:3·n_items]`` are
    :func:`gemv_items_reference`'s, the rest is unused scratch."""
    kernels.check(ids, "moe_gemv_items ids", dtype=torch.int64, shape=(None, None))
    n = ids.numel()
    if not 0 < n_experts <= MAX_EXPERTS or not _items_fit(n, n_experts):
        raise ValueError(f"moe_gemv_items: needs 0 < n_experts <= {MAX_EXPERTS} and (T*k + 3E) * 4 <= 48 KiB")
    work = _items_workspace(n, n_experts, ids.device)
    kernels.launch(MOE_CU.function("moe_gemv_items", ids.device), (1,), (ALIGN_THREADS,),
                   (kernels.ptr(work[0]), kernels.ptr(work[1]), kernels.ptr(work[2]), kernels.ptr(ids),
                    np.int32(n), np.int32(n_experts)), shared_mem=(n + 3 * n_experts) * 4)
    return work


def _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, work, shared=None, shared_w=None, h_sh=None):
    """Routed experts (+ shared) for a few tokens with the grouped GEMV kernels, then the combine.

    ``work``: the items (:func:`moe_gemv_items` or the router kernel). ``shared [T, H]``: a finished
    shared-experts output to add; or ``shared_w = (gate_up [2·S·I, H], down [H, S·I])``: the shared MLP
    computed here as S·(token chunks) more slots of the same launches (``h_sh``: its gate|up output,
    when the router kernel already computed it)."""
    (t, k), (e, i2, h) = ids.shape, gate_up_proj.shape
    i, ct, dev = i2 // 2, CUDA_TYPE[x.dtype], x.device
    sorted_rows, items, n_items, max_items = work
    nw, cpw = GEMV_WARPS, GEMV_COLS_PER_WARP
    if not 1 <= nw <= 8 or cpw < 1:
        raise ValueError(f"GEMV_WARPS must be in 1..8 and GEMV_COLS_PER_WARP >= 1, got {nw}, {cpw}")
    n_chunks = -(-t // GEMV_TB)
    none = np.uint64(0)
    s_parts, gu_sh, dn_sh, y_sh, gate_up_shared_slots = 0, none, none, None, 0
    if shared_w is not None:
        s_parts = shared_w[0].shape[0] // i2
        dn_sh = kernels.ptr(shared_w[1])
        y_sh = torch.empty(t, h, dtype=x.dtype, device=dev)
        if h_sh is None:
            h_sh = torch.empty(t, s_parts * i, dtype=x.dtype, device=dev)
            gu_sh, gate_up_shared_slots = kernels.ptr(shared_w[0]), s_parts * n_chunks
    hid = torch.empty(t * k, i, dtype=x.dtype, device=dev)
    y = torch.empty(t * k, h, dtype=x.dtype, device=dev)
    common = (kernels.ptr(sorted_rows), kernels.ptr(items), kernels.ptr(n_items), np.int32(max_items),
              np.int32(t), np.int32(k), np.int32(h), np.int32(i), np.int32(s_parts), np.int32(cpw))
    hsp = none if h_sh is None else kernels.ptr(h_sh)
    kernels.launch(MOE_CU.function(f"moe_gemv_grouped<{ct}, true>", dev),
                   (max_items + gate_up_shared_slots, -(-i // (nw * cpw))), (32 * nw,),
                   (kernels.ptr(hid), hsp, kernels.ptr(x), kernels.ptr(x), kernels.ptr(gate_up_proj), gu_sh) + common)
    kernels.launch(MOE_CU.function(f"moe_gemv_grouped<{ct}, false>", dev),
                   (max_items + (n_chunks if shared_w is not None else 0), -(-h // (nw * cpw))), (32 * nw,),
                   (kernels.ptr(y), none if y_sh is None else kernels.ptr(y_sh), kernels.ptr(hid), hsp,
                    kernels.ptr(down_proj), dn_sh) + common)
    return _combine(y, weights, None, y_sh if shared_w is not None else shared, ids, e)


def _tile_experts(x, ids, gate_up_proj, down_proj, kernel: str, rows: int, cols: tuple[int, int], warps: int):
    """The two launches of a tiled kernel over ``moe_align``'s tiles of ``rows`` sorted rows, one expert
    each: gate|up then down, grid (tiles, slabs of ``cols`` = (gate|up, down) output columns), ``warps``
    warps a block: (y [tiles·rows, H] in sorted order, slot_of)."""
    k, (e, i2, h) = ids.shape[1], gate_up_proj.shape
    i, ct = i2 // 2, CUDA_TYPE[x.dtype]
    sorted_rows, slot_of, tile_expert, _ = moe_align(ids, e, rows)
    tiles = tile_expert.numel()
    hid = torch.empty(tiles * rows, i, dtype=x.dtype, device=x.device)
    y = torch.empty(tiles * rows, h, dtype=x.dtype, device=x.device)
    for name, out, a, w, n_out, kdim, n_cols in (("true", hid, x, gate_up_proj, i, h, cols[0]),
                                                 ("false", y, hid, down_proj, h, i, cols[1])):
        kernels.launch(MOE_CU.function(f"{kernel}<{ct}, {name}>", x.device), (tiles, -(-n_out // n_cols)), (32 * warps,),
                       (kernels.ptr(out), kernels.ptr(a), kernels.ptr(w), kernels.ptr(sorted_rows),
                        kernels.ptr(tile_expert), np.int32(n_out), np.int32(kdim), np.int32(k)))
    return y, slot_of


def _mma_experts(x, ids, gate_up_proj, down_proj):
    """Our grouped tensor-core GEMMs over the TILE_M-padded sorted rows: (y [cap, H], slot_of)."""
    return _tile_experts(x, ids, gate_up_proj, down_proj, "moe_gemm", TILE_M, (GEMM_N["gate_up"], GEMM_N["down"]), 4)


def skinny_experts(x, ids, gate_up_proj, down_proj):
    """Our skinny grouped GEMMs (``moe_skinny``, bf16/fp16, H and I multiples of 64) on tiles of
    SKINNY_ROWS sorted rows, one expert per tile: (y [tiles·SKINNY_ROWS, H] in sorted order, slot_of)."""
    cols = 16 * SKINNY_WARPS
    return _tile_experts(x, ids, gate_up_proj, down_proj, "moe_skinny", SKINNY_ROWS, (cols, cols), SKINNY_WARPS)


def _grouped_mm_experts(x, ids, gate_up_proj, down_proj):
    """cuBLAS's grouped GEMM (``torch._grouped_mm``, bf16) on rows aligned to GROUPED_MM_ALIGN: (y, slot_of).
    Padding rows read token 0 (finite, never combined); rows past ``offsets[E]`` are never read."""
    k = ids.shape[1]
    sorted_rows, slot_of, _, offsets = moe_align(ids, gate_up_proj.shape[0], GROUPED_MM_ALIGN)
    a = x[sorted_rows.clamp(min=0) // k]  # [cap, H]: the tokens in expert order
    ends = offsets[1:]
    hid = silu_and_mul(torch._grouped_mm(a, gate_up_proj.transpose(1, 2), offs=ends))
    return torch._grouped_mm(hid, down_proj.transpose(1, 2), offs=ends), slot_of


def _combine(y, weights, slot_of, shared, ids=None, n_experts=0) -> torch.Tensor:
    """out [T, H] = round(Σ_j weights[t, j] · y[slot_of[t·k + j]]) (+ shared); blocks of COMBINE_THREADS
    threads x 16 bytes of columns, one row of blocks per token. ``slot_of`` None: y in choice order;
    ``ids`` given: choices with ids outside [0, E) are skipped."""
    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    cols = COMBINE_THREADS * 16 // y.element_size()
    kernels.launch(MOE_CU.function(f"moe_combine<{CUDA_TYPE[y.dtype]}>", y.device), (t, -(-h // cols)),
                   (COMBINE_THREADS,),
                   (kernels.ptr(out), kernels.ptr(y), kernels.ptr(weights), _ptr_or_null(slot_of),
                    _ptr_or_null(shared), np.int32(k), np.int32(h), _ptr_or_null(ids), np.int32(n_experts)))
    return out


def _router_args(cfg: ModelConfig) -> tuple:
    """(n_group, topk_group, renorm, scale) as the router kernels take them (groups 0, 0: greedy)."""
    k = cfg.num_experts_per_tok
    groups = (cfg.n_group, cfg.topk_group) if cfg.topk_method == "group_limited_greedy" else (0, 0)
    return (*map(np.int32, groups), np.int32(k > 1 and cfg.norm_topk_prob), np.float32(cfg.routed_scaling_factor))


def _groups_fit(cfg: ModelConfig) -> bool:
    """Greedy routing, or groups the router kernels take: at most 32 (one per lane), E a multiple of
    them, and enough experts in the kept groups for k picks."""
    if cfg.topk_method != "group_limited_greedy":
        return True
    e, k, g, tg = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    return 0 < g <= 32 and e % g == 0 and 0 < tg <= g and k <= tg * (e // g)


def _few_tokens(x: torch.Tensor, cfg: ModelConfig) -> bool:
    """Kernels on for ``x [T, H]``, 0 < T <= ``GEMV_MAX_TOKENS`` (fp32: ``FP32_GEMV_MAX_TOKENS``), and a
    router and shapes that the one-warp router kernels take."""
    if not kernels.use_kernels(x) or x.dtype not in CUDA_TYPE or x.dim() != 2:
        return False
    t, h = x.shape
    e, k, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    limit = FP32_GEMV_MAX_TOKENS if x.dtype == torch.float32 else GEMV_MAX_TOKENS
    return 0 < t <= limit and e <= MAX_EXPERTS and 0 < k <= min(e, MAX_TOPK) and h % 8 == 0 and i % 8 == 0 \
        and x.is_contiguous() and kernels.aligned16(x) and _groups_fit(cfg)


def _few_applies(x: torch.Tensor, cfg: ModelConfig, gate_w: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, shared_w: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether ``MoE.forward`` hands ``x`` to :func:`moe_few`: the per-choice GEMV selected, few tokens
    (``_few_tokens``), an fp32 router weight ``[E, H]``, and routed and shared weights the GEMV kernels
    take (x's dtype, contiguous, 16-byte aligned, the shared MLP's intermediate a whole number of
    expert widths, or no shared experts)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    weights = [gate_up_proj, down_proj, *(shared_w or ())]
    ok = GEMV_KERNEL == "per_choice" and _few_tokens(x, cfg) \
        and gate_w.dtype == torch.float32 and gate_w.shape == (cfg.n_routed_experts, h) and gate_w.is_contiguous() \
        and all(w.dtype == x.dtype and w.is_contiguous() for w in weights) and kernels.aligned16(gate_w, *weights)
    if ok and shared_w is not None:
        (n2, hg), (hd, n) = shared_w[0].shape, shared_w[1].shape
        ok = hg == hd == h and n2 == 2 * n and n % i == 0 and n > 0
    return ok


def route_few(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig, shared_gate_up: torch.Tensor | None = None):
    """``moe_route_few`` (inputs as :func:`_few_applies` takes them): the router of a few tokens in one
    launch, its fp32 logits ``x W_r^T`` (``gate_w [E, H]``) routed by ``topk_softmax``'s rule, and in the
    same launch the shared experts' gate|up, which does not wait for the routing. Returns (weights
    ``[T, k]`` fp32, ids ``[T, k]`` int64, logits ``[T, E]`` fp32, hid ``[T·(k + P), I]``) where the rows
    of hid from ``T·k`` on hold the shared experts' SwiGLU output: row ``T·k + t·P + p`` is part p of
    token t, the columns ``[p·I, (p+1)·I)`` of the shared MLP (``shared_gate_up [2·P·I, H]``, P = 0
    without it); the first ``T·k`` rows are for :func:`gemv_gate_up` to fill."""
    t, h = x.shape
    e, k, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    parts = 0 if shared_gate_up is None else shared_gate_up.shape[0] // (2 * i)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    hid = torch.empty(t * (k + parts), i, dtype=x.dtype, device=x.device)
    blocks = t * -(-e // (GEMV_THREADS // 32)) + t * parts * -(-i // (GEMV_THREADS // 32 * GATE_UP_COLS))
    kernels.launch(MOE_CU.function(f"moe_route_few<{CUDA_TYPE[x.dtype]}>", x.device), (blocks,), (GEMV_THREADS,),
                   (kernels.ptr(weights), kernels.ptr(ids), kernels.ptr(logits), kernels.ptr(x), kernels.ptr(gate_w),
                    np.int32(t), np.int32(e), np.int32(h), np.int32(k), *_router_args(cfg),
                    kernels.ptr(_arrival_counters(t, x.device)), kernels.ptr(hid), _ptr_or_null(shared_gate_up),
                    np.int32(i), np.int32(parts)))
    return weights, ids, logits, hid


def moe_few(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor, shared_w: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE layer of a few tokens (``_few_applies``) in three launches: :func:`route_few` (the router,
    and the shared experts' gate|up beside it), ``moe_gemv_gate_up`` for the routed choices and
    ``moe_gemv_down_combine`` for all of them, with the combine. ``shared_w`` = (gate_up ``[2·P·I, H]``,
    down ``[H, P·I]``), the shared MLP's weights: its P parts are choices of weight 1, their down
    products summed in fp32 and rounded once, as the MLP's. ``x [T, H] -> [T, H]``."""
    weights, ids, _, hid = route_few(x, gate_w, cfg, None if shared_w is None else shared_w[0])
    gemv_gate_up(x, gate_up_proj, ids, out=hid)
    return gemv_down_combine(hid, down_proj, ids, weights, None, None if shared_w is None else shared_w[1])


def _decode_applies(x: torch.Tensor, cfg: ModelConfig, shared_w=None) -> bool:
    """Whether :func:`moe_decode` takes ``x``: the grouped GEMV selected, few tokens (``_few_tokens``),
    work items that fit the router kernel's shared memory, and shared experts' weights it takes."""
    if GEMV_KERNEL != "grouped" or not _few_tokens(x, cfg):
        return False
    h, i = x.shape[1], cfg.moe_intermediate_size
    ok = _items_fit(x.shape[0] * cfg.num_experts_per_tok, cfg.n_routed_experts)
    if shared_w is not None:
        gu, dn = shared_w
        ok = ok and gu.shape[0] % (2 * i) == 0 and gu.shape[1] == h and dn.shape == (h, gu.shape[0] // 2) \
            and gu.dtype == dn.dtype == x.dtype and gu.is_contiguous() and dn.is_contiguous() and kernels.aligned16(gu, dn)
    return ok


def moe_decode(x: torch.Tensor, logits: torch.Tensor, cfg: ModelConfig, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor, shared_w=None) -> torch.Tensor:
    """The MoE layer for a few tokens (``_decode_applies``) in four launches after the router GEMM:

    1. ``moe_route_gemv``: block 0 routes every token (``topk_softmax``'s rule) and builds the work
       items; the other blocks compute the shared experts' gate|up meanwhile (``SHARED_IN_ROUTER``);
    2. ``moe_gemv_grouped`` gate|up over the items (each selected expert read once);
    3. ``moe_gemv_grouped`` down over the items and the shared experts' down;
    4. ``moe_combine``: the weighted sum in pick order + the shared output.

    ``logits [T, E]`` fp32; ``shared_w = (gate_up [2·S·I, H], down [H, S·I])`` of the shared MLP or None.
    Same result as ``topk_softmax`` + ``moe_experts(..., shared=MLP(x))``, up to the fp32 summation order."""
    t, h = x.shape
    e, k, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    kernels.check(logits, "moe_decode logits", dtype=torch.float32, shape=(t, e), device=x.device)
    kernels.check(gate_up_proj, "moe_decode gate_up_proj", dtype=x.dtype, shape=(e, 2 * i, h), device=x.device)
    kernels.check(down_proj, "moe_decode down_proj", dtype=x.dtype, shape=(e, h, i), device=x.device)
    if not kernels.aligned16(gate_up_proj, down_proj):
        raise ValueError("moe_decode: expert weights must be 16-byte aligned")
    dev, ct = x.device, CUDA_TYPE[x.dtype]
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int64, device=dev)
    work = _items_workspace(t * k, e, dev)
    none, h_sh, units, s_parts = np.uint64(0), None, 0, 0
    n_cols = -(-i // ((ROUTER_THREADS // 32) * GEMV_COLS_PER_WARP))
    if shared_w is not None and SHARED_IN_ROUTER:
        s_parts = shared_w[0].shape[0] // (2 * i)
        h_sh = torch.empty(t, s_parts * i, dtype=x.dtype, device=dev)
        units = s_parts * -(-t // GEMV_TB) * n_cols
    kernels.launch(MOE_CU.function(f"moe_route_gemv<{ct}>", dev), (1 + units,), (ROUTER_THREADS,),
                   (kernels.ptr(weights), kernels.ptr(ids), kernels.ptr(logits), np.int32(t), np.int32(e), np.int32(k),
                    *_router_args(cfg), kernels.ptr(work[0]), kernels.ptr(work[1]), kernels.ptr(work[2]),
                    none if h_sh is None else kernels.ptr(h_sh), kernels.ptr(x),
                    none if h_sh is None else kernels.ptr(shared_w[0]), np.int32(h), np.int32(i), np.int32(s_parts),
                    np.int32(GEMV_COLS_PER_WARP), np.int32(n_cols)),
                   shared_mem=(t * k + 3 * e) * 4)
    return _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, work, shared_w=shared_w, h_sh=h_sh)


class Experts(nn.Module):
    """The routed experts' weights, stacked: ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
    ``down_proj [E, H, I]`` (transformers 5 stores them the same way)."""

    def __init__(self, n: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = empty_param(n, 2 * intermediate, hidden)
        self.down_proj = empty_param(n, hidden, intermediate)


class Router(nn.Module):
    """The gate ``weight [E, H]``, kept in fp32 whatever the model dtype (routing is precision-sensitive)."""

    def __init__(self, n: int, hidden: int):
        super().__init__()
        self.weight = empty_param(n, hidden, dtype=torch.float32)


class MoE(nn.Module):
    """A DeepSeekMoE layer: routed experts (top-k of E) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``: router, routed experts, shared experts (kernels for CUDA tensors)."""
        sh = self.shared_experts
        shared_w = None if sh is None else (sh.gate_up_proj.weight, sh.down_proj.weight)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if _few_applies(x, self.cfg, self.gate.weight, gate_up, down, shared_w):
            return moe_few(x, self.gate.weight, self.cfg, gate_up, down, shared_w)
        logits = F.linear(upcast(x), self.gate.weight)
        if _decode_applies(x, self.cfg, shared_w) and logits.dtype == torch.float32:
            return moe_decode(x, logits, self.cfg, gate_up, down, shared_w)
        shared, shared_ready = None, None
        if sh is not None:
            # Tens of tokens: the shared experts do not depend on the routing, so they run on the side
            # stream while the router and the routed experts run on this one; the combine waits for them.
            side = kernels.use_kernels(x) and x.shape[0] <= SHARED_STREAM_MAX_TOKENS
            with streams.fork(x.device, side) as shared_ready:
                shared = sh(x)
        weights, ids = topk_softmax(logits, self.cfg)
        return moe_experts(x, weights, ids, gate_up, down, shared, shared_ready)
