"""Layer 4, engine: serving a model. Sampling, the block manager, the scheduler, CUDA-graph decode, and
``LLM`` (the public entry point). Imports core, ops and model."""
