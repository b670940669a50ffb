"""P7: vLLM's strict environment validation accepts vllm-ling's variables only through the patch."""

from __future__ import annotations

import logging
import os

import pytest

from patch_refusal import assert_refuses_changed_source

from vllm_ling.options import UNKNOWN_WARNED_MARKER

pytest.importorskip("vllm")


@pytest.fixture
def without_p7(monkeypatch):
    """vLLM's variable table without ours, and an environment holding only a vllm-ling
    option, a `vllm-ling serve` option and a typo among VLLM_* names (restored after)."""
    import vllm.envs as envs

    from vllm_ling.options import known_env_vars

    for name in known_env_vars():
        monkeypatch.delitem(envs.environment_variables, name, raising=False)
    for name in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_LING_FP8_HEAD", "1")
    monkeypatch.setenv("VLLM_LING_PORT", "8000")
    monkeypatch.setenv(UNKNOWN_WARNED_MARKER, "")  # as in the first process of a server
    return envs


def test_strict_validation_accepts_our_variables_only_with_p7(without_p7, monkeypatch, caplog):
    from vllm.platforms import current_platform

    from vllm_ling.patches import p7_declare_env_vars as p7
    from vllm_ling.patches.registry import apply_all

    assert not p7.is_applied()
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_LING_"):
        current_platform.validate_environ(hard_fail=True)  # vLLM's --fail-on-environ-validation

    monkeypatch.setenv("VLLM_LING_FP8_HAED", "1")  # a typo gets our own warning
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        assert "P7 plugin-environment-variables" in apply_all("register", ids=("P7",))
    assert ("VLLM_LING_FP8_HAED is not a vllm-ling variable and is ignored; "
            "did you mean VLLM_LING_FP8_HEAD?") in caplog.text
    monkeypatch.delenv("VLLM_LING_FP8_HAED")
    assert p7.is_applied()
    current_platform.validate_environ(hard_fail=True)
    assert without_p7.VLLM_LING_FP8_HEAD == "1"  # a compile factor: read like vLLM's own variables
    assert without_p7.VLLM_LING_PORT is None  # not one: vLLM sees no value


def test_compile_cache_key_follows_kernel_switches_only(without_p7, monkeypatch):
    """vLLM hashes every declared variable's value into its torch.compile cache key: a kernel
    switch must change the key (else a stale compiled graph would load), a port, report path or
    smoke setting must not (else the model recompiles for nothing, minutes on a DGX Spark)."""
    from vllm_ling.patches.registry import apply_all

    apply_all("register", ids=("P7",))
    key = without_p7.compile_factors
    base = key()
    for name, value in (("VLLM_LING_PORT", "8123"), ("VLLM_LING_REPORT_PATH", "/run/x/report-8123.json"),
                        ("VLLM_LING_API_KEY_FILE", "/run/secrets/key"), ("VLLM_LING_SMOKE", "0"),
                        ("VLLM_LING_VERIFY", "warn")):
        monkeypatch.setenv(name, value)
        assert key() == base, f"{name} changed vLLM's compile cache key"
        if "/" in value:  # paths: not persisted in the cache's key file either
            assert value not in repr(key()), f"{name}'s value is written into the cache key"
    for name, value in (("VLLM_LING_DENSE_FP8", "vllm"), ("VLLM_LING_MOE_DECODE", "off"),
                        ("VLLM_LING_KDA_MERGED_IN_PROJ", "0"), ("VLLM_LING_FP8_HEAD", "0")):
        monkeypatch.setenv(name, value)
        assert key() != base, f"{name} does not change vLLM's compile cache key"
        base = key()


def test_p7_refuses_a_changed_upstream_table(without_p7, monkeypatch):
    assert_refuses_changed_source(monkeypatch, "P7", lambda: "VLLM_LING_FP8_HEAD" not in without_p7.environment_variables)


def test_unknown_variable_warned_once_per_server(without_p7, monkeypatch, caplog):
    """The first process warns and marks the environment; vLLM's engine core and workers
    inherit the mark and stay quiet (three identical WARNINGs before)."""
    from vllm_ling.patches import p7_declare_env_vars as p7

    monkeypatch.setenv("VLLM_LING_MAX_MODEL_LENGTH", "4096")
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        p7.warn_unknown_ling_variables()
    assert caplog.text.count("VLLM_LING_MAX_MODEL_LENGTH is not a vllm-ling variable") == 1
    assert "did you mean VLLM_LING_MAX_MODEL_LEN?" in caplog.text
    assert os.environ[UNKNOWN_WARNED_MARKER] == "1"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        p7.warn_unknown_ling_variables()  # a child process: inherited mark
    assert "MAX_MODEL_LENGTH" not in caplog.text
