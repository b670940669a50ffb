"""The accept-length guard's threshold under DSpark: DSpark's own break-even from the byte model
(a 9-token verify and a draft cycle cost more than MTP's), unless the variable sets one."""

from __future__ import annotations

import pytest

from vllm_ling.runtime.acceptance import break_even_for
from vllm_ling.runtime.spec_policy import CostModel, dspark_break_even, load_config


def test_dspark_break_even_is_the_byte_models_scaled_like_mtps(monkeypatch):
    monkeypatch.delenv("VLLM_LING_ACCEPT_BREAK_EVEN", raising=False)
    mtp = CostModel(load_config(), 3)
    assert mtp.break_even(1) == pytest.approx(2.26)  # the study's measured point, by construction
    dspark = dspark_break_even(8)
    assert break_even_for("dspark", 8) == pytest.approx(dspark)
    assert 3.0 < dspark < 4.5  # more than MTP's: 9 verify positions and a 5-layer draft cycle
    assert dspark_break_even(7) < dspark  # fewer drafts, cheaper cycle
    assert break_even_for("mtp", 3) == pytest.approx(2.26) and break_even_for(None, 0) == pytest.approx(2.26)


def test_the_variable_wins(monkeypatch):
    monkeypatch.setenv("VLLM_LING_ACCEPT_BREAK_EVEN", "2.5")
    assert break_even_for("dspark", 8) == 2.5
