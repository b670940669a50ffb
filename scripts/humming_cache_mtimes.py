"""Make a humming JIT cache carried from an earlier GPU lease hit on this lease's fresh install.

humming keys every kernel it compiles by, among other things, the modification times of its
``include/**/*.cuh`` headers (``humming.jit.compiler.Compiler.cuh_last_update_time``, a JSON of path ->
st_mtime in the kernel's ``signature.txt``), and pip gives installed files the install time: each lease's
fresh install missed every kernel the lease before had cached (leases 2026-12-06f and 06g each compiled
all 178 of theirs; a full-size start spent 59 s compiling with the carried cache in place).

Run after the caches are restored and before anything compiles: sets the installed headers' mtimes to
those recorded by the newest cached kernel (the same header files, i.e. the same humming), then drops the
cached kernels recorded under other mtimes (they can never hit again), so a lease packs one set. With
other headers than recorded (another humming), it changes nothing and says so.

    python3 scripts/humming_cache_mtimes.py /root/.cache/vllm-ling/humming/kernels /root/.humming/cache
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

SIGNATURE = "signature.txt"  # humming's record of a cached kernel's key, beside its kernel.cubin
_NS_SEARCH = 400  # st_mtime is a double (about 240 ns apart here): the ns values that read back as it


def recorded_mtimes(signature: str) -> dict[str, float] | None:
    """The header mtimes in one kernel's signature (its ``$$``-separated part that is a JSON of .cuh paths)."""
    for part in signature.split("$$"):
        if part.startswith("{") and ".cuh" in part:
            return json.loads(part)
    return None


def kernel_signatures(cache_dirs: list[Path]) -> list[Path]:
    """Every cached kernel's signature file, newest first."""
    found = [p for d in cache_dirs if d.is_dir() for p in d.glob(f"*/{SIGNATURE}")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def humming_include_dir() -> Path | None:
    """The installed humming's header directory, located without importing humming (which probes CUDA)."""
    spec = importlib.util.find_spec("humming")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "include"


def installed_headers(include: Path) -> list[str]:
    return sorted(glob.glob(f"{include}/**/*.cuh", recursive=True))


def set_mtime(path: str, mtime: float) -> bool:
    """Give ``path`` the modification time that ``os.stat`` reads back as exactly ``mtime``."""
    base = round(mtime * 1e9)
    for step in range(_NS_SEARCH + 1):
        for ns in {base + step, base - step}:
            os.utime(path, ns=(ns, ns))
            if os.stat(path).st_mtime == mtime:
                return True
    return False


def align(cache_dirs: list[Path], include: Path) -> str:
    """Align the headers' mtimes with the newest cached kernel and prune the rest; what was done."""
    signatures = kernel_signatures(cache_dirs)
    if not signatures:
        return "humming cache: no cached kernels; nothing to align"
    recorded = recorded_mtimes(signatures[0].read_text())
    if recorded is None:
        return f"humming cache: {signatures[0]} records no header mtimes (another humming?); nothing changed"
    headers = installed_headers(include)
    if sorted(recorded) != headers:
        return (f"humming cache: the cached kernels were built with other headers ({len(recorded)} recorded, "
                f"{len(headers)} under {include}): another humming or path; nothing changed")
    changed = [path for path, mtime in recorded.items() if os.stat(path).st_mtime != mtime]
    failed = [path for path in changed if not set_mtime(path, recorded[path])]
    if failed:
        return f"humming cache: could not set the recorded mtime of {len(failed)} header(s), e.g. {failed[0]}"
    pruned = 0
    for signature in signatures[1:]:
        if recorded_mtimes(signature.read_text()) != recorded:
            shutil.rmtree(signature.parent)
            pruned += 1
    return (f"humming cache: {len(changed)} of {len(headers)} header mtimes set to the cached kernels' "
            f"({len(signatures) - pruned} kernel(s) kept, {pruned} recorded under other mtimes dropped)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dirs", nargs="+", type=Path, help="humming kernel cache directories")
    parser.add_argument("--include", type=Path, help="humming's include directory (default: the installed one)")
    args = parser.parse_args(argv)
    include = args.include or humming_include_dir()
    if include is None or not include.is_dir():
        print(f"humming cache: no humming include directory ({include}); nothing changed")
        return 0
    print(align(args.cache_dirs, include))
    return 0


if __name__ == "__main__":
    sys.exit(main())
