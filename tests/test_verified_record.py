"""scripts/record_verified.py: the verified-pairs record (verified.csv) that the suites append to."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_verified", REPO / "scripts" / "record_verified.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


def test_cpu_isa_names_the_path_vllm_cpu_takes():
    assert R.cpu_isa({"avx2", "avx512f", "amx_bf16"}) == "amx_bf16"
    assert R.cpu_isa({"avx2", "avx512f"}) == "avx512"
    assert R.cpu_isa({"avx2"}) == "avx2"
    assert R.cpu_isa(set()) == "other"


def test_rows_append_under_one_header(tmp_path):
    f = tmp_path / "verified.csv"
    R.main(["--suite", "cpu", "--result", "3 passed in 1.00s", "--file", str(f)])
    R.main(["--suite", "gpu", "--result", "1 failed, 2 passed in 2.00s", "--file", str(f)])
    rows = list(csv.DictReader(f.open()))
    assert [r["suite"] for r in rows] == ["cpu", "gpu"]
    assert rows[1]["result"] == "1 failed, 2 passed in 2.00s"
    assert list(rows[0]) == R.COLUMNS and rows[0]["vllm"] != "absent" and rows[0]["torch"] != "absent"
    assert f.read_text().count("date,vllm_ling_commit") == 1


def test_the_committed_record_has_the_columns():
    with (REPO / "verified.csv").open() as f:
        assert next(csv.reader(f)) == R.COLUMNS
