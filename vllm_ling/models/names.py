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
DSPARK_ARCH = "LingDSparkModel"  # config.json "architectures" of the DSpark drafter (SGLang's and vllm#54174's name)
# vLLM 0.32's own Qwen3-shaped DSpark drafter: the architecture its speculative config routes as
# a standalone dense DSpark draft (config/speculative.py), and the class vllm-ling's subclasses
VLLM_QWEN3_DSPARK_ARCH = "Qwen3DSparkModel"
DSPARK_MODEL_TYPE = "qwen3"  # the drafter's config.json "model_type" (SpecForge's DSpark export)
# On the target's hf_config (it reaches every process): the speculative method patch P5 selected,
# {"choice": value, "reason": text} (runtime.spec_policy writes and reads it; the DSpark drafter
# records its reason).
SPECULATION_ATTR = "vllm_ling_speculation"
# On the DSpark drafter's Markov projection: a vLLM ParallelLMHead that is no LM head (the head
# readers leave it to the drafter's reader).
MARKOV_PROJECTION_ATTR = "ling_dspark_markov_projection"
