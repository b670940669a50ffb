"""Kernels and plain-PyTorch references. Nothing here imports vLLM, so every module
runs on the GPU device machine (torch 2.11, no vLLM) as well as under vLLM 0.32."""
