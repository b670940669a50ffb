"""Ling's MoE router top-k (CUDA, NVRTC): :mod:`.kernel`, and :mod:`.selection` (which routers it
serves). No vLLM import."""
