"""Known-answer inputs for kernel checks and their independent answers.

No vLLM import (runs on the GPU machine). Each ``*_problem`` builder returns small
deterministic weights covering a format's edge cases plus input cases with the answer
computed in float64 *from the bit fields* (e4m3 sign/exponent/mantissa, e2m1 table, E8M0
exponents), never through torch's float8 casts or :mod:`vllm_ling.ops.mxfp4`: a kernel that
decodes a code, a nibble or a scale exponent wrongly cannot agree with it by sharing a bug.

- :mod:`.formats`: the formats' bit-level tables, message labels, tolerances;
- :mod:`.runner`: :class:`KnownAnswerCase`, :class:`KernelCheckResult` and :func:`run_check`
  (runs a kernel over the cases and names what failed);
- :mod:`.fp8`: dense block-FP8 linear and FP8 LM-head problems, the head-kernel check;
- :mod:`.mxfp4_moe`: the MXFP4 routed-experts problem and the experts check;
- :mod:`.kda`: the KDA prefill/decode problem and check;
- :mod:`.kda_conv`: the fused KDA short-convolution problem and check;
- :mod:`.kda_decode`: the one-launch KDA decode problem and check;
- :mod:`.router`: the MoE router GEMV problem and check;
- :mod:`.router_topk`: the MoE router top-k problem and check.

The fault injectors that prove each check can fail are the tests' (``tests/known_answer_faults.py``).
"""

from vllm_ling.ops.known_answer.formats import (DENSE_ROW_RTOL, E4M3_NAN_CODES, E4M3_TABLE,
                                                FINITE_E4M3_CODES, MOE_ROW_RTOL, MOE_W4A8_ROW_RTOL,
                                                ONE_HOT_RTOL, code_ranges, e4m3_value)
from vllm_ling.ops.known_answer.fp8 import (block_fp8_linear_problem, check_fp8_head_kernel,
                                            fp8_head_problem)
from vllm_ling.ops.known_answer.kda import check_kda, kda_problem
from vllm_ling.ops.known_answer.kda_conv import KDA_CONV_RTOL, ConvCall, check_kda_conv
from vllm_ling.ops.known_answer.kda_decode import KDA_DECODE_RTOL, check_kda_decode
from vllm_ling.ops.known_answer.mxfp4_moe import (MOE_MODE_LIMIT, MOE_REGIMES, MOE_SWIGLU_LIMIT,
                                                  check_mxfp4_experts, mxfp4_moe_problem)
from vllm_ling.ops.known_answer.router import ROUTER_RTOL, check_router_gemv, router_gemv_problem
from vllm_ling.ops.known_answer.router_topk import TOPK_RTOL, Routing, check_router_topk, router_topk_problem
from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check, skipped_result

__all__ = ["ConvCall", "DENSE_ROW_RTOL", "E4M3_NAN_CODES", "E4M3_TABLE", "FINITE_E4M3_CODES", "KDA_CONV_RTOL", "KDA_DECODE_RTOL",
           "KernelCheckResult", "KnownAnswerCase", "MOE_MODE_LIMIT", "MOE_REGIMES", "MOE_ROW_RTOL", "MOE_SWIGLU_LIMIT",
           "MOE_W4A8_ROW_RTOL", "ONE_HOT_RTOL", "ROUTER_RTOL", "Routing", "TOPK_RTOL", "block_fp8_linear_problem",
           "check_fp8_head_kernel", "check_kda", "check_kda_conv", "check_kda_decode", "check_mxfp4_experts", "check_router_gemv", "check_router_topk",
           "code_ranges", "e4m3_value", "fp8_head_problem", "kda_problem", "mxfp4_moe_problem",
           "router_gemv_problem", "router_topk_problem", "run_check", "skipped_result"]
