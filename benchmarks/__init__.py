"""Benchmark scripts (run from the repository root as modules: ``python -m benchmarks.moe``;
see benchmarks/README.md). They import the installed vllm_ling package."""
