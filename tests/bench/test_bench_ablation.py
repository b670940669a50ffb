"""The ablation runner: launches servers per configuration, verifies their reports, stops them.

The stand-in server reports back the VLLM_LING_* switches it was started with, so these tests
check the orchestration (environment per configuration, health wait, report check, shutdown,
table) without a model.
"""

from __future__ import annotations

import json
import shlex
import socket

import pytest

from vllm_ling.bench.arguments import bench_config, run_parser
from vllm_ling.bench import main as bench_main
from vllm_ling.bench.ablation import (
    ABLATION_CONFIGS,
    AblationConfig,
    AblationError,
    AblationSettings,
    check_report,
    run_ablation,
)
from vllm_ling.bench.runner import BenchConfig

STANDIN_CMD = "{python} -m vllm_ling.bench.standin --host {host} --port {port} --model {model}"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_configuration_table_is_cumulative():
    names = [c.name for c in ABLATION_CONFIGS]
    assert names == ["baseline", "humming", "fp8_head", "mtp"]
    on = [sum(c.expect.values()) for c in ABLATION_CONFIGS]
    assert on == [0, 1, 2, 3]  # each configuration adds exactly one optimization
    for c in ABLATION_CONFIGS:
        assert set(c.env) == {"VLLM_LING_MOE_BACKEND", "VLLM_LING_FP8_HEAD", "VLLM_LING_MTP"}
        assert (c.env["VLLM_LING_MOE_BACKEND"] == "humming") == c.expect["moe_humming"]
        assert (c.env["VLLM_LING_FP8_HEAD"] == "1") == c.expect["fp8_head"]
        assert (c.env["VLLM_LING_MTP"] == "1") == c.expect["mtp"]


def test_ablation_all_four_configurations(tmp_path):
    settings = AblationSettings(
        model="standin", out_dir=str(tmp_path), server_command=STANDIN_CMD, startup_timeout_s=60,
        bench=BenchConfig(workload="synthetic", input_len=16, output_len=12, num_requests=2, progress=False))
    result = run_ablation(settings)
    rows = result["rows"]
    assert [r["name"] for r in rows] == ["baseline", "humming", "fp8_head", "mtp"]
    for r, cfg in zip(rows, ABLATION_CONFIGS):
        assert r["verified"] == cfg.expect
        # what the server itself said
        assert {k: v["active"] for k, v in r["report"]["optimizations"].items()} == cfg.expect
        assert r["server_exit_code"] is not None  # the server was stopped and reaped
        port = int(r["server_command"].split("--port ")[1].split()[0])
        assert port_is_free(port)
        assert (tmp_path / cfg.name / "results.json").is_file()
        assert (tmp_path / f"server_{cfg.name}.log").is_file()
        assert r["summary"]["num_ok"] == 2
    assert [r["spec_decode"] is not None for r in rows] == [False, False, False, True]
    on_disk = json.loads((tmp_path / "ablation.json").read_text())
    assert on_disk["error"] is None and len(on_disk["rows"]) == 4
    md = (tmp_path / "ablation.md").read_text()
    assert len([line for line in md.splitlines() if line.startswith("| ")]) == 1 + 4  # header + rows
    assert "+ NEXTN MTP" in md

    # Kept as a baseline: the exact commands, launch-to-ready and server facts per configuration.
    script = (tmp_path / "commands.sh").read_text()
    for r, cfg in zip(rows, ABLATION_CONFIGS):
        env = " ".join(f"{k}={v}" for k, v in cfg.env.items())
        assert f"{env} " in script and r["server_command"] in script and r["bench_command"] in script
        argv = shlex.split(r["bench_command"])
        assert argv[:3] == ["vllm-ling", "bench", "run"]
        parsed = run_parser().parse_args(argv[3:])
        again = bench_config(parsed, base_url=parsed.base_url, model=parsed.model)
        ran = json.loads((tmp_path / cfg.name / "results.json").read_text())["config"]
        for key in ("workload", "input_len", "output_len", "num_requests", "seed", "base_url", "out_dir",
                    "label", "max_tokens", "metrics_interval_s"):
            assert getattr(again, key) == ran[key], key  # the command reproduces the run
        facts = json.loads((tmp_path / cfg.name / "results.json").read_text())["server"]["facts"]
        assert facts["launch_to_ready_s"] == r["launch_to_ready_s"] > 0
        assert facts["report"]["optimizations"] == cfg.expect

    # `bench compare FOLDER`: every configuration against the baseline, saying what differed.
    out_json = tmp_path / "cmp.json"
    assert bench_main(["compare", str(tmp_path), "--json", str(out_json)]) == 0
    cmps = json.loads(out_json.read_text())["comparisons"]
    assert [c["title"] for c in cmps] == ["humming vs baseline", "fp8_head vs baseline", "mtp vs baseline"]
    differ = {d["fact"] for d in cmps[-1]["facts_differ"]}
    assert {"report.optimizations.moe_humming", "report.optimizations.fp8_head", "report.optimizations.mtp"} <= differ


def test_ablation_refuses_a_server_that_ignores_a_switch(tmp_path, capsys):
    # This server drops VLLM_LING_FP8_HEAD and so runs its default (FP8 head on) in the baseline.
    rc = bench_main(["ablation", "--model", "standin", "--server-cmd", STANDIN_CMD + " --ignore-env VLLM_LING_FP8_HEAD",
                     "--configs", "baseline,mtp", "--workload", "synthetic", "--input-len", "4", "--output-len", "3",
                     "--num-requests", "1", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "'baseline'" in err and "fp8_head: expected False, server reports True" in err
    result = json.loads((tmp_path / "ablation.json").read_text())
    assert result["rows"] == [] and "fp8_head" in result["error"]
    assert "stopped:" in (tmp_path / "ablation.md").read_text()
    assert not (tmp_path / "baseline" / "results.json").exists()  # nothing was measured


def test_compare_two_ablation_folders_config_by_config(tmp_path, capsys):
    """Measure a baseline, "upgrade" (here: the server starts ignoring a switch), compare."""
    common = ["ablation", "--model", "standin", "--configs", "mtp", "--workload", "synthetic",
              "--input-len", "4", "--output-len", "3", "--num-requests", "2", "--no-progress", "--no-plots"]
    assert bench_main([*common, "--server-cmd", STANDIN_CMD, "--out-dir", str(tmp_path / "old")]) == 0
    assert bench_main([*common, "--server-cmd", STANDIN_CMD + " --token-delay-ms 4",
                       "--out-dir", str(tmp_path / "new")]) == 0
    capsys.readouterr()
    assert bench_main(["compare", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mtp\n") and "TPOT (ms)" in out
    assert "What differed besides the numbers" in out
    assert bench_main(["compare", str(tmp_path / "old" / "mtp")]) == 2  # one results folder is not enough


def test_ablation_server_that_dies_is_reported(tmp_path):
    settings = AblationSettings(model="m", out_dir=str(tmp_path), configs=("baseline",),
                                server_command="{python} -c \"import sys; print('boom'); sys.exit(3)\"",
                                bench=BenchConfig(progress=False))
    with pytest.raises(AblationError, match=r"exited with code 3(.|\n)*boom"):
        run_ablation(settings)


def test_ablation_bad_arguments(tmp_path, capsys):
    with pytest.raises(AblationError, match="unknown configuration"):
        run_ablation(AblationSettings(model="m", out_dir=str(tmp_path), configs=("turbo",)))
    with pytest.raises(AblationError, match="cannot start the server"):
        run_ablation(AblationSettings(model="m", out_dir=str(tmp_path), configs=("baseline",),
                                      server_command="/nonexistent/server --port {port}"))
    with pytest.raises(AblationError, match="unknown placeholder"):
        run_ablation(AblationSettings(model="m", out_dir=str(tmp_path), configs=("baseline",),
                                      server_command="serve {checkpoint}"))
    with pytest.raises(SystemExit):
        bench_main(["ablation"])  # --model is required
    assert bench_main(["ablation", "--model", "m", "--concurrency", "0", "--out-dir", str(tmp_path)]) == 2


def test_check_report_rejects_missing_keys():
    cfg = AblationConfig("x", "x", {}, (), {"mtp": True})
    with pytest.raises(AblationError, match="no 'optimizations'"):
        check_report({"status": "ok"}, cfg)
    with pytest.raises(AblationError, match="mtp: expected True, server reports None"):
        check_report({"optimizations": {}}, cfg)
    assert check_report({"optimizations": {"mtp": True, "other": 1}}, cfg) == {"mtp": True}
