"""Small DeepSeek-V2 configurations that together cover every architectural switch."""
import dataclasses

from dsv2_lib.core.config import TINY, RopeConfig

YARN = TINY.rope

# name -> config; each differs from the embedded tiny model in the switches parity must cover
CONFIGS = {
    # V2-Lite's shape: no q compression, YaRN, a dense first layer, then MoE layers
    "lite": dataclasses.replace(TINY, vocab_size=300, num_hidden_layers=3, max_position_embeddings=256,
                                rope=dataclasses.replace(YARN, original_max_position_embeddings=64)),
    # full V2's extras: compressed queries, group-limited routing, a routed scaling factor != 1
    "v2": dataclasses.replace(TINY, vocab_size=300, num_hidden_layers=3, q_lora_rank=48, n_routed_experts=8,
                              num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, max_position_embeddings=256,
                              rope=dataclasses.replace(YARN, original_max_position_embeddings=64, mscale=1.0,
                                                       mscale_all_dim=0.5)),  # cos/sin magnitude != 1
    # plain RoPE, every layer MoE, top-1, tied embeddings
    "plain": dataclasses.replace(TINY, vocab_size=300, num_hidden_layers=2, first_k_dense_replace=0,
                                 num_experts_per_tok=1, tie_word_embeddings=True, max_position_embeddings=256,
                                 rope=RopeConfig(theta=500.0)),
}
