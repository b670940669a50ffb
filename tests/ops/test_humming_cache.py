"""The humming JIT cache plumbing: cache directories from the environment and the
cross-process compile lock."""

import os
import subprocess
import sys
import textwrap


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    from vllm_ling.ops import humming_cache as hc

    monkeypatch.delenv(hc.HUMMING_ENV_CACHE, raising=False)
    monkeypatch.delenv(hc.HUMMING_ENV_TMP, raising=False)
    monkeypatch.delenv(hc.ENV_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hc.humming_cache_root() == tmp_path / "xdg" / "vllm-ling" / "humming"
    monkeypatch.setenv(hc.ENV_CACHE, str(tmp_path / "mine"))
    kernels = hc.configure_humming_cache()
    assert kernels == tmp_path / "mine" / "kernels" and kernels.is_dir()
    assert os.environ[hc.HUMMING_ENV_CACHE] == str(kernels)
    assert os.environ[hc.HUMMING_ENV_TMP] == str(tmp_path / "mine" / "tmp")
    (kernels / "abc").mkdir()
    (kernels / "abc" / "kernel.cubin").write_bytes(b"x")
    assert hc.count_cached_kernels(kernels) == 1


def test_user_humming_cache_dir_is_respected(monkeypatch, tmp_path):
    from vllm_ling.ops import humming_cache as hc

    monkeypatch.delenv(hc.ENV_CACHE, raising=False)
    monkeypatch.delenv(hc.HUMMING_ENV_TMP, raising=False)
    monkeypatch.setenv(hc.HUMMING_ENV_CACHE, str(tmp_path / "hc" / "cache"))
    assert hc.configure_humming_cache() == tmp_path / "hc" / "cache"
    assert os.environ[hc.HUMMING_ENV_TMP] == str(tmp_path / "hc" / "tmp")


def test_background_builds_switch_keeps_the_users_value(monkeypatch):
    """Without CUDA the plugin turns humming's import-time builds off (tests/runtime/test_plugin.py
    checks no process starts); a value the user set is left as it is."""
    from vllm_ling.ops import humming_cache as hc

    monkeypatch.delenv(hc.HUMMING_ENV_NO_BACKGROUND_BUILD, raising=False)
    hc.skip_background_builds()
    assert os.environ[hc.HUMMING_ENV_NO_BACKGROUND_BUILD] == "1"
    monkeypatch.setenv(hc.HUMMING_ENV_NO_BACKGROUND_BUILD, "0")
    hc.skip_background_builds()
    assert os.environ[hc.HUMMING_ENV_NO_BACKGROUND_BUILD] == "0"


def test_compile_lock_excludes_another_process(tmp_path):
    from vllm_ling.ops import humming_cache as hc

    probe = textwrap.dedent("""
        import fcntl, sys
        fh = open(sys.argv[1], "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("acquired")
        except BlockingIOError:
            print("blocked")
    """)
    with hc.compile_lock(tmp_path) as path:
        inside = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                                text=True, timeout=60).stdout.strip()
    after = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                           text=True, timeout=60).stdout.strip()
    assert (inside, after) == ("blocked", "acquired")
