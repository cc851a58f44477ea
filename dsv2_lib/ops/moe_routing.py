"""DeepSeekMoE's router and the alignment of its choices by expert (chapter 08).

``route`` and ``moe_align_reference`` are the PyTorch reference (the semantic definition);
``topk_softmax``, ``moe_align`` and ``route_few`` dispatch to the CUDA kernels of ``kernels_cu/moe.cu``
for CUDA tensors:

* router: one warp per token (softmax, greedy or group-limited top-k, renormalise or scale);
* alignment: the T·k choices sorted by expert, each expert's segment padded to a tile, no host sync;
* ``route_few``: the router of a few tokens in one launch, its logits included, with the shared
  experts' gate|up beside it (the first launch of ``moe_experts.moe_few``).
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE

ROUTER_PER_LANE = 8          # experts per lane of the one-warp router (moe_common.cuh)
MAX_EXPERTS = 32 * ROUTER_PER_LANE  # 256; also bounds moe_align's shared memory
MAX_TOPK = 32                # one lane per pick in the router
ROUTER_WARPS = 4             # warps (tokens) per block of topk_softmax
ALIGN_THREADS = 1024         # moe_align's blocks: 32 warps
ALIGN_CHOICES = 2048         # choices per block of moe_align (two rounds of 32 per warp)
# The block geometry of moe.cu's kernels (moe_experts.py launches most of them).
GEMV_WARPS = 4               # warps per block of the per-choice GEMV kernels and moe_route_few
GEMV_THREADS = 32 * GEMV_WARPS
GATE_UP_COLS = 2             # output columns per warp of the per-choice gate|up GEMV
DOWN_COLS = 4                # output columns per block of the down GEMV + combine (all of a token's choices)
TILE_M, GEMM_BN, GEMM_WARPS = 64, 128, 4  # grouped GEMM: rows per tile, weight rows per block, warps (BM, BN)
SKINNY_ROWS = 16             # sorted rows (tokens) per tile of the skinny GEMM: two mma groups of 8
SKINNY_ROWS_COMPILED = (8, 16, 32)  # the tile heights compiled, so that benchmarks/bench_moe.py can weigh them
SKINNY_WARPS = 4             # warps per block of the skinny GEMM, 16 output columns each
# The constants of kernels_cu/moe_common.cuh, for every kernel file that includes it.
HEADER_DEFINES = {"DSV2_MOE_ROUTER_PER_LANE": ROUTER_PER_LANE}

MOE_CU = kernels.declare(
    "moe.cu",
    ["topk_softmax", "moe_align_count", "moe_align"]
    + [f"moe_gemm<{t}, {g}>" for t in ("__nv_bfloat16", "__half") for g in ("true", "false")]
    + [f"{k}<{t}>" for k in ("moe_route_few", "moe_gemv_gate_up", "moe_gemv_down_combine", "moe_combine")
       for t in CUDA_TYPE.values()]
    + [f"moe_skinny<{t}, {g}, {r}>" for t in ("__nv_bfloat16", "__half") for g in ("true", "false")
       for r in SKINNY_ROWS_COMPILED],
    {**HEADER_DEFINES, "DSV2_MOE_GEMV_WARPS": GEMV_WARPS, "DSV2_MOE_GATE_UP_COLS": GATE_UP_COLS,
     "DSV2_MOE_DOWN_COLS": DOWN_COLS, "DSV2_MOE_GEMM_BM": TILE_M, "DSV2_MOE_GEMM_BN": GEMM_BN,
     "DSV2_MOE_GEMM_WARPS": GEMM_WARPS, "DSV2_MOE_SKINNY_WARPS": SKINNY_WARPS},
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


def router_fits(cfg: ModelConfig) -> bool:
    """Whether the one-warp router kernels take ``cfg``'s routing: E <= ``MAX_EXPERTS``, 0 < k <=
    min(E, ``MAX_TOPK``), and greedy, or groups of one lane each (at most 32), E a multiple of them and
    enough experts in the kept groups for k picks."""
    e, k, g, tg = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    if not (e <= MAX_EXPERTS and 0 < k <= min(e, MAX_TOPK)):
        return False
    return cfg.topk_method != "group_limited_greedy" or (0 < g <= 32 and e % g == 0 and 0 < tg <= g and k <= tg * (e // g))


def router_args(cfg: ModelConfig) -> dict:
    """The router kernels' ``n_group, topk_group, renorm, scale`` by name (groups 0, 0: greedy)."""
    k = cfg.num_experts_per_tok
    groups = (cfg.n_group, cfg.topk_group) if cfg.topk_method == "group_limited_greedy" else (0, 0)
    return dict(n_group=np.int32(groups[0]), topk_group=np.int32(groups[1]),
                renorm=np.int32(k > 1 and cfg.norm_topk_prob), scale=np.float32(cfg.routed_scaling_factor))


def topk_softmax(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The router (:func:`route`'s semantics): the ``topk_softmax`` kernel for fp32 CUDA logits ``[T, E]``.

    Returns (weights ``[T, k]`` fp32, ids ``[T, k]`` int64); other dtypes and CPU tensors take ``route``.
    """
    if not kernels.use_kernels(logits) or logits.dtype != torch.float32:
        return route(logits, cfg)
    kernels.check(logits, "topk_softmax logits", dtype=torch.float32, shape=(None, cfg.n_routed_experts))
    (t, e), k = logits.shape, cfg.num_experts_per_tok
    if not 0 < k <= min(e, MAX_TOPK) or e > MAX_EXPERTS:
        raise ValueError(f"topk_softmax: needs 0 < k <= min(E, {MAX_TOPK}) and E <= {MAX_EXPERTS}, got k={k}, E={e}")
    if not router_fits(cfg):
        raise ValueError(f"topk_softmax: bad groups n_group={cfg.n_group}, topk_group={cfg.topk_group} for E={e}, k={k}")
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        MOE_CU.launch("topk_softmax", logits.device, (-(-t // ROUTER_WARPS),), (32 * ROUTER_WARPS,),
                      weights=kernels.ptr(weights), ids=kernels.ptr(ids), logits=kernels.ptr(logits), T=np.int32(t),
                      E=np.int32(e), k=np.int32(k), **router_args(cfg))
    return weights, ids


def moe_align(ids: torch.Tensor, n_experts: int, block: int):
    """:func:`moe_align_reference` on the GPU: ``ceil(n / ALIGN_CHOICES)`` blocks for the ``n`` choices,
    each counting and placing its own range (with more than one block, ``moe_align_count`` counts
    first and each block sums the counts before its range), outputs of the worst-case size, no host
    synchronisation. Ids outside ``[0, E)`` are dropped (slot ``-1``) instead of refused: checking
    them would need a sync."""
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
    blocks, warps = max(1, -(-n // ALIGN_CHOICES)), ALIGN_THREADS // 32
    counts = None
    if blocks > 1:
        counts = torch.empty(blocks, n_experts, dtype=torch.int32, device=dev)
        MOE_CU.launch("moe_align_count", dev, (blocks,), (ALIGN_THREADS,), shared_mem=warps * n_experts * 4,
                      counts=kernels.ptr(counts), ids=kernels.ptr(ids), n=np.int32(n), E=np.int32(n_experts))
    MOE_CU.launch("moe_align", dev, (blocks,), (ALIGN_THREADS,),
                  shared_mem=(warps * n_experts + 3 * n_experts + 1) * 4,  # cnt [warps][E], tot, before, seg [E + 1]
                  sorted_rows=kernels.ptr(sorted_rows), slot_of=kernels.ptr(slot_of),
                  tile_expert=kernels.ptr(tile_expert), offsets=kernels.ptr(offsets), ids=kernels.ptr(ids),
                  counts=np.uint64(0) if counts is None else kernels.ptr(counts),
                  n=np.int32(n), E=np.int32(n_experts), block=np.int32(block), max_tiles=np.int32(max_tiles),
                  cap=np.int32(max_tiles * block))
    return sorted_rows, slot_of, tile_expert, offsets


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


def route_few(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig, shared_gate_up: torch.Tensor | None = None):
    """``moe_route_few`` (inputs as ``moe_experts.few_applies`` takes them): the router of a few tokens in
    one launch, its fp32 logits ``x W_r^T`` (``gate_w [E, H]``) routed by ``topk_softmax``'s rule, and in
    the same launch the shared experts' gate|up, which does not wait for the routing. Returns (weights
    ``[T, k]`` fp32, ids ``[T, k]`` int64, logits ``[T, E]`` fp32, hid ``[T·(k + P), I]``) where the rows
    of hid from ``T·k`` on hold the shared experts' SwiGLU output: row ``T·k + t·P + p`` is part p of
    token t, the columns ``[p·I, (p+1)·I)`` of the shared MLP (``shared_gate_up [2·P·I, H]``, P = 0
    without it); the first ``T·k`` rows are for ``moe_experts.gemv_gate_up`` to fill."""
    t, k, i = x.shape[0], cfg.num_experts_per_tok, cfg.moe_intermediate_size
    parts = 0 if shared_gate_up is None else shared_gate_up.shape[0] // (2 * i)
    hid = torch.empty(t * (k + parts), i, dtype=x.dtype, device=x.device)
    return (*_launch_route_few(x, gate_w, cfg, shared_gate_up, parts, hid), hid)


def router_few(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The router alone for tens of tokens (``router_few_applies`` inputs): ``moe_route_few`` without the
    shared experts, one launch in place of the fp32 copy of ``x``, the fp32 GEMM and ``topk_softmax``.
    Returns (weights ``[T, k]`` fp32, ids ``[T, k]`` int64), ``topk_softmax``'s picks on its logits."""
    weights, ids, _ = _launch_route_few(x, gate_w, cfg, None, 0, None)
    return weights, ids


def router_few_applies(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig) -> bool:
    """:func:`router_few` can take ``x [T, H]``: kernels on, T > 0, ``x`` of a kernel dtype, contiguous and
    16-byte aligned with H a multiple of 8 (16-byte vectors of it and of the fp32 router rows), an fp32
    router ``gate_w [E, H]``, contiguous and aligned, and a routing the one-warp router takes."""
    if not kernels.use_kernels(x) or x.dim() != 2 or x.shape[0] == 0 or x.dtype not in CUDA_TYPE:
        return False
    h = x.shape[1]
    return (h % 8 == 0 and x.is_contiguous() and gate_w.dtype == torch.float32 and gate_w.is_contiguous()
            and gate_w.shape == (cfg.n_routed_experts, h) and gate_w.device == x.device
            and kernels.aligned16(x, gate_w) and router_fits(cfg))


def _launch_route_few(x, gate_w, cfg, shared_gate_up, parts: int, hid):
    """One ``moe_route_few`` launch: (weights, ids, logits); ``hid`` receives the shared experts' rows when
    ``parts`` > 0 (None without them: the kernel then has no shared blocks and never touches it)."""
    t, h = x.shape
    e, k, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    blocks = t * -(-e // (GEMV_THREADS // 32)) + t * parts * -(-i // (GEMV_THREADS // 32 * GATE_UP_COLS))
    MOE_CU.launch(f"moe_route_few<{CUDA_TYPE[x.dtype]}>", x.device, (blocks,), (GEMV_THREADS,),
                  weights=kernels.ptr(weights), ids=kernels.ptr(ids), logits=kernels.ptr(logits), x=kernels.ptr(x),
                  gate_w=kernels.ptr(gate_w), T_=np.int32(t), E=np.int32(e), H=np.int32(h), topk=np.int32(k),
                  **router_args(cfg), arrivals=kernels.ptr(_arrival_counters(t, x.device)),
                  h=np.uint64(0) if hid is None else kernels.ptr(hid),
                  sh_gate_up=np.uint64(0) if shared_gate_up is None else kernels.ptr(shared_gate_up), I=np.int32(i),
                  P=np.int32(parts))
    return weights, ids, logits
