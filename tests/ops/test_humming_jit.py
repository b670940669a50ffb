"""The per-process humming JIT counter (vllm_ling.ops.humming_jit) on humming's own runtime path.

On CPU the real ``humming.jit.compiler.Compiler.compile`` runs (cache lookup, per-kernel lock,
logs, atomic publish of the cubin); only the compiler program is a stand-in (a Python
subprocess that sleeps a known time and writes the cubin where humming asks). On a GPU the
whole path is real (NVRTC, a humming kernel class). Each process is a fresh interpreter, so
"per process" is what is tested: the first compiles, the second loads from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

STANDIN_SECONDS = 0.4

CPU_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    from vllm_ling.ops import humming_jit
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    from humming.jit.compiler import Compiler

    class StandInCompiler(Compiler):
        # humming's Compiler.compile with a stand-in compiler program: same command-line
        # contract as humming's NVRTC helper (--output <cache>/<md5>/kernel_tmp.cubin)
        @classmethod
        def signature(cls):
            return "stand-in"

        @classmethod
        def get_flags(cls, sm_version, disable_fast_math=False):
            return []

        @classmethod
        def _compile(cls, source_path, cache_dirname, sm_version, kernel_expr, flags):
            target = os.path.join(cache_dirname, "kernel_tmp.cubin")
            prog = "import sys, time; time.sleep(float(sys.argv[1])); open(sys.argv[3], 'wb').write(b'cubin')"
            r = subprocess.run([sys.executable, "-c", prog, sys.argv[2], "--output", target],
                               capture_output=True, text=True)
            return r.returncode, r.stdout, r.stderr

    paths = [StandInCompiler.compile(code, sm_version="90a", kernel_expr=None) for code in sys.argv[1].split(",")]
    print(json.dumps({"facts": humming_jit.jit_facts(True), "snapshot": humming_jit.COUNTER.snapshot(),
                      "paths": paths}))
""")


def _run(script: str, tmp_path, *args: str) -> dict:
    env = dict(os.environ, VLLM_LING_HUMMING_CACHE=str(tmp_path / "cache"))
    env.pop("HUMMING_CACHE_DIR", None)
    env.pop("HUMMING_TMP_DIR", None)
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_first_process_compiles_second_loads_from_cache(tmp_path):
    first = _run(CPU_SCRIPT, tmp_path, "kernel A,kernel B,kernel A", str(STANDIN_SECONDS))
    facts = first["facts"]
    # A and B compiled here (A's second prepare finds A's cubin: humming's own cache hit)
    assert facts["humming_jit_applicable"] is True
    assert facts["humming_jit_compiled_kernels"] == 2 and facts["humming_jit_cache_hits"] == 0
    assert first["paths"][0] == first["paths"][2] != first["paths"][1]
    assert all(os.path.exists(p) for p in first["paths"])
    # two sequential compiles of at least the stand-in's sleep each, plus interpreter start-up
    assert 2 * STANDIN_SECONDS <= facts["humming_jit_compile_s"] < 60
    assert facts["humming_jit_compile_s_total"] == pytest.approx(facts["humming_jit_compile_s"], abs=0.01)

    second = _run(CPU_SCRIPT, tmp_path, "kernel A,kernel B,kernel C", str(STANDIN_SECONDS))["facts"]
    assert second["humming_jit_compiled_kernels"] == 1  # C only
    assert second["humming_jit_cache_hits"] == 2  # A and B, compiled by the first process
    assert STANDIN_SECONDS <= second["humming_jit_compile_s"] < 30


def test_not_applicable_and_not_observed_are_explicit():
    from vllm_ling.ops import humming_jit

    facts = humming_jit.jit_facts(False, "CPU platform: humming kernels are CUDA-only")
    assert facts == {"humming_jit_applicable": False, "humming_jit_compiled_kernels": 0,
                     "humming_jit_cache_hits": 0, "humming_jit_compile_s": 0.0,
                     "humming_jit_detail": "CPU platform: humming kernels are CUDA-only"}
    script = ("import json; from vllm_ling.ops import humming_jit; "
              "print(json.dumps(humming_jit.jit_facts(True)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    unobserved = json.loads(out.stdout)
    assert unobserved["humming_jit_compiled_kernels"] is None and "not observed" in unobserved["humming_jit_detail"]


def test_other_processes_files_and_other_directories_are_not_counted(tmp_path):
    """Events outside humming's cache directory, or a cubin this process did not compile."""
    from vllm_ling.ops.humming_jit import JitCounter

    import humming.utils.jit as jit_utils

    cache = os.path.normpath(jit_utils.get_humming_cache_dir())
    counter = JitCounter()
    md5 = "0123456789abcdef0123456789abcdef"
    counter.on_event("os.mkdir", (os.path.join(tmp_path, md5), 0o777, -1))  # not humming's cache
    counter.on_event("os.mkdir", (os.path.join(cache, "not-a-kernel"), 0o777, -1))
    counter.on_event("os.rename", (os.path.join(cache, md5, "kernel_tmp.cubin"),
                                   os.path.join(cache, md5, "kernel.cubin"), -1, -1))  # no compile seen
    counter.on_event("os.mkdir", (None, 0, -1))  # unreadable: counted as a hook error, never raised
    snap = counter.snapshot()
    assert (snap["compiled_kernels"], snap["cache_hits"], snap["hook_errors"]) == (0, 0, 1)

    # a compile followed by humming's cubin post-processing (a second program on kernel_tmp.cubin):
    # one compile, timed from the compiler's start
    tmp_cubin = os.path.join(cache, md5, "kernel_tmp.cubin")
    counter.on_event("os.mkdir", (os.path.join(cache, md5), 0o777, -1))
    counter.on_event("subprocess.Popen", ("nvrtc_compile", ["nvrtc_compile", "--output", tmp_cubin], None, None))
    started = counter.started[md5]
    counter.on_event("subprocess.Popen", ("patch_cubin", ["patch_cubin", tmp_cubin], None, None))
    counter.on_event("os.rename", (tmp_cubin, os.path.join(cache, md5, "kernel.cubin"), -1, -1))
    assert counter.compiled[md5][0] == started
    assert (counter.snapshot()["compiled_kernels"], counter.snapshot()["cache_hits"]) == (1, 0)


GPU_SCRIPT = textwrap.dedent("""
    import json, torch
    from vllm_ling.ops import humming_jit
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    from humming.kernel.pack_weight import PackWeightKernel

    with torch.cuda.device(0):
        PackWeightKernel(num_bits=4)
    print(json.dumps({"facts": humming_jit.jit_facts(True)}))
""")


@pytest.mark.gpu
def test_real_humming_kernel_compiles_once_then_is_a_cache_hit(tmp_path):
    """A real humming kernel (NVRTC) in two fresh processes sharing one empty cache."""
    first = _run(GPU_SCRIPT, tmp_path)["facts"]
    assert (first["humming_jit_compiled_kernels"], first["humming_jit_cache_hits"]) == (1, 0), first
    assert first["humming_jit_compile_s"] > 0
    second = _run(GPU_SCRIPT, tmp_path)["facts"]
    assert (second["humming_jit_compiled_kernels"], second["humming_jit_cache_hits"]) == (0, 1), second
    assert second["humming_jit_compile_s"] == 0
