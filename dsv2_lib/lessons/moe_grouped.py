"""The grouped expert GEMV (chapter 08's lesson; the engine does not use it).

The engine's GEMV regime (``ops/moe_experts.py``) runs one block row per (token, choice), so an expert
chosen by several tokens is read once per choice. The grouped GEMV groups the choices by expert into
work items of up to ``GEMV_TB`` tokens, so every selected expert's weights are read once, with the
shared experts as more work items of the same launches (``kernels_cu/lessons/moe_grouped.cu``), and
the whole layer for a few tokens as :func:`moe_decode` (router GEMM, one router+items kernel, gate|up
GEMV, down GEMV, combine). On the H200 it is slower than the per-choice GEMV at every size it takes;
chapter 08 explains why, and ``benchmarks/bench_moe.py`` times both.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv2_lib.core import kernels
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops.moe_experts import MoETuning, combine, few_tokens
from dsv2_lib.ops.moe_routing import ALIGN_THREADS, HEADER_DEFINES, MAX_EXPERTS, router_args

GEMV_TB = 8                  # choices per work item
MAX_WARPS = 8                # the kernels' __launch_bounds__: at most 8 warps a block
WARPS = 4                    # warps per block of the grouped GEMV kernels (1 .. MAX_WARPS)
COLS_PER_WARP = 1            # output columns per warp (grid y = cols / (warps * this))
ROUTER_THREADS = 32 * MAX_WARPS  # block of moe_route_gemv (block 0 routes, a warp per token; the rest: shared gate|up)
_UNBOUNDED = MoETuning(gemv_max_tokens=1 << 30, fp32_gemv_max_tokens=1 << 30)  # T is bounded by _items_fit alone

MOE_GROUPED_CU = kernels.declare(
    "lessons/moe_grouped.cu",
    [f"moe_gemv_grouped<{t}, {g}>" for t in CUDA_TYPE.values() for g in ("true", "false")] + ["moe_gemv_items"]
    + [f"moe_route_gemv<{t}>" for t in CUDA_TYPE.values()],
    {**HEADER_DEFINES, "DSV2_GROUPED_TB": GEMV_TB, "DSV2_GROUPED_MAX_WARPS": MAX_WARPS},
)


def gemv_items_reference(ids: torch.Tensor, n_experts: int, tb: int = GEMV_TB):
    """The work items of the grouped GEMV (``build_items`` in moe_grouped.cu) for ``ids [T, k]``.

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
    MOE_GROUPED_CU.launch("moe_gemv_items", ids.device, (1,), (ALIGN_THREADS,), shared_mem=(n + 3 * n_experts) * 4,
                          sorted=kernels.ptr(work[0]), items=kernels.ptr(work[1]), n_items=kernels.ptr(work[2]),
                          ids=kernels.ptr(ids), n=np.int32(n), E=np.int32(n_experts))
    return work


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, shared: torch.Tensor | None = None, warps: int = WARPS,
                    cols_per_warp: int = COLS_PER_WARP) -> torch.Tensor:
    """``moe_experts``' GEMV regime with the grouped GEMV: :func:`moe_gemv_items`, the two grouped launches,
    then ``moe_combine``. Inputs as ``moe_experts`` takes them (CUDA tensors of one 16-bit or fp32 dtype,
    contiguous, 16-byte aligned, H and I multiples of 8, E <= 256), and T·k + 3E ints that fit 48 KiB."""
    (t, k), (e, i2, h) = ids.shape, gate_up_proj.shape
    kernels.check(x, "grouped_experts x", shape=(t, h))
    kernels.check(gate_up_proj, "grouped_experts gate_up_proj", dtype=x.dtype, shape=(e, i2, h), device=x.device)
    kernels.check(down_proj, "grouped_experts down_proj", dtype=x.dtype, shape=(e, h, i2 // 2), device=x.device)
    kernels.check(ids, "grouped_experts ids", dtype=torch.int64, shape=(t, k), device=x.device)
    kernels.check(weights, "grouped_experts weights", dtype=torch.float32, shape=(t, k), device=x.device)
    if shared is not None:
        kernels.check(shared, "grouped_experts shared", dtype=x.dtype, shape=(t, h), device=x.device)
    if x.dtype not in CUDA_TYPE or not 0 < k <= e <= MAX_EXPERTS or i2 % 16 or h % 8 or t == 0 \
            or not _items_fit(t * k, e) or not kernels.aligned16(x, gate_up_proj, down_proj, *(() if shared is None else (shared,))):
        raise ValueError("grouped_experts: needs 0 < k <= E <= 256, H and I multiples of 8, T > 0, 16-byte aligned "
                         "tensors and (T*k + 3E) * 4 <= 48 KiB")
    return _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, moe_gemv_items(ids, e), shared=shared,
                         warps=warps, cols_per_warp=cols_per_warp)


def _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, work, shared=None, shared_w=None, h_sh=None,
                  warps: int = WARPS, cols_per_warp: int = COLS_PER_WARP):
    """Routed experts (+ shared) for a few tokens with the grouped GEMV kernels, then the combine.

    ``work``: the items (:func:`moe_gemv_items` or the router kernel). ``shared [T, H]``: a finished
    shared-experts output to add; or ``shared_w = (gate_up [2·S·I, H], down [H, S·I])``: the shared MLP
    computed here as S·(token chunks) more slots of the same launches (``h_sh``: its gate|up output,
    when the router kernel already computed it)."""
    (t, k), (e, i2, h) = ids.shape, gate_up_proj.shape
    i, ct, dev = i2 // 2, CUDA_TYPE[x.dtype], x.device
    sorted_rows, items, n_items, max_items = work
    nw, cpw = warps, cols_per_warp
    if not 1 <= nw <= MAX_WARPS or cpw < 1:
        raise ValueError(f"grouped GEMV: warps must be in 1..{MAX_WARPS} and cols_per_warp >= 1, got {nw}, {cpw}")
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
    common = dict(sorted=kernels.ptr(sorted_rows), items=kernels.ptr(items), n_items=kernels.ptr(n_items),
                  max_items=np.int32(max_items), T_=np.int32(t), k=np.int32(k), H=np.int32(h), I=np.int32(i),
                  S=np.int32(s_parts), cpw=np.int32(cpw))
    hsp = none if h_sh is None else kernels.ptr(h_sh)
    MOE_GROUPED_CU.launch(f"moe_gemv_grouped<{ct}, true>", dev,
                          (max_items + gate_up_shared_slots, -(-i // (nw * cpw))), (32 * nw,),
                          out=kernels.ptr(hid), out_sh=hsp, a=kernels.ptr(x), a_sh=kernels.ptr(x),
                          w=kernels.ptr(gate_up_proj), w_sh=gu_sh, **common)
    MOE_GROUPED_CU.launch(f"moe_gemv_grouped<{ct}, false>", dev,
                          (max_items + (n_chunks if shared_w is not None else 0), -(-h // (nw * cpw))), (32 * nw,),
                          out=kernels.ptr(y), out_sh=none if y_sh is None else kernels.ptr(y_sh), a=kernels.ptr(hid),
                          a_sh=hsp, w=kernels.ptr(down_proj), w_sh=dn_sh, **common)
    return combine(y, weights, None, y_sh if shared_w is not None else shared, ids, e)


def _decode_applies(x: torch.Tensor, cfg: ModelConfig, shared_w=None) -> bool:
    """Whether :func:`moe_decode` takes ``x``: the few-token layer's precondition (``few_tokens``, with no
    token limit but the work items': they must fit the router kernel's shared memory), and shared
    experts' weights it takes."""
    if not few_tokens(x, cfg, _UNBOUNDED):
        return False
    h, i = x.shape[1], cfg.moe_intermediate_size
    ok = _items_fit(x.shape[0] * cfg.num_experts_per_tok, cfg.n_routed_experts)
    if shared_w is not None:
        gu, dn = shared_w
        ok = ok and gu.shape[0] % (2 * i) == 0 and gu.shape[1] == h and dn.shape == (h, gu.shape[0] // 2) \
            and gu.dtype == dn.dtype == x.dtype and gu.is_contiguous() and dn.is_contiguous() and kernels.aligned16(gu, dn)
    return ok


def moe_decode(x: torch.Tensor, logits: torch.Tensor, cfg: ModelConfig, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor, shared_w=None, shared_in_router: bool = False, warps: int = WARPS,
               cols_per_warp: int = COLS_PER_WARP) -> torch.Tensor:
    """The MoE layer for a few tokens (``_decode_applies``) in four launches after the router GEMM:

    1. ``moe_route_gemv``: block 0 routes every token (``topk_softmax``'s rule) and builds the work
       items; the other blocks compute the shared experts' gate|up meanwhile (``shared_in_router``);
    2. ``moe_gemv_grouped`` gate|up over the items (each selected expert read once);
    3. ``moe_gemv_grouped`` down over the items and the shared experts' down;
    4. ``moe_combine``: the weighted sum in pick order + the shared output.

    ``logits [T, E]`` fp32; ``shared_w = (gate_up [2·S·I, H], down [H, S·I])`` of the shared MLP or None.
    Same result as ``topk_softmax`` + ``moe_experts(..., shared=MLP(x))``, up to the fp32 summation order."""
    t, h = x.shape
    e, k, i = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    if not _decode_applies(x, cfg, shared_w):
        raise ValueError("moe_decode: x, the routing or the shared experts' weights are not what the kernels take")
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
    n_cols = -(-i // ((ROUTER_THREADS // 32) * cols_per_warp))
    if shared_w is not None and shared_in_router:
        s_parts = shared_w[0].shape[0] // (2 * i)
        h_sh = torch.empty(t, s_parts * i, dtype=x.dtype, device=dev)
        units = s_parts * -(-t // GEMV_TB) * n_cols
    MOE_GROUPED_CU.launch(f"moe_route_gemv<{ct}>", dev, (1 + units,), (ROUTER_THREADS,), shared_mem=(t * k + 3 * e) * 4,
                          weights=kernels.ptr(weights), ids=kernels.ptr(ids), logits=kernels.ptr(logits),
                          T_=np.int32(t), E=np.int32(e), k=np.int32(k), **router_args(cfg),
                          sorted=kernels.ptr(work[0]), items=kernels.ptr(work[1]), n_items=kernels.ptr(work[2]),
                          h_sh=none if h_sh is None else kernels.ptr(h_sh), x=kernels.ptr(x),
                          w_sh=none if h_sh is None else kernels.ptr(shared_w[0]), H=np.int32(h), I=np.int32(i),
                          S=np.int32(s_parts), cpw=np.int32(cols_per_warp), n_chunks=np.int32(n_cols))
    return _gemv_grouped(x, weights, ids, gate_up_proj, down_proj, work, shared_w=shared_w, h_sh=h_sh,
                         warps=warps, cols_per_warp=cols_per_warp)
