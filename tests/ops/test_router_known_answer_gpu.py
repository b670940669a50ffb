"""The router GEMV kernel on the startup known answers and through `vllm-ling warmup` (GPU;
no vLLM: the kernel, the check and the warmup are all in vllm_ling.ops)."""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops import known_answer as ka
from vllm_ling.ops.known_answer.router import ROUTER_EXPERTS
from vllm_ling.ops.small_gemv.router import router_logits, unavailable_reason
from vllm_ling.ops.small_gemv.kernel import launch_row_counts

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or unavailable_reason() is not None:
    pytest.skip(f"needs a CUDA GPU the kernel runs on ({unavailable_reason()})", allow_module_level=True)

DEV = torch.device("cuda")


@pytest.mark.parametrize("hidden,experts", [(2560, 512), (2560, ROUTER_EXPERTS), (128, ROUTER_EXPERTS),
                                            (4096, 512)])  # Ling's gate, a partial last CTA, the K limits
def test_kernel_passes_its_known_answers(hidden, experts):
    r = ka.check_router_gemv(router_logits, "router GEMV", hidden, DEV, experts=experts)
    assert r.passed and r.cases == len(launch_row_counts(experts)), r.message()


def test_kernel_reading_the_next_expert_row_fails_naming_it():
    r = ka.check_router_gemv(lambda x, w: router_logits(x, w.roll(-1, 0).contiguous()), "rolled", 2560, DEV)
    assert not r.passed and len(r.failing_inputs) == r.cases and "experts 0 (x2^40)" in r.failing_inputs[0]


def test_warmup_compiles_every_variant_the_server_launches():
    from vllm_ling.ops.small_gemv.router import MAX_ROWS
    from vllm_ling.ops.small_gemv import kernel, warmup

    kernel._COMPILED.clear()  # only what the warmup itself compiles counts
    for n, dtype, max_rows, run in ((512, torch.float32, MAX_ROWS, lambda: warmup.warmup_router(2560, 512)),
                                    (32, torch.bfloat16, kernel.BF16_MAX_ROWS,
                                     lambda: warmup.warmup_bf16_linears(32, 2560))):
        launched = {kernel.default_launch(rows, n) for rows in range(1, max_rows + 1)}
        result = run()
        assert result["kernel"].startswith(f"{len(launched)} x ling_small_gemv ({n} x 2560")
        # (K, weight dtype, out dtype, warps, tokens per pass, device)
        compiled = {(w, tb) for (k, wd, od, w, tb, _) in kernel._COMPILED if (k, wd, od) == (2560, dtype, dtype)}
        assert compiled == launched, f"{n} x 2560 {dtype}: warmup compiled {compiled}, the server launches {launched}"
    with pytest.raises(ValueError, match="exceeds 4096"):
        warmup.warmup_router(8192, 512)
