"""Layer 4, engine: serving a model. Sampling, the block manager, the scheduler, CUDA-graph decode, the
engine configuration, the model runner (a scheduled step through the model) and ``LLM`` (the public
entry point: the loop). Imports core, ops and model."""
