"""How a layer's selection is said (vllm_ling.layers.selection_said): one INFO where the optimization serves,
one WARNING opted out, one per fallback reason, nothing on the CPU platform nor where another switch decided."""

from __future__ import annotations

import logging

import pytest

from vllm_ling.layers.selection_said import say_selection
from vllm_ling.log import _once
from vllm_ling.models.kda_fused_conv import KdaConv, select_kda_fused_conv
from vllm_ling.selection import Platform


@pytest.fixture
def said(caplog):
    logger = logging.getLogger("vllm_ling.test_said")
    _once.difference_update({k for k in _once if k[0] == logger.name})

    def say(enabled: bool, platform: Platform, merged: bool, problems: list[str]) -> list[tuple[str, str]]:
        caplog.clear()
        selection = select_kda_fused_conv(enabled, platform, merged, problems)
        with caplog.at_level(logging.INFO, logger=logger.name):
            say_selection(logger, "conv", selection, selection.choice is KdaConv.FUSED, enabled, platform,
                          "serving", "opted out", "off for L: {reason}")
        return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == logger.name]
    return say


def test_each_case_is_said_once_at_its_level(said):
    assert said(True, Platform.CUDA, True, []) == [("INFO", "serving")]
    assert said(True, Platform.CUDA, True, []) == []  # once per process
    assert said(False, Platform.CUDA, True, []) == [("WARNING", "opted out")]
    assert said(True, Platform.CUDA, True, ["a conv has a bias"]) == [("WARNING", "off for L: a conv has a bias")]
    assert said(True, Platform.CUDA, True, ["another reason"]) == [("WARNING", "off for L: another reason")]


def test_another_switchs_consequence_and_the_cpu_say_nothing(said):
    """The in-projection left unmerged by its own switch: that switch's WARNING says it; this option was not
    opted out, so no WARNING claims it was (the CUDA layer said so before)."""
    assert said(True, Platform.CUDA, False, []) == []
    assert said(True, Platform.CPU, True, []) == []
    assert said(False, Platform.CPU, True, []) == []
