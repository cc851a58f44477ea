"""Back-of-the-envelope arithmetic: parameters, KV cache, and the decode roofline.

Everything here is computed from a :class:`~dsv2_lib.core.config.ModelConfig` alone (no
weights), so chapter 00 can tour DeepSeek-V2-Lite on a laptop. Counts are numbers of
*values* (parameters); multiply by the bytes per value (2 for bf16) for bytes.

Notation: ``H`` hidden size, ``V`` vocabulary, ``L`` layers, ``E`` routed experts, ``k``
experts per token, ``I`` dense MLP width, ``I_moe`` expert width, ``n_h`` heads.

The decode model is the roofline (Williams, Waterman & Patterson, 2009): a step takes at
least ``max(bytes read / bandwidth, FLOPs / peak FLOP rate)``. At small batch, decode is
bound by bytes: every weight the step touches, and every cache row it attends over, is
read once.
"""
from __future__ import annotations

from dsv2_lib.core.config import ModelConfig

H200_BANDWIDTH = 4.2e12
"""Bytes/s: copy bandwidth measured on the course's H200 (datasheet: 4.8e12)."""
H200_BF16_FLOPS = 790e12
"""FLOP/s: dense bf16 matmul rate measured on the course's H200 (datasheet: ~989e12)."""

KV_SCHEMES = ("mha", "gqa", "mla", "mqa")


# ---- parameters ---------------------------------------------------------------


def _layer_kinds(cfg: ModelConfig) -> tuple[int, int]:
    """(number of dense-MLP layers, number of MoE layers)."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers - n_moe, n_moe


def attention_parameters_per_layer(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one MLA block, by weight (names as in the HF checkpoint).

    Shapes (out × in); V2-Lite has ``n_h = 16``, ``qk_head = 128 + 64 = 192``,
    ``v = 128``, ``kv_lora = 512``, ``rope = 64``:

    * ``q_proj``: ``n_h·qk_head × H``; or, when ``q_lora_rank`` is set,
      ``q_a_proj`` ``q_lora × H``, ``q_a_layernorm`` ``q_lora`` and
      ``q_b_proj`` ``n_h·qk_head × q_lora``;
    * ``kv_a_proj_with_mqa``: ``(kv_lora + rope) × H``, latent and shared RoPE key;
    * ``kv_a_layernorm``: ``kv_lora``;
    * ``kv_b_proj``: ``n_h·(nope + v) × kv_lora``, decompresses keys and values;
    * ``o_proj``: ``H × n_h·v``.
    """
    h, n_h, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    p: dict[str, int] = {}
    if cfg.q_lora_rank is None:
        p["q_proj"] = n_h * cfg.qk_head_dim * h
    else:
        p["q_a_proj"] = cfg.q_lora_rank * h + (cfg.q_lora_rank if bias else 0)
        p["q_a_layernorm"] = cfg.q_lora_rank
        p["q_b_proj"] = n_h * cfg.qk_head_dim * cfg.q_lora_rank
    p["kv_a_proj_with_mqa"] = cfg.cache_row_dim * h + (cfg.cache_row_dim if bias else 0)
    p["kv_a_layernorm"] = cfg.kv_lora_rank
    p["kv_b_proj"] = n_h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
    p["o_proj"] = h * n_h * cfg.v_head_dim + (h if bias else 0)
    return p


def expert_parameters(cfg: ModelConfig) -> int:
    """One routed expert, a SwiGLU MLP: gate, up ``I_moe × H``; down ``H × I_moe``."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of the whole model by component, plus ``"total"``.

    * ``embedding``: ``V × H``;
    * ``attention``: all layers, see :func:`attention_parameters_per_layer`;
    * ``dense_mlp``: ``3·H·I`` per dense layer;
    * ``router``: ``E × H`` per MoE layer;
    * ``routed_experts``: ``E·3·H·I_moe`` per MoE layer;
    * ``shared_experts``: ``3·H·(n_shared·I_moe)`` per MoE layer (one wide SwiGLU MLP);
    * ``norms``: two ``H`` RMSNorm weights per layer, plus the final one;
    * ``lm_head``: ``V × H``, or 0 when tied to the embedding (the same tensor).
    """
    h = cfg.hidden_size
    n_dense, n_moe = _layer_kinds(cfg)
    attention = sum(attention_parameters_per_layer(cfg).values())
    shared_width = cfg.n_shared_experts * cfg.moe_intermediate_size
    counts = {
        "embedding": cfg.vocab_size * h,
        "attention": cfg.num_hidden_layers * attention,
        "dense_mlp": n_dense * 3 * h * cfg.intermediate_size,
        "router": n_moe * cfg.n_routed_experts * h,
        "routed_experts": n_moe * cfg.n_routed_experts * expert_parameters(cfg),
        "shared_experts": n_moe * 3 * h * shared_width,
        "norms": cfg.num_hidden_layers * 2 * h + h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
    }
    counts["total"] = sum(counts.values())
    return counts


def active_parameters_per_token(cfg: ModelConfig) -> int:
    """Parameters one token is multiplied with in a forward pass.

    Everything except the routed experts it was not sent to (it uses ``k`` of ``E`` per
    MoE layer) and the embedding table, of which it reads one row: a gather, not a
    matmul. For V2-Lite 2.45 B, where the DeepSeek-V2 paper quotes "2.4 B activated".
    """
    c = parameter_counts(cfg)
    _, n_moe = _layer_kinds(cfg)
    idle = cfg.n_routed_experts - cfg.num_experts_per_tok
    unused_experts = n_moe * idle * expert_parameters(cfg)
    lm_head = cfg.vocab_size * cfg.hidden_size  # multiplied with even when tied
    return c["total"] - c["embedding"] - c["lm_head"] + lm_head - unused_experts


# ---- KV cache -----------------------------------------------------------------


def kv_cache_values_per_token_per_layer(
    cfg: ModelConfig, scheme: str = "mla", groups: int = 4
) -> int:
    """Values one token leaves in one layer's cache under an attention ``scheme``.

    With V2-Lite's head sizes (K 192, V 128, 16 heads):

    * ``"mha"``: each head keeps its own K and V: ``n_h·(qk_head + v)`` = 16·320 = 5120;
    * ``"gqa"``: ``groups`` K/V heads shared by the query heads:
      ``groups·(qk_head + v)`` = 1280 for 4 groups;
    * ``"mla"``: the latent plus the shared RoPE key: ``kv_lora + rope`` = 576;
    * ``"mqa"``: a single K/V head: ``qk_head + v`` = 320.
    """
    per_head = cfg.qk_head_dim + cfg.v_head_dim
    if scheme == "mha":
        return cfg.num_attention_heads * per_head
    if scheme == "gqa":
        n_h = cfg.num_attention_heads
        if not 0 < groups <= n_h or n_h % groups:
            raise ValueError(f"groups must divide {n_h} heads, got {groups}")
        return groups * per_head
    if scheme == "mla":
        return cfg.cache_row_dim
    if scheme == "mqa":
        return per_head
    raise ValueError(f"scheme must be one of {KV_SCHEMES}, got {scheme!r}")


def kv_cache_bytes_per_token(
    cfg: ModelConfig, scheme: str = "mla", bytes_per_value: int = 2, groups: int = 4
) -> int:
    """Cache bytes per token over all layers (V2-Lite, MLA, bf16: 31,104)."""
    per_layer = kv_cache_values_per_token_per_layer(cfg, scheme, groups)
    return cfg.num_hidden_layers * per_layer * bytes_per_value


# ---- decode and prefill limits ------------------------------------------------


def expected_distinct_experts(cfg: ModelConfig, batch: int) -> float:
    """Expected number of routed experts that ``batch`` tokens touch in one MoE layer.

    A token picks ``k`` distinct experts of ``E``, so a given expert escapes it with
    probability ``1 - k/E``. If tokens route independently and uniformly, it escapes the
    whole batch with probability ``(1 - k/E)^B``, hence ``E·(1 - (1 - k/E)^B)``. Real
    routers favour some experts, so real batches touch (and read) somewhat fewer.
    """
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if e == 0:
        return 0.0
    return e * (1.0 - (1.0 - k / e) ** batch)


def decode_bytes_breakdown(
    cfg: ModelConfig, batch: int, context: int, bytes_per_value: int = 2
) -> dict[str, float]:
    """Bytes one decode step reads for ``batch`` sequences of ``context`` cached tokens.

    * ``dense_weights``: what every token uses (attention, dense MLP, router, shared
      experts, norms, ``lm_head``), read once per step whatever the batch;
    * ``routed_experts``: :func:`expected_distinct_experts` experts per MoE layer;
    * ``embedding_rows``: one row of ``H`` values per sequence;
    * ``kv_cache``: ``batch·context·L·(kv_lora + rope)`` values of MLA latent cache.
    """
    c = parameter_counts(cfg)
    _, n_moe = _layer_kinds(cfg)
    lm_head = cfg.vocab_size * cfg.hidden_size  # read even when tied
    shared_by_all = ("attention", "dense_mlp", "router", "shared_experts", "norms")
    dense = sum(c[k] for k in shared_by_all)
    experts = n_moe * expected_distinct_experts(cfg, batch) * expert_parameters(cfg)
    values = {
        "dense_weights": dense + lm_head,
        "routed_experts": experts,
        "embedding_rows": batch * cfg.hidden_size,
        "kv_cache": batch * context * cfg.num_hidden_layers * cfg.cache_row_dim,
    }
    return {name: float(v * bytes_per_value) for name, v in values.items()}


def decode_bytes_per_step(
    cfg: ModelConfig, batch: int, context: int, bytes_per_value: int = 2
) -> float:
    """Total bytes one decode step reads (V2-Lite, batch 1, bf16: 4.9e9)."""
    return sum(decode_bytes_breakdown(cfg, batch, context, bytes_per_value).values())


def decode_flops_per_step(cfg: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one decode step: 2 per active parameter per token, plus attention.

    With weight absorption each head scores a 576-wide query against every cache row and
    sums 512-wide latents: ``2·n_h·context·(kv_lora + rope + kv_lora)`` per token per
    layer.
    """
    per_row = cfg.cache_row_dim + cfg.kv_lora_rank
    attention = 2 * cfg.num_attention_heads * context * per_row * cfg.num_hidden_layers
    return float(batch * (2 * active_parameters_per_token(cfg) + attention))


def decode_roofline_tokens_per_s(
    cfg: ModelConfig,
    batch: int,
    context: int,
    bandwidth: float = H200_BANDWIDTH,
    flops: float = H200_BF16_FLOPS,
    bytes_per_value: int = 2,
) -> float:
    """Upper bound on decode throughput, in tokens/s summed over the batch.

    A step yields ``batch`` tokens and lasts at least
    ``max(bytes / bandwidth, FLOPs / flops)``. V2-Lite at batch 1 on an H200:
    4.9e9 B / 4.2e12 B/s = 1.17 ms per step, about 857 tokens/s.
    """
    t_memory = decode_bytes_per_step(cfg, batch, context, bytes_per_value) / bandwidth
    t_compute = decode_flops_per_step(cfg, batch, context) / flops
    return batch / max(t_memory, t_compute)


def prefill_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs per prompt token in prefill: ``2·(active parameters − lm_head)``.

    Only the last position needs logits, so ``lm_head`` is left out. So are attention
    scores: a prompt of ``n`` tokens adds on average ``n·n_h·(qk_head + v)`` FLOPs per
    token per layer (1.6 % at n = 512 for V2-Lite).
    """
    lm_head = cfg.vocab_size * cfg.hidden_size
    return 2.0 * (active_parameters_per_token(cfg) - lm_head)


def prefill_roofline_tokens_per_s(
    cfg: ModelConfig,
    tokens: int | None = None,
    bandwidth: float = H200_BANDWIDTH,
    flops: float = H200_BF16_FLOPS,
) -> float:
    """Limit on prefill throughput. Without ``tokens``: the compute bound (V2-Lite, H200: about
    176,000/s), the limit of long prompts. With ``tokens``, the prompt tokens of one forward pass, the
    weight read too: the pass reads every weight its tokens touch (:func:`decode_bytes_per_step` at
    context 0; some 64 tokens touch nearly all of V2-Lite's 64 experts), so below about 1,300 tokens
    the read sets the limit (1 × 512 on an H200: about 69,000/s).
    """
    compute = flops / prefill_flops_per_token(cfg)
    if tokens is None:
        return compute
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    read_s = decode_bytes_per_step(cfg, tokens, 0) / bandwidth
    return min(compute, tokens / read_s)
