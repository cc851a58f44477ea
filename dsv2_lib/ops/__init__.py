"""Layer 2, ops: one module per operation, each with its PyTorch reference (the definition) and its
CUDA kernel launcher (``kernels_cu/``), dispatched by ``core.kernels.use_kernels``. Imports core only."""
