"""vllm-ling's switches, read from the environment in every vLLM process.

Environment variables (not CLI flags) because vLLM's engine-core and worker
processes inherit them, while extra CLI flags would not reach them. Each has a
documented default; a malformed value is an error naming the variable.

| variable | default | meaning |
|---|---|---|
| VLLM_LING_MOE_BACKEND | humming | ``humming``: our Humming MXFP4 MoE (reference path on CPU); ``vllm``: opt out, vLLM picks (logged at WARNING, reported) |
| VLLM_LING_MOE_DECODE | auto | batches of at most VLLM_LING_MOE_DECODE_MAX_TOKENS tokens: ``auto`` fused decode kernels on humming's weights where they run (sm_90+, W4A16; otherwise logged at WARNING and reported), ``copy`` on a second GEMV-packed copy of the experts (fastest, twice the expert memory), ``off`` humming's GEMM always |
| VLLM_LING_MOE_DECODE_MAX_TOKENS | 32 | largest batch (tokens) that takes the decode kernels (they beat humming's GEMM up to 32 tokens on the H200, the largest batch measured); 0..4096 |
| VLLM_LING_MOE_W4A8 | 0 | ``1``: humming MoE with FP8 e4m3 per-token activations (the study's "W4A8"; sm_89+, an error elsewhere) |
| VLLM_LING_FP8_HEAD | 1 | FP8 online-quantized target LM head; ``0`` opts out (BF16 head) |
| VLLM_LING_MTP | 1 | default NEXTN MTP speculation when the user gives no speculative config; ``0`` off |
| VLLM_LING_NUM_SPEC_TOKENS | 3 | draft tokens per step for the default MTP config |
| VLLM_LING_VERIFY | strict | startup verification policy: strict (refuse to serve), warn, off |
| VLLM_LING_REPORT_PATH | per-server temp file | where the worker writes its JSON verification report (set by the plugin before vLLM spawns processes) |
| VLLM_LING_HUMMING_CACHE | ~/.cache/vllm-ling/humming | humming JIT cache |
"""

from __future__ import annotations

import dataclasses
import os

MOE_BACKENDS = ("humming", "vllm")
MOE_DECODE_MODES = ("auto", "copy", "off")  # vllm_ling.ops.moe.DECODE_MODES (no torch import here)
MOE_DECODE_MAX_TOKENS = 32  # vllm_ling.ops.moe.DEFAULT_DECODE_MAX_TOKENS
# the decode kernels launch one grid row per (token, top-k slot): tokens x top_k (<= 8) must stay
# within CUDA's 65535 grid rows; past ~32 tokens humming's GEMM is the faster path anyway
MOE_DECODE_MAX_TOKENS_LIMIT = 4096
VERIFY_POLICIES = ("strict", "warn", "off")


class LingOptionError(ValueError):
    pass


# Variables read elsewhere in the package (metrics guard, kernels, smoke check, diagnostics).
_OTHER_ENV_VARS = (
    "VLLM_LING_HUMMING_CACHE", "VLLM_LING_LM_HEAD_KERNEL", "VLLM_LING_ACCEPT_WINDOW",
    "VLLM_LING_ACCEPT_BREAK_EVEN", "VLLM_LING_SMOKE", "VLLM_LING_SMOKE_MIN_ACCEPT",
    "VLLM_LING_NEGATIVE_CONTROL",  # test-only: rebuilds the weight-only head trap on purpose
)


def known_env_vars() -> set[str]:
    """Every VLLM_LING_* variable vllm-ling reads (the launcher's VLLM_LING_<OPTION> too)."""
    from vllm_ling.serving.launch import ENV_PREFIX, SERVE_OPTIONS

    names = {f.name for f in dataclasses.fields(LingOptions)}
    known = {"VLLM_LING_" + n.upper() for n in names} | set(_OTHER_ENV_VARS)
    known |= {ENV_PREFIX + o.name.upper() for o in SERVE_OPTIONS}
    known |= {ENV_PREFIX + n for n in ("MODEL", "DEVICE", "API_KEY_FILE")}
    return known


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise LingOptionError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, on/off)")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise LingOptionError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return value


def _int(name: str, default: int, minimum: int, maximum: int | None = None, why_max: str = "") -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise LingOptionError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise LingOptionError(f"{name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise LingOptionError(f"{name}={value} must be <= {maximum} ({why_max})")
    return value


@dataclasses.dataclass(frozen=True)
class LingOptions:
    moe_backend: str = "humming"
    moe_w4a8: bool = False
    moe_decode: str = "auto"
    moe_decode_max_tokens: int = MOE_DECODE_MAX_TOKENS
    fp8_head: bool = True
    mtp: bool = True
    num_spec_tokens: int = 3
    verify: str = "strict"
    report_path: str | None = None

    @classmethod
    def from_env(cls) -> "LingOptions":
        return cls(
            moe_backend=_choice("VLLM_LING_MOE_BACKEND", "humming", MOE_BACKENDS),
            moe_w4a8=_bool("VLLM_LING_MOE_W4A8", False),
            moe_decode=_choice("VLLM_LING_MOE_DECODE", "auto", MOE_DECODE_MODES),
            moe_decode_max_tokens=_int("VLLM_LING_MOE_DECODE_MAX_TOKENS", MOE_DECODE_MAX_TOKENS, 0,
                                        MOE_DECODE_MAX_TOKENS_LIMIT, "one kernel grid row per token and top-k slot"),
            fp8_head=_bool("VLLM_LING_FP8_HEAD", True),
            mtp=_bool("VLLM_LING_MTP", True),
            num_spec_tokens=_int("VLLM_LING_NUM_SPEC_TOKENS", 3, 1),
            verify=_choice("VLLM_LING_VERIFY", "strict", VERIFY_POLICIES),
            report_path=os.environ.get("VLLM_LING_REPORT_PATH") or None,
        )
