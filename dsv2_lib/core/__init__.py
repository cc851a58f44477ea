"""Layer 1, core: what every other layer stands on. The model configuration, the safetensors format
and the checkpoint loader, the tokenizer, parameter dtypes, CUDA streams, and kernel loading (NVRTC
through CuPy, the backend choice, the launch on PyTorch's stream). Imports nothing else of dsv2_lib."""
