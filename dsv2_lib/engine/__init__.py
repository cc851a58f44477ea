"""Layer 4, engine: serving a model. Sampling, the block manager, the scheduler, CUDA-graph decode, the
engine configuration, the model runner (a scheduled step through the model), the step loop and each
request's state (text, stops, logprobs), the step trace, ``LLM`` (the public entry point) and the
live engine (requests arriving at any time). Imports core, ops and model."""
