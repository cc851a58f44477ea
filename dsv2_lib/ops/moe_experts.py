"""DeepSeekMoE's routed experts (chapter 08): ``Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])``.

``routed_experts`` is the PyTorch reference (sort the choices by expert, one matmul pair per expert).
``moe_experts`` dispatches to the CUDA kernels of ``kernels_cu/moe.cu`` for CUDA tensors, in one of
four regimes that :func:`choose_path` picks from the token count T and the thresholds of a
:class:`MoETuning` record:

* ``"gemv"``, a few tokens (every fp32 input): GEMV kernels that stream the selected experts' weights
  over the whole GPU, the down launch also doing the combine;
* ``"skinny"``, tens of tokens (16-bit, H and I multiples of 64): the skinny grouped GEMM, each selected
  expert's weights read once per tile of 16 of its tokens, the tokens as the mma's narrow side;
* ``"grouped_mm"``, beyond (bf16): ``torch._grouped_mm`` (CUTLASS kernels) on the aligned rows;
* ``"mma"``, otherwise (fp16 beyond the skinny range): our grouped tensor-core GEMM (``mma.sync``, 64-row tiles);

then the combine: the weighted sum back to token order, in a fixed order (deterministic), plus the
shared experts' output. ``moe_few`` is the whole layer of a few tokens in three launches.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from dsv2_lib.core import kernels, streams
from dsv2_lib.core.config import ModelConfig
from dsv2_lib.core.dtypes import upcast
from dsv2_lib.core.kernels import CUDA_TYPE
from dsv2_lib.ops.activation import silu_and_mul
from dsv2_lib.ops.moe_routing import (
    DOWN_COLS,
    GATE_UP_COLS,
    GEMM_BN,
    GEMM_WARPS,
    GEMV_THREADS,
    MAX_EXPERTS,
    MOE_CU,
    SKINNY_ROWS,
    SKINNY_ROWS_COMPILED,
    SKINNY_WARPS,
    TILE_M,
    moe_align,
    moe_align_reference,
    route_few,
    router_fits,
)

GROUPED_MM_ALIGN = 8         # rows per expert segment are padded to this for torch._grouped_mm
COMBINE_THREADS = 64         # threads per block of moe_combine (16 bytes of columns each)


@dataclasses.dataclass(frozen=True)
class MoETuning:
    """The token counts at which the MoE layer changes kernels, set by ``benchmarks/bench_moe.py`` on the
    H200 (it times every path forced at 1 ... 4096 tokens and prints the ``MoETuning`` it recommends).

    * ``gemv_max_tokens``: up to this many tokens, the GEMV kernels (and the layer as ``moe_few``);
    * ``skinny_max_tokens``: beyond the GEMV, up to this many (16-bit), the skinny grouped GEMM;
    * ``grouped_mm_min_tokens``: beyond those, bf16 takes ``torch._grouped_mm`` from this many tokens
      (1: always; it beat our mma kernel at every size, which stays the fp16 path);
    * ``fp32_gemv_max_tokens``: fp32 has no tensor-core path here: the GEMV kernels up to this, the reference beyond;
    * ``shared_stream_max_tokens``: beyond the GEMV path, up to this many tokens the shared experts run
      on a side stream (``core/streams.py``) beside the router and the routed experts;
    * ``router_few_max_tokens``: beyond the GEMV path, up to this many tokens the router is one launch,
      ``moe_route_few`` alone (``moe_routing.router_few``); beyond it, the fp32 GEMM and ``topk_softmax``.
    """

    gemv_max_tokens: int = 4
    skinny_max_tokens: int = 128
    grouped_mm_min_tokens: int = 1
    fp32_gemv_max_tokens: int = 64
    shared_stream_max_tokens: int = 16
    router_few_max_tokens: int = 64


def choose_path(t: int, dtype: torch.dtype, e: int, h: int, i: int, tuning: MoETuning = MoETuning(),
                grouped_mm: bool = hasattr(torch, "_grouped_mm")) -> str:
    """Which kernels run ``t`` tokens of ``dtype`` through ``e`` experts of hidden size ``h`` and width ``i``
    (kernels on, tensors 16-byte aligned): ``"reference"`` (a dtype or shape the kernels do not take, or
    fp32 beyond ``fp32_gemv_max_tokens``), ``"gemv"``, ``"skinny"``, ``"grouped_mm"`` (where ``grouped_mm``,
    torch has it) or ``"mma"``. Pure: the thresholds come from ``tuning``, so tests and the benchmark
    force a path by passing another record."""
    if dtype not in CUDA_TYPE or e > MAX_EXPERTS or h % 8 or i % 8 \
            or (dtype == torch.float32 and t > tuning.fp32_gemv_max_tokens):
        return "reference"
    if dtype == torch.float32 or t <= tuning.gemv_max_tokens:
        return "gemv"
    if t <= tuning.skinny_max_tokens and h % 64 == 0 and i % 64 == 0:
        return "skinny"
    if t >= tuning.grouped_mm_min_tokens and dtype == torch.bfloat16 and grouped_mm:
        return "grouped_mm"
    return "mma"


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


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, shared: torch.Tensor | None = None,
                shared_ready: torch.cuda.Event | None = None, tuning: MoETuning = MoETuning()) -> torch.Tensor:
    """``routed_experts(x, weights, ids, ...)`` (+ ``shared [T, H]``, the shared experts' output, added in
    x's dtype): the kernels for CUDA tensors (the path :func:`choose_path` picks with ``tuning``), else the
    reference. ``shared_ready``: an event recorded after ``shared`` was written on another stream; the
    first kernel that reads ``shared`` waits for it, so the routed experts run meanwhile.

    ``x [T, H]``, ``weights [T, k]`` fp32, ``ids [T, k]`` int64, ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, all contiguous. The kernel path needs H and I multiples of 8, 16-byte
    aligned tensors and E <= 256 (else the reference); fp32 takes the GEMV kernels up to
    ``tuning.fp32_gemv_max_tokens`` tokens and the reference (cuBLAS per expert) beyond: the tensor-core
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
    path = choose_path(t, x.dtype, e, h, i, tuning)
    if path == "reference" or not kernels.aligned16(x, gate_up_proj, down_proj) \
            or (shared is not None and not kernels.aligned16(shared)):
        return reference()
    if t == 0:
        return x.new_zeros(0, h) if shared is None else ready(shared).clone()
    if path == "gemv":
        return gemv_down_combine(gemv_gate_up(x, gate_up_proj, ids), down_proj, ids, weights, ready(shared))
    experts = {"skinny": skinny_experts, "grouped_mm": _grouped_mm_experts, "mma": _mma_experts}[path]
    y, slot_of = experts(x, ids, gate_up_proj, down_proj)
    return combine(y, weights, slot_of, ready(shared))


def gemv_gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``h [T·k, I]`` (``moe_gemv_gate_up``, inputs already checked): choice ``c = t·k + j`` gets
    ``silu(x[t] W_g^T) * (x[t] W_u^T)`` of expert ``ids[t, j]``, zeros for an id outside ``[0, E)``.
    ``out``: a buffer of at least T·k rows to write them into (:func:`moe_few`'s, whose later rows hold
    the shared experts' parts)."""
    (e, i2, h), (t, k) = gate_up_proj.shape, ids.shape
    hid = torch.empty(t * k, i2 // 2, dtype=x.dtype, device=x.device) if out is None else out
    MOE_CU.launch(f"moe_gemv_gate_up<{CUDA_TYPE[x.dtype]}>", x.device,
                  (t * k, -(-(i2 // 2) // (GEMV_THREADS // 32 * GATE_UP_COLS))), (GEMV_THREADS,),
                  h=kernels.ptr(hid), x=kernels.ptr(x), w_all=kernels.ptr(gate_up_proj), ids=kernels.ptr(ids),
                  topk=np.int32(k), E=np.int32(e), H=np.int32(h), I=np.int32(i2 // 2))
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
    MOE_CU.launch(f"moe_gemv_down_combine<{CUDA_TYPE[hid.dtype]}>", hid.device, (t, -(-h // DOWN_COLS)),
                  (GEMV_THREADS,), shared_mem=(k + parts) * DOWN_COLS * 4,
                  out=kernels.ptr(out), h=kernels.ptr(hid), w_all=kernels.ptr(down_proj), ids=kernels.ptr(ids),
                  weights=kernels.ptr(weights), shared=_ptr_or_null(shared), sh_down=_ptr_or_null(shared_down),
                  topk=np.int32(k), E=np.int32(e), H=np.int32(h), I=np.int32(i), P=np.int32(parts))
    return out


def _ptr_or_null(t: torch.Tensor | None):
    return np.uint64(0) if t is None else kernels.ptr(t)


def _tile_experts(x, ids, gate_up_proj, down_proj, kernel: str, rows: int, cols: tuple[int, int], warps: int,
                  template_tail: str = ""):
    """The two launches of a tiled kernel over ``moe_align``'s tiles of ``rows`` sorted rows, one expert
    each: gate|up then down, grid (tiles, slabs of ``cols`` = (gate|up, down) output columns), ``warps``
    warps a block, ``kernel<T, GATE_UP{template_tail}>``: (y [tiles·rows, H] in sorted order, slot_of)."""
    k, (e, i2, h) = ids.shape[1], gate_up_proj.shape
    i, ct = i2 // 2, CUDA_TYPE[x.dtype]
    sorted_rows, slot_of, tile_expert, _ = moe_align(ids, e, rows)
    tiles = tile_expert.numel()
    hid = torch.empty(tiles * rows, i, dtype=x.dtype, device=x.device)
    y = torch.empty(tiles * rows, h, dtype=x.dtype, device=x.device)
    for name, out, a, w, n_out, kdim, n_cols in (("true", hid, x, gate_up_proj, i, h, cols[0]),
                                                 ("false", y, hid, down_proj, h, i, cols[1])):
        MOE_CU.launch(f"{kernel}<{ct}, {name}{template_tail}>", x.device, (tiles, -(-n_out // n_cols)), (32 * warps,),
                      out=kernels.ptr(out), a_src=kernels.ptr(a), w_all=kernels.ptr(w),
                      sorted_rows=kernels.ptr(sorted_rows), tile_expert=kernels.ptr(tile_expert), n_out=np.int32(n_out),
                      K=np.int32(kdim), topk=np.int32(k))
    return y, slot_of


def _mma_experts(x, ids, gate_up_proj, down_proj):
    """Our grouped tensor-core GEMMs over the TILE_M-padded sorted rows: (y [cap, H], slot_of). A block's GEMM_BN
    weight rows are GEMM_BN / 2 gate|up column pairs, or GEMM_BN down columns."""
    return _tile_experts(x, ids, gate_up_proj, down_proj, "moe_gemm", TILE_M, (GEMM_BN // 2, GEMM_BN), GEMM_WARPS)


def skinny_experts(x, ids, gate_up_proj, down_proj, rows: int = SKINNY_ROWS):
    """Our skinny grouped GEMMs (``moe_skinny``, bf16/fp16, H and I multiples of 64) on tiles of ``rows``
    sorted rows (one of SKINNY_ROWS_COMPILED), one expert per tile: (y [tiles·rows, H] in sorted order, slot_of)."""
    if rows not in SKINNY_ROWS_COMPILED:
        raise ValueError(f"skinny_experts: rows must be one of {SKINNY_ROWS_COMPILED}, got {rows!r}")
    cols = 16 * SKINNY_WARPS
    return _tile_experts(x, ids, gate_up_proj, down_proj, "moe_skinny", rows, (cols, cols), SKINNY_WARPS, f", {rows}")


def _grouped_mm_experts(x, ids, gate_up_proj, down_proj):
    """PyTorch's grouped GEMM (``torch._grouped_mm``, bf16; CUTLASS kernels) on rows aligned to GROUPED_MM_ALIGN:
    (y, slot_of). Padding rows read token 0 (finite, never combined); rows past ``offsets[E]`` are never read."""
    k = ids.shape[1]
    sorted_rows, slot_of, _, offsets = moe_align(ids, gate_up_proj.shape[0], GROUPED_MM_ALIGN)
    a = x[sorted_rows.clamp(min=0) // k]  # [cap, H]: the tokens in expert order
    ends = offsets[1:]
    hid = silu_and_mul(torch._grouped_mm(a, gate_up_proj.transpose(1, 2), offs=ends))
    return torch._grouped_mm(hid, down_proj.transpose(1, 2), offs=ends), slot_of


def combine(y: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor | None, shared: torch.Tensor | None,
            ids: torch.Tensor | None = None, n_experts: int = 0) -> torch.Tensor:
    """``moe_combine``: out [T, H] = round(Σ_j weights[t, j] · y[slot_of[t·k + j]]) (+ shared); blocks of
    COMBINE_THREADS threads x 16 bytes of columns, one row of blocks per token. ``slot_of`` None: y in
    choice order; ``ids`` given: choices with ids outside [0, E) are skipped."""
    t, k = weights.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    cols = COMBINE_THREADS * 16 // y.element_size()
    MOE_CU.launch(f"moe_combine<{CUDA_TYPE[y.dtype]}>", y.device, (t, -(-h // cols)), (COMBINE_THREADS,),
                  out=kernels.ptr(out), y=kernels.ptr(y), weights=kernels.ptr(weights), slot_of=_ptr_or_null(slot_of),
                  shared=_ptr_or_null(shared), topk=np.int32(k), H=np.int32(h), ids=_ptr_or_null(ids),
                  E=np.int32(n_experts))
    return out


def few_tokens(x: torch.Tensor, cfg: ModelConfig, tuning: MoETuning = MoETuning()) -> bool:
    """Kernels on for ``x [T, H]`` (contiguous, 16-byte aligned), T > 0 tokens on :func:`choose_path`'s
    GEMV path, and a routing the one-warp router kernels take: the few-token layer's precondition."""
    if not kernels.use_kernels(x) or x.dim() != 2 or x.shape[0] == 0:
        return False
    path = choose_path(x.shape[0], x.dtype, cfg.n_routed_experts, x.shape[1], cfg.moe_intermediate_size, tuning)
    return path == "gemv" and router_fits(cfg) and x.is_contiguous() and kernels.aligned16(x)


def few_applies(x: torch.Tensor, cfg: ModelConfig, gate_w: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, shared_w: tuple[torch.Tensor, torch.Tensor] | None,
                tuning: MoETuning = MoETuning()) -> bool:
    """Whether ``MoE.forward`` hands ``x`` to :func:`moe_few`: :func:`few_tokens`, an fp32 router weight
    ``[E, H]``, and routed and shared weights the GEMV kernels take (x's dtype, contiguous, 16-byte
    aligned, the shared MLP's intermediate a whole number of expert widths, or no shared experts)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    weights = [gate_up_proj, down_proj, *(shared_w or ())]
    ok = few_tokens(x, cfg, tuning) \
        and gate_w.dtype == torch.float32 and gate_w.shape == (cfg.n_routed_experts, h) and gate_w.is_contiguous() \
        and all(w.dtype == x.dtype and w.is_contiguous() for w in weights) and kernels.aligned16(gate_w, *weights)
    if ok and shared_w is not None:
        (n2, hg), (hd, n) = shared_w[0].shape, shared_w[1].shape
        ok = hg == hd == h and n2 == 2 * n and n % i == 0 and n > 0
    return ok


def moe_few(x: torch.Tensor, gate_w: torch.Tensor, cfg: ModelConfig, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor, shared_w: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE layer of a few tokens (:func:`few_applies`) in three launches: ``route_few`` (the router,
    and the shared experts' gate|up beside it), ``moe_gemv_gate_up`` for the routed choices and
    ``moe_gemv_down_combine`` for all of them, with the combine. ``shared_w`` = (gate_up ``[2·P·I, H]``,
    down ``[H, P·I]``), the shared MLP's weights: its P parts are choices of weight 1, their down
    products summed in fp32 and rounded once, as the MLP's. ``x [T, H] -> [T, H]``."""
    weights, ids, _, hid = route_few(x, gate_w, cfg, None if shared_w is None else shared_w[0])
    gemv_gate_up(x, gate_up_proj, ids, out=hid)
    return gemv_down_combine(hid, down_proj, ids, weights, None, None if shared_w is None else shared_w[1])
