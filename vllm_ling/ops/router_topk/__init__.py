"""Ling's MoE router top-k for decode-sized batches (CUDA, NVRTC): :mod:`.kernel`. No vLLM import."""
