"""The names vLLM and transformers know Ling-3.0 by (one declaration each; no imports, so the
plugin and the patches can read them before vLLM's config modules load)."""

LING_MODEL_TYPE = "bailing_hybrid"  # config.json "model_type"
TARGET_ARCH = "BailingMoeV3ForCausalLM"  # config.json "architectures" of the target
DRAFT_ARCH = "BailingMoeV3MTPModel"  # the NEXTN draft vLLM builds for MTP
LING_ARCHITECTURES = (TARGET_ARCH, DRAFT_ARCH)
# config.json key `vllm-ling make-tiny` writes: how the tiny checkpoint's weights were made
# ("random", "agreeing" or "scripted"); the launcher's smoke check reads it (a random draft cannot
# be accepted, so its accept length of 1 is expected there, not a failure).
TINY_WEIGHTS_KEY = "vllm_ling_tiny_weights"
