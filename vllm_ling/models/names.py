"""The names vLLM and transformers know Ling-3.0 by (one declaration each; no imports, so the
plugin and the patches can read them before vLLM's config modules load)."""

LING_MODEL_TYPE = "bailing_hybrid"  # config.json "model_type"
TARGET_ARCH = "BailingMoeV3ForCausalLM"  # config.json "architectures" of the target
DRAFT_ARCH = "BailingMoeV3MTPModel"  # the NEXTN draft vLLM builds for MTP
LING_ARCHITECTURES = (TARGET_ARCH, DRAFT_ARCH)
