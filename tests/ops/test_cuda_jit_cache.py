"""vllm_ling.ops.cuda_jit's kernel cache and define lines on the CPU: a launch finds its kernel by key
alone, its source built and compiled once per key (the compile itself: tests/ops/test_kernels_compile.py)."""

from __future__ import annotations

import torch

from vllm_ling.ops import cuda_jit


def test_each_key_compiles_once_from_a_source_built_only_then(monkeypatch):
    compiled, built = [], []
    monkeypatch.setattr(cuda_jit, "compiled_kernel", lambda name, source, device: compiled.append((name, source)) or
                        object())
    cache: dict[tuple, object] = {}
    dev = torch.device("cuda", 0)

    def source(n: int) -> str:
        built.append(n)
        return cuda_jit.define_lines({"N_": n, "FLAG": int(n > 1)})

    first = cuda_jit.cached_kernel(cache, "k", (1, dev), dev, source, 1)
    assert cuda_jit.cached_kernel(cache, "k", (1, dev), dev, source, 1) is first
    other = cuda_jit.cached_kernel(cache, "k", (2, dev), dev, source, 2)
    assert other is not first and built == [1, 2]
    assert compiled == [("k", "#define N_ 1\n#define FLAG 0\n"), ("k", "#define N_ 2\n#define FLAG 1\n")]
