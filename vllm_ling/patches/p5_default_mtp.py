"""Patch P5: a Ling target gets speculative decoding by default: NEXTN MTP, or DSpark with a drafter.

What: wraps ``EngineArgs.create_speculative_config``: for a Ling target with no
speculative option from the user, it fills in Ling's default (``VLLM_LING_MTP=0`` turns it
off; any user speculative config wins) and checks option conflicts first. The drafter is
``VLLM_LING_DRAFTER``'s: the DSpark drafter of ``VLLM_LING_DSPARK_MODEL`` when one is given
(checked against the target, and refused where vLLM 0.32 cannot run D-Spark:
``config_hooks.check_dspark_request``), else the NEXTN layer. A checkpoint
without NEXTN layers (``num_nextn_predict_layers: 0``) gets no default (one WARNING), and an
explicit MTP config for it is one clear error instead of vLLM's ZeroDivisionError. Under
pipeline parallelism vLLM 0.32 cannot run a draft model at all (runtime.spec_policy
``PP_NO_DRAFT_REASON``): no default there (one WARNING), and a user's draft-model config is
one clear error before any engine process starts.
The decision is ``runtime.spec_policy.select_speculation``'s, recorded on the target's hf_config
for the startup verification.
Why: vLLM has no model-level default speculator, and the upstream recipe leaves MTP
opt-in. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import logging

from vllm_ling.log import get_logger, log_once

logger = get_logger("config")
_MARK = "_vllm_ling_default_mtp"


def _engine_args():
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def is_applied() -> bool:
    return getattr(_engine_args().__dict__.get("create_speculative_config"), _MARK, False)


def _user_gave_speculation(engine_args) -> bool:
    return engine_args.speculative_config is not None or any(
        getattr(engine_args, f, None) is not None for f in ("spec_method", "spec_model", "spec_tokens"))


# vLLM 0.32's speculative methods that build no draft model (every other one does)
DRAFTLESS_METHODS = frozenset(("ngram", "ngram_gpu", "suffix"))


def _user_draft_method(engine_args) -> str | None:
    spec = engine_args.speculative_config
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    method = method or getattr(engine_args, "spec_method", None)
    if method is None and (isinstance(spec, dict) and spec.get("model") or getattr(engine_args, "spec_model", None)):
        return "draft_model"
    return method


def apply() -> None:
    from vllm_ling.options import Drafter, LingOptions, opt_out_setting
    from vllm_ling.patches.config_hooks import (LingConfigError, check_dspark_request, check_head_conflicts,
                                                check_mtp_needs_nextn_layers, default_speculative_config,
                                                dspark_speculative_config, is_ling_target)
    from vllm_ling.runtime.spec_policy import (PP_NO_DRAFT_REASON, Speculation, record_speculation,
                                               recorded_speculation, select_speculation)

    engine_args_cls = _engine_args()
    original = engine_args_cls.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        if is_ling_target(target_model_config):
            options = LingOptions.current()
            check_head_conflicts(options, target_model_config.hf_config, self.speculative_config)
            user_gave = _user_gave_speculation(self)
            nextn = getattr(target_model_config.hf_config, "num_nextn_predict_layers", 0) or 0
            if nextn == 0:  # no draft layer: vLLM's MTP config would divide by zero
                check_mtp_needs_nextn_layers(self, target_model_config.model)
            pp = int(getattr(target_parallel_config, "pipeline_parallel_size", 1) or 1)
            if pp > 1 and user_gave and _user_draft_method(self) not in DRAFTLESS_METHODS:
                raise LingConfigError(
                    f"--speculative-config method {_user_draft_method(self)!r} with --pipeline-parallel-size {pp}: "
                    f"{PP_NO_DRAFT_REASON}. Drop --speculative-config (or use method ngram), or serve with "
                    "--tensor-parallel-size instead of pipeline parallelism.")
            from vllm import envs
            from vllm.platforms import current_platform

            check_dspark_request(options, self.speculative_config, user_gave, target_model_config, pp,
                                 current_platform.is_cuda(), envs.VLLM_USE_V2_MODEL_RUNNER,
                                 str(getattr(self, "load_format", "auto")))
            if options.dspark_model and options.drafter is Drafter.MTP and not user_gave:
                log_once(logger, logging.WARNING, "dspark-opt-out",
                         "The DSpark drafter %s is configured but not used: VLLM_LING_DRAFTER=mtp speculates with "
                         "the checkpoint's NEXTN layer (reported as the speculative selection).",
                         options.dspark_model)
            hf_config = target_model_config.hf_config
            selection = select_speculation(options, user_gave, nextn, pp)
            # a second call on the same arguments sees the default this wrapper filled in as the user's:
            # the first decision stands
            if not (selection.choice is Speculation.USER and recorded_speculation(hf_config) is not None):
                record_speculation(hf_config, selection)
            if selection.choice is Speculation.OFF_PIPELINE:
                log_once(logger, logging.WARNING, "pp-no-mtp",
                         "NEXTN MTP speculation is off: --pipeline-parallel-size %d, and %s. Reported as not "
                         "requested; --tensor-parallel-size keeps MTP.", pp, PP_NO_DRAFT_REASON)
            elif selection.choice is Speculation.OFF_NO_NEXTN:
                log_once(logger, logging.WARNING, "no-nextn",
                         "NEXTN MTP speculation is off: %s/config.json has num_nextn_predict_layers=0 "
                         "(no draft layer to speculate with). Reported as not requested; "
                         "%s says so explicitly.", target_model_config.model, opt_out_setting("VLLM_LING_MTP"))
            elif selection.choice is Speculation.DEFAULT_DSPARK:
                self.speculative_config = dspark_speculative_config(options)
                log_once(logger, logging.INFO, "default-dspark",
                         "Ling default speculative decoding: %s (VLLM_LING_DRAFTER=mtp uses the NEXTN layer; "
                         "--speculative-config overrides it).", self.speculative_config)
            elif selection.choice is Speculation.DEFAULT_MTP:
                self.speculative_config = default_speculative_config(
                    options, hf_config, getattr(self, "max_num_seqs", None))
                log_once(logger, logging.INFO, "default-mtp",
                         "Ling default speculative decoding: %s (%s turns it off; "
                         "--speculative-config overrides it).", self.speculative_config,
                         opt_out_setting("VLLM_LING_MTP"))
            elif selection.choice is Speculation.OFF:
                log_once(logger, logging.INFO, "mtp-off", "NEXTN MTP speculation is off (%s).",
                         opt_out_setting("VLLM_LING_MTP"))
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config.__wrapped__ = original
    setattr(create_speculative_config, _MARK, True)
    engine_args_cls.create_speculative_config = create_speculative_config
