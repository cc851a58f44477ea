"""Layer 3, model: DeepSeek-V2's layers (MLA, MLP, MoE), the decoder, and what a forward pass reads and
writes (the batch descriptors and the latent KV cache). Imports core and ops."""
