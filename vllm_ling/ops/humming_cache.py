"""Where humming's JIT kernels live, and how several processes share that place safely.

humming-kernels compiles every GEMM / input-processing kernel with NVRTC the first time a
shape/dtype/tuning combination is used and keeps the cubin in its cache directory. It reads
two environment variables, once per process (``humming.utils.jit`` caches them with
``functools.lru_cache``):

- ``HUMMING_CACHE_DIR``: the cubins and the JIT launcher (default ``~/.humming/cache``);
- ``HUMMING_TMP_DIR``: its per-kernel lock files and generated modules
  (default ``~/.humming/tmp``).

vllm-ling points both under one root, ``$VLLM_LING_HUMMING_CACHE`` (default
``$XDG_CACHE_HOME/vllm-ling/humming``, i.e. ``~/.cache/vllm-ling/humming``):
``<root>/kernels`` and ``<root>/tmp``. Keeping humming's lock files on the same volume as
the cubins matters when several containers mount one cache volume: with the default
``~/.humming/tmp`` each container would lock in its own home and two of them could compile
the same kernel at once. humming already takes a per-kernel ``filelock.FileLock`` and
publishes each cubin with an atomic ``os.replace``; on top of that :func:`compile_lock`
takes one ``fcntl.flock`` on ``<root>/compile.lock`` around a whole batch of compilations
(first use of a new shape, ``vllm-ling warmup``), so N workers starting together do not
each spend CPU compiling the same kernels: the first compiles, the others wait and then find
every kernel in the cache. ``flock`` is advisory and per open file description; it works on
local filesystems and on most network filesystems that support POSIX locks (not on some NFS
setups, where the per-kernel locks still keep the cache consistent).

Precedence: ``VLLM_LING_HUMMING_CACHE`` if set; otherwise an explicit ``HUMMING_CACHE_DIR``
from the user is respected (logged once); otherwise the default root.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from pathlib import Path

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import read

ENV_CACHE = "VLLM_LING_HUMMING_CACHE"
HUMMING_ENV_CACHE = "HUMMING_CACHE_DIR"
HUMMING_ENV_TMP = "HUMMING_TMP_DIR"
# humming's own switch: importing humming.ops.utils or humming.utils.nvrtc otherwise starts one
# Python process each that prebuilds a CUDA artifact (the JIT launcher, nvrtc_compile).
HUMMING_ENV_NO_BACKGROUND_BUILD = "HUMMING_DISABLE_PARALLEL_BUILD"
LOCK_NAME = "compile.lock"

logger = get_logger("ops.humming")


def default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "vllm-ling" / "humming"


def humming_cache_root() -> Path:
    """The root directory vllm-ling uses for humming (does not create it)."""
    env = read(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    user_dir = os.environ.get(HUMMING_ENV_CACHE)
    if user_dir:
        # The user configured humming directly; keep our lock file next to their cache.
        return Path(user_dir).expanduser().parent
    return default_cache_root()


def configure_humming_cache() -> Path:
    """Point humming's cache and tmp (lock) directories under :func:`humming_cache_root`.

    Must run before humming compiles anything; safe to call repeatedly; starts the per-process
    JIT counter (:mod:`vllm_ling.ops.humming_jit`). Environment
    variables are inherited by worker processes started afterwards. Returns the kernel
    cache directory humming will use.
    """
    from vllm_ling.ops.humming_jit import observe

    observe()  # count this process's compiles and cache hits from here on (vllm_ling.ops.humming_jit)
    root = humming_cache_root()
    if read(ENV_CACHE) or not os.environ.get(HUMMING_ENV_CACHE):
        kernels = root / "kernels"
        tmp = root / "tmp"
        os.environ[HUMMING_ENV_CACHE] = str(kernels)
        os.environ[HUMMING_ENV_TMP] = str(tmp)
    else:
        kernels = Path(os.environ[HUMMING_ENV_CACHE]).expanduser()
        log_once(logger, logging.INFO, "user-humming-cache",
                 "Using HUMMING_CACHE_DIR=%s as set by the user (set %s to override).",
                 kernels, ENV_CACHE)
        tmp = Path(os.environ.get(HUMMING_ENV_TMP) or (root / "tmp"))
        os.environ.setdefault(HUMMING_ENV_TMP, str(tmp))
    try:
        kernels.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(
            f"Cannot create the humming JIT cache under {root} ({exc}); set {ENV_CACHE} to a "
            "writable directory.") from exc
    _refresh_humming_dirs_if_imported()
    return kernels


def skip_background_builds() -> None:
    """Where nothing can be built for CUDA, stop humming's import-time background builds.

    vLLM imports humming in each of its processes (API server, engine core, workers); without
    CUDA every import would start two Python processes that load torch and humming only to
    fail, taking CPU from the server's own start and outliving a server that refused to start.
    Set before humming is imported; inherited by the processes vLLM starts afterwards. An
    explicit value from the user is kept."""
    os.environ.setdefault(HUMMING_ENV_NO_BACKGROUND_BUILD, "1")


def _refresh_humming_dirs_if_imported() -> None:
    """humming caches its directories on first use; if it was imported (and used) before we
    set the variables, drop those cached values so the new ones take effect."""
    jit_utils = sys.modules.get("humming.utils.jit")
    if jit_utils is None:
        return
    for name in ("get_humming_cache_dir", "get_humming_tmp_dir", "get_humming_lock_dir",
                 "get_humming_module_dir", "get_humming_lock_filename"):
        fn = getattr(jit_utils, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def compile_lock(root: Path | None = None):
    """Exclusive inter-process lock around a batch of humming compilations.

    Blocks until no other process holds it. Yields the lock file path.
    """
    root = humming_cache_root() if root is None else Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def count_cached_kernels(kernels_dir: Path | None = None) -> int:
    """Number of compiled cubins in the kernel cache (humming stores one ``kernel.cubin``
    per kernel hash directory)."""
    if kernels_dir is None:
        kernels_dir = Path(os.environ.get(HUMMING_ENV_CACHE) or humming_cache_root() / "kernels")
    if not Path(kernels_dir).is_dir():
        return 0
    return sum(1 for _ in Path(kernels_dir).glob("*/kernel.cubin"))
