"""The startup verification report: its schema, its one writer and its reader.

Workers write it once after load (:mod:`vllm_ling.runtime.verification`) and add their
memory and startup facts after warm-up (:mod:`vllm_ling.runtime.startup_facts`), the API server
adds the chat round-trip check (:mod:`vllm_ling.runtime.chat_roundtrip`), ``vllm-ling
serve`` merges the smoke result into it (:mod:`vllm_ling.launcher.smoke`), and the stat
logger and ``GET /vllm_ling/report`` read it. Every write goes through :func:`write_report`
or :func:`update_report`: a private (0600) temporary file in the target directory, then an
atomic rename, so a reader never sees half a report.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any, Callable, Mapping

from vllm_ling.log import get_logger
from vllm_ling.options import read
from vllm_ling.processes import SERVER_MARKER_ENV, marker_of, owner_pid
from vllm_ling.refusal import Refusal

logger = get_logger("metrics")

ENV_REPORT_PATH = "VLLM_LING_REPORT_PATH"

# The report the startup verification writes (one JSON object). The stat logger and the
# GET /vllm_ling/report endpoint read it; tests validate samples and real reports with it.
_OPTIMIZATION_SCHEMA = {
    "type": "object",
    "required": ["requested", "active", "detail"],
    "properties": {
        "requested": {"type": "boolean"},
        "active": {"type": "boolean"},
        "detail": {"type": "string"},
    },
}
REPORT_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["passed", "policy", "platform", "gpu_arch", "versions", "optimizations",
                 "moe_backend", "head_dtype", "spec_method", "num_speculative_tokens",
                 "checks", "smoke"],
    "properties": {
        "passed": {"type": "boolean"},
        "policy": {"enum": ["strict", "warn", "off"]},
        "platform": {"enum": ["cpu", "cuda"]},
        "gpu_arch": {"type": ["string", "null"]},
        "versions": {
            "type": "object",
            "required": ["vllm", "humming"],
            "properties": {"vllm": {"type": "string"}, "humming": {"type": ["string", "null"]}},
        },
        "optimizations": {
            "type": "object",
            "required": ["moe_humming", "fp8_head", "mtp"],
            "additionalProperties": _OPTIMIZATION_SCHEMA,
        },
        "moe_backend": {"enum": ["humming", "reference", "vllm"]},
        "head_dtype": {"enum": ["float8_e4m3fn", "bfloat16", "float32"]},
        "spec_method": {"type": ["string", "null"]},
        "num_speculative_tokens": {"type": "integer", "minimum": 0},
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "passed", "expected", "actual", "fix"],
                "properties": {
                    "name": {"type": "string"},
                    "passed": {"type": "boolean"},
                    "expected": {"type": "string"},
                    "actual": {"type": "string"},
                    "fix": {"type": "string"},
                },
            },
        },
        # Known-answer kernel checks (vllm_ling.runtime.verification.known_answers.report_section).
        "kernel_checks": {
            "type": "object",
            "required": ["passed", "summary", "seconds", "results", "dense_fp8"],
            "properties": {
                "passed": {"type": "boolean"},
                "summary": {"type": "string"},
                "seconds": {"type": "number", "minimum": 0},
                "results": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "kernel", "passed", "max_error", "tolerance",
                                     "failing_inputs", "seconds", "cases", "skipped"],
                        "properties": {
                            "name": {"type": "string"},
                            "kernel": {"type": "string"},
                            "passed": {"type": "boolean"},
                            "max_error": {"type": ["number", "null"]},
                            "tolerance": {"type": "number"},
                            "failing_inputs": {"type": "array", "items": {"type": "string"}},
                            "seconds": {"type": "number"},
                            "cases": {"type": "integer"},
                            "skipped": {"type": ["string", "null"]},
                        },
                    },
                },
                "dense_fp8": {"type": "object", "required": ["kernels", "path_choice"]},
            },
        },
        # What each kind of attention layer holds (vllm_ling.runtime.verification.attention_backends):
        # the whole server's layers; each rank entry has its own.
        "attention_backends": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["model", "layer", "layers", "backend", "prefill"],
                "properties": {
                    "model": {"enum": ["target", "draft"]},
                    "layer": {"type": "string"},
                    "layers": {"type": "integer", "minimum": 1},
                    "backend": {"type": "string"},
                    "prefill": {"type": ["string", "null"]},
                },
            },
        },
        # One entry per rank of the server (vllm_ling.runtime.verification.ranks.rank_entry).
        "ranks": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["rank", "tp_rank", "pp_rank", "node_ip", "pid", "passed",
                             "head_dtype", "optimizations", "checks", "options"],
                "properties": {
                    "rank": {"type": "integer", "minimum": 0},
                    "tp_rank": {"type": "integer", "minimum": 0},
                    "pp_rank": {"type": "integer", "minimum": 0},
                    "node_ip": {"type": "string"},
                    "pid": {"type": "integer"},
                    "passed": {"type": "boolean"},
                    "head_dtype": {"enum": ["float8_e4m3fn", "bfloat16", "float32"]},
                    "options": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
        },
        "chat_roundtrip": {  # added by the API server's round-trip check (absent with VLLM_LING_VERIFY=off)
            "type": "object",
            "required": ["status", "reasoning_parser", "tool_parser", "template", "detail"],
            "properties": {"status": {"enum": ["passed", "failed", "off by request"]}},
        },
        "smoke": {
            "type": "object",
            "required": ["accept_length", "threshold", "passed"],
            "properties": {
                "accept_length": {"type": ["number", "null"]},
                "threshold": {"type": "number"},
                "passed": {"type": ["boolean", "null"]},
                "note": {"type": "string"},
            },
        },
        # Optional: bytes one worker (the reporting rank) holds, each storage once: its weights
        # (verification, after load) and its allocated KV cache (after warm-up, patch P8).
        "memory": {
            "type": "object",
            "properties": {"weights_bytes": {"type": "integer", "minimum": 0},
                           "kv_cache_bytes": {"type": "integer", "minimum": 0}},
        },
        # Added after warm-up by the reporting worker (vllm_ling.runtime.startup_facts): its
        # humming JIT kernels compiled vs loaded from the cache (not applicable (CPU): zeros and the
        # reason; applicable but not observed: null counts and the reason), and the split bounds its
        # attention metadata builders hold.
        "startup": {
            "type": "object",
            "required": ["humming_jit_applicable", "humming_jit_compiled_kernels", "humming_jit_cache_hits",
                         "humming_jit_compile_s", "humming_jit_detail", "rank"],
            "properties": {
                "humming_jit_applicable": {"type": "boolean"},
                "humming_jit_compiled_kernels": {"type": ["integer", "null"], "minimum": 0},
                "humming_jit_cache_hits": {"type": ["integer", "null"], "minimum": 0},
                "humming_jit_compile_s": {"type": ["number", "null"], "minimum": 0},
                "humming_jit_compile_s_total": {"type": "number", "minimum": 0},
                "humming_jit_detail": {"type": "string"},
                "rank": {"type": "integer", "minimum": 0},
                # the FlashAttention split bounds the attention metadata builders hold, per builder class
                # (vllm_ling.runtime.decode_splits.builder_bounds)
                "decode_split_bounds": {"type": "object", "additionalProperties": {
                    "type": "array", "items": {"type": "integer", "minimum": 0}}},
                # calls of vllm-ling's residual norm op before serving (vllm_ling.layers.residual_norm.calls)
                "residual_norm_calls": {"type": "integer", "minimum": 0},
                # of those, the calls that took the MoE's shared + routed sum in (vllm_ling.layers.moe_sum_norm)
                "residual_norm_folded_calls": {"type": "integer", "minimum": 0},
            },
        },
    },
}


def _server_start_time() -> float:
    """Start time of this vLLM server: the oldest of this process and its ancestors that belong to
    the same server (they carry this process's server marker, or are the process that set it:
    :mod:`vllm_ling.processes`; never a word in their command line, which a checkout's path can hold).

    A report file older than that belongs to an earlier run (a fixed VLLM_LING_REPORT_PATH
    on a volume) and must not be shown as this server's state.
    """
    try:
        import psutil
    except ImportError:  # psutil comes with vLLM; without it, trust any report
        return 0.0
    marker = os.environ.get(SERVER_MARKER_ENV)
    try:
        proc = psutil.Process()
        start = proc.create_time()
        for _ in range(4):
            proc = proc.parent()
            if proc is None or not marker or (marker_of(proc.pid) != marker and proc.pid != owner_pid(marker)):
                break
            start = min(start, proc.create_time())
        return start
    except (psutil.Error, OSError):
        return 0.0


def report_problems(report: Any) -> list[str]:
    """What the metrics need from a report and it lacks (an empty list when usable)."""
    if not isinstance(report, dict):
        return [f"top level is {type(report).__name__}, not an object"]
    problems = []
    if not isinstance(report.get("passed"), bool):
        problems.append('"passed" is not true/false')
    optimizations = report.get("optimizations")
    if not isinstance(optimizations, dict):
        problems.append('"optimizations" is not an object')
    else:
        for name, entry in optimizations.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("active"), bool)
                    and isinstance(entry.get("requested"), bool)):
                problems.append(f'"optimizations.{name}" lacks true/false "requested" and "active"')
    return problems


class ReportReader:
    """Reads the verification report lazily: it may appear after the reader is created.

    ``read()`` returns the newest valid report, or None while there is none. It re-parses
    only when the file's mtime or size changed, ignores a file older than the server's
    start (a previous run's), and keeps the last good report while a new one is half
    written. Problems are logged once per file version at WARNING.
    """

    def __init__(self, path: str | None = None, not_before: float | None = None):
        self._fixed_path = path
        self.not_before = _server_start_time() if not_before is None else not_before
        self._seen: tuple[str, float, int] | None = None
        self._report: dict | None = None
        self._warned: set[tuple] = set()
        self._lock = threading.Lock()

    @property
    def path(self) -> str | None:
        return self._fixed_path or read(ENV_REPORT_PATH) or None

    def _warn_once(self, key: tuple, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def read(self) -> dict | None:
        path = self.path
        if path is None:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self._report
        except OSError as e:
            self._warn_once(("stat", path, str(e)), "cannot read the vllm-ling report %s (%s): %s",
                            path, ENV_REPORT_PATH, e)
            return self._report
        version = (path, st.st_mtime, st.st_size)
        with self._lock:
            if version == self._seen:
                return self._report
            if st.st_mtime < self.not_before:
                self._warn_once(("stale",) + version,
                                "ignoring the vllm-ling report %s: it was written before this server "
                                "started (a previous run's); waiting for this run's report.", path)
                return self._report
            try:
                with open(path, encoding="utf-8") as f:
                    report = json.load(f)
            except (OSError, ValueError) as e:
                # Possibly caught mid-write: keep the last good one and retry on the next change.
                self._warn_once(("parse",) + version, "cannot parse the vllm-ling report %s: %s",
                                path, e)
                return self._report
            problems = report_problems(report)
            self._seen = version
            if problems:
                self._warn_once(("schema",) + version,
                                "the vllm-ling report %s is not usable (%s); its metrics stay unset.",
                                path, "; ".join(problems))
                return self._report
            self._report = report
            return report




class ReportPathError(Refusal, ValueError):
    """``VLLM_LING_REPORT_PATH`` cannot be written; the message names the variable."""


def default_report_path(name: str, env: Mapping[str, str] | None = None) -> str:
    """``<per-user directory>/vllm-ling/<name>``: ``$XDG_RUNTIME_DIR`` (a private tmpfs per
    user) when there is one, else ``$XDG_CACHE_HOME`` or ``~/.cache``. Never a predictable
    name in a shared ``/tmp``."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        base = runtime
    else:
        base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm-ling", name)


def check_report_path(path: str) -> None:
    """Make sure the report can be written at ``path`` (creating its directory, 0700), before
    any weight loads; :class:`ReportPathError` naming ``VLLM_LING_REPORT_PATH`` otherwise."""
    problem = None
    if os.path.isdir(path):
        problem = "is a directory"
    else:
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".report-", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            problem = f"its directory cannot be written ({exc.strerror or exc}: {exc.filename or directory})"
    if problem:
        raise ReportPathError(f"{ENV_REPORT_PATH}={path}: {problem}; set {ENV_REPORT_PATH} (or "
                              "--report-path) to a file in a writable directory")


def is_reporting_rank() -> bool:
    """World rank 0 writes the report (every process when unknown): vLLM's Ray executor puts it
    on the driver's node, where the API server reads the file, whatever the pipeline layout."""
    try:
        from vllm.distributed import get_world_group

        return get_world_group().rank_in_group == 0
    except Exception:
        return True


def is_report_source() -> bool:
    """Tensor-parallel rank 0 of the last pipeline stage: the rank whose checks cover the head and
    the draft, so its report is the one written (every process when unknown)."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank
    except Exception:
        return True


def write_report(report: dict[str, Any], path: str) -> None:
    """Replace the report at ``path`` atomically (0600 temporary file in the same directory)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".report-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def update_report(path: str | None, change: Callable[[dict[str, Any]], None]) -> bool:
    """Apply ``change`` to the report at ``path`` and write it back; False when there is none."""
    if not path or not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    change(report)
    write_report(report, path)
    return True
