"""scripts/humming_cache_mtimes.py: a carried humming cache hits after a fresh install of the same humming.

The headers' mtimes are compared the way humming keys its kernels (``os.stat(path).st_mtime`` as
JSON, ``humming.jit.compiler.Compiler.cuh_last_update_time``), with mtimes as the leases recorded them
(sub-microsecond fractions that a double holds only to about 240 ns)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("humming_cache_mtimes", REPO / "scripts" / "humming_cache_mtimes.py")
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)

LEASE_F = 1796593925.7819507  # the install times two leases' signatures recorded
LEASE_G = 1796600783.5913193


def _headers(include: Path) -> list[Path]:
    paths = [include / "humming" / "arith" / "epilogue_arith.cuh", include / "humming" / "kernel.cuh",
             include / "humming" / "utils" / "a.cuh"]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("// header\n")
    (include / "humming" / "notes.txt").write_text("not a header")
    return paths


def _humming_key(include: Path) -> str:
    """humming's own key part, restated: {path: st_mtime} of every .cuh, sorted, as JSON."""
    import glob

    return json.dumps({f: os.stat(f).st_mtime for f in sorted(glob.glob(f"{include}/**/*.cuh", recursive=True))},
                      ensure_ascii=False)


def _kernel(cache: Path, name: str, mtimes: dict[str, float], age: float) -> Path:
    d = cache / name
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"cubin")
    sig = d / M.SIGNATURE
    sig.write_text("NVRTCCompiler$$sig$$-arch=sm_90$$kernel<1>$$code\n$$" + json.dumps(mtimes, ensure_ascii=False))
    os.utime(sig, (age, age))
    return d


def test_headers_take_the_newest_kernels_mtimes_and_older_kernels_are_dropped(tmp_path):
    include = tmp_path / "site" / "humming" / "include"
    headers = _headers(include)
    cache = tmp_path / "cache"
    recorded_f = {str(p): LEASE_F + i * 1e-3 for i, p in enumerate(headers)}
    recorded_g = {str(p): LEASE_G + i * 3.7e-3 for i, p in enumerate(headers)}
    old = _kernel(cache, "old", recorded_f, age=1_000)
    new = [_kernel(cache, f"new{i}", recorded_g, age=2_000 + i) for i in range(2)]
    assert _humming_key(include) != json.dumps(recorded_g)  # the fresh install's times: every kernel would miss

    said = M.align([cache, tmp_path / "absent"], include)

    assert _humming_key(include) == json.dumps(recorded_g, ensure_ascii=False), said
    assert not old.exists() and all(d.exists() for d in new), said
    assert "3 of 3 header mtimes set" in said and "1 recorded under other mtimes dropped" in said
    # a second run finds them aligned and keeps every kernel
    assert "0 of 3 header mtimes set" in M.align([cache], include)


def test_other_headers_change_nothing(tmp_path):
    include = tmp_path / "site" / "humming" / "include"
    headers = _headers(include)
    cache = tmp_path / "cache"
    recorded = {str(p): LEASE_G for p in headers[:2]}  # another humming: one header fewer
    kept = _kernel(cache, "k", recorded, age=1_000)
    before = _humming_key(include)

    said = M.align([cache], include)

    assert "nothing changed" in said and _humming_key(include) == before and kept.exists()


def test_no_cache_and_no_humming_are_no_ops(tmp_path, capsys):
    include = tmp_path / "include"
    _headers(include)
    assert "nothing to align" in M.align([tmp_path / "none"], include)
    assert M.main([str(tmp_path / "none"), "--include", str(tmp_path / "missing")]) == 0
    assert "nothing changed" in capsys.readouterr().out


def test_set_mtime_reads_back_exactly(tmp_path):
    f = tmp_path / "h.cuh"
    f.write_text("x")
    for mtime in (LEASE_F, LEASE_G, 1796600783.603596, 1_700_000_000.0):
        assert M.set_mtime(str(f), mtime) and os.stat(f).st_mtime == mtime
