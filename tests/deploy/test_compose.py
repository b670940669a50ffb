"""docker/compose.yaml: structure, referenced files, and Docker Compose's own validation
(`docker compose config` needs no Docker engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ._tools import DOCKER_DIR, MONITORING_DIR, REPO, find_tool, run

COMPOSE = DOCKER_DIR / "compose.yaml"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def compose_config(*args, env=None):
    import os

    binary = find_tool("docker-compose")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "VLLM_LING_"))}
    clean.update(env or {})
    return run([binary, "-f", str(COMPOSE), *args], env=clean, cwd=DOCKER_DIR)


def test_services_profiles_and_monitoring(compose):
    services = compose["services"]
    assert {"vllm-ling", "prometheus", "grafana", "vllm-ling-cpu"} <= set(services)
    assert services["vllm-ling"]["profiles"] == ["gpu"]
    assert services["vllm-ling-cpu"]["profiles"] == ["cpu"]
    assert "profiles" not in services["prometheus"] and "profiles" not in services["grafana"]
    # Both servers answer as vllm-ling:8000, the target of the scrape config.
    assert "vllm-ling" in services["vllm-ling-cpu"]["networks"]["default"]["aliases"]
    scrape = yaml.safe_load((MONITORING_DIR / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    assert "vllm-ling:8000" in targets


def test_gpu_service_runtime_settings(compose):
    svc = compose["services"]["vllm-ling"]
    assert "ipc" not in svc and svc["shm_size"]  # /dev/shm of its own, not the host's IPC
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "/health" in " ".join(svc["healthcheck"]["test"])
    assert svc["depends_on"]["vllm-ling-warmup"]["condition"] == "service_completed_successfully"
    warmup = compose["services"]["vllm-ling-warmup"]
    assert warmup["entrypoint"] == ["vllm-ling", "warmup"]
    cache = {v.split(":")[0]: v.split(":")[1] for v in svc["volumes"]}
    assert cache["humming-cache"] == "/cache/humming"
    assert "humming-cache:/cache/humming" in warmup["volumes"]


def test_cpu_profile_serves_the_tiny_checkpoint(compose):
    svc = compose["services"]["vllm-ling-cpu"]
    assert svc["command"][:3] == ["/models/tiny", "--device", "cpu"]
    tiny = compose["services"]["tiny-checkpoint"]
    assert tiny["entrypoint"] == ["vllm-ling", "make-tiny"] and tiny["command"][0] == "/models/tiny"
    assert "cpu" in tiny["build"]["args"]["VLLM_IMAGE"]
    assert "/health" in " ".join(svc["healthcheck"]["test"])


def test_named_volumes_declared_and_bind_mounts_exist(compose):
    declared = set(compose["volumes"])
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith(("/", ".", "$")):
                if source.startswith("$"):  # ${VLLM_LING_MODELS_DIR:-./models}: user data
                    continue
                assert (DOCKER_DIR / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            assert (DOCKER_DIR / build["context"] / build["dockerfile"]).is_file()


def test_monitoring_mounts_are_the_charts_files(compose):
    """One copy: Prometheus and Grafana mount the chart's files/, whose rule file is named
    relative to the scrape config (resolved under /etc/prometheus in the container)."""
    mounts = {name: {v.split(":")[1]: (DOCKER_DIR / v.split(":")[0]).resolve()
                     for v in compose["services"][name]["volumes"] if v.startswith(".")}
              for name in ("prometheus", "grafana")}
    assert mounts["prometheus"]["/etc/prometheus"] == MONITORING_DIR / "prometheus"
    assert mounts["grafana"]["/var/lib/grafana/dashboards"] == MONITORING_DIR / "dashboards"
    prometheus = yaml.safe_load((MONITORING_DIR / "prometheus" / "prometheus.yml").read_text())
    for rule_file in prometheus["rule_files"]:
        assert not Path(rule_file).is_absolute()
        assert (MONITORING_DIR / "prometheus" / rule_file).is_file()
    assert not (REPO / "deploy").exists(), "a second copy of the monitoring files is back"
    provisioning = mounts["grafana"]["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "vllm-ling.yml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert list((MONITORING_DIR / "dashboards").glob("*.json"))
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasources[0]["url"] == "http://prometheus:9090"


def test_alert_rules_cover_the_three_conditions():
    rules = [r for g in yaml.safe_load((MONITORING_DIR / "prometheus" / "alerts.yml").read_text())["groups"]
             for r in g["rules"]]
    exprs = " ".join(r["expr"] for r in rules)
    assert "vllm_ling:optimization_active == 0" in exprs
    assert "increase(vllm_ling:accept_collapse_total[5m]) > 0" in exprs
    assert "up{" in exprs and "== 0" in exprs


def test_only_the_gateway_is_public_and_it_forwards_v1_only(compose):
    """vLLM answers /invocations (inference without the API key), /metrics, /tokenize, ...:
    no vLLM container publishes a port; the gateway forwards /v1 and /health, 404 otherwise;
    monitoring UIs bind 127.0.0.1."""
    services = compose["services"]
    for name in ("vllm-ling", "vllm-ling-cpu", "vllm-ling-warmup", "tiny-checkpoint"):
        assert "ports" not in services[name], name
    for name in ("prometheus", "grafana"):
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    gateway = services["gateway"]
    assert [str(p).split(":")[-1] for p in gateway["ports"]] == ["8080"]
    conf_path = gateway["volumes"][0].split(":")[0]
    conf = (DOCKER_DIR / conf_path).read_text()
    locations = re.findall(r"location\s+(=?\s*\S+)\s*\{([^}]*)\}", conf)
    routes = {path.replace(" ", ""): body for path, body in locations}
    assert set(routes) == {"/v1/", "=/health", "/"}
    assert "proxy_pass" in routes["/v1/"] and "proxy_pass" in routes["=/health"]
    assert "return 404" in routes["/"]
    assert "http://vllm-ling:8000" in conf


def test_no_secret_in_the_compose_file(compose):
    for svc in compose["services"].values():
        env = svc.get("environment", {})
        for key, value in (env.items() if isinstance(env, dict) else []):
            if key.endswith("__FILE"):  # a path inside the container, not a secret
                continue
            if "KEY" in key or "PASSWORD" in key:
                assert str(value).startswith("${"), f"{key} must come from the caller's environment"


@pytest.mark.parametrize("profile,expected", [
    (None, {"vllm-ling-warmup", "vllm-ling", "gateway", "prometheus", "grafana", "grafana-password"}),
    ("cpu", {"tiny-checkpoint", "vllm-ling-cpu", "gateway", "prometheus", "grafana", "grafana-password"}),
])
def test_docker_compose_config_validates(profile, expected):
    args = ["--profile", profile] if profile else []
    result = compose_config(*args, "config", "--quiet")
    assert result.returncode == 0, result.stderr
    services = compose_config(*args, "config", "--services")
    assert set(services.stdout.split()) == expected


def test_docker_compose_config_rejects_a_broken_file(tmp_path):
    """The validator must catch errors (here: an undeclared named volume)."""
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["prometheus"]["volumes"].append("not-declared:/data")
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    binary = find_tool("docker-compose")
    result = run([binary, "-f", str(path), "--project-directory", str(DOCKER_DIR), "config", "--quiet"])
    assert result.returncode != 0
    assert "not-declared" in result.stderr


def test_servers_get_the_ling3_parsers(compose):
    for name in ("vllm-ling", "vllm-ling-cpu"):
        env = compose["services"][name]["environment"]
        assert env["VLLM_LING_TOOL_CALL_PARSER"] == "${VLLM_LING_TOOL_CALL_PARSER:-ling3}", name
        assert env["VLLM_LING_REASONING_PARSER"] == "${VLLM_LING_REASONING_PARSER:-ling3}", name


def rendered(profile: str, env: dict | None = None) -> dict:
    result = compose_config("--profile", profile, "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    import json

    return json.loads(result.stdout)["services"]


@pytest.mark.parametrize("profile,server", [("gpu", "vllm-ling"), ("cpu", "vllm-ling-cpu")])
def test_safe_defaults_as_compose_renders_them(profile, server):
    """What `docker compose config` resolves with nothing set in the caller's environment."""
    services = rendered(profile, env={"VLLM_API_KEY": "", "GRAFANA_ADMIN_PASSWORD": ""})
    # The gateway listens on loopback only.
    assert [(p["host_ip"], p["published"]) for p in services["gateway"]["ports"]] == [("127.0.0.1", "8000")]
    # No key: the server refuses to start unless the operator opts out explicitly.
    assert services[server]["environment"]["VLLM_LING_ALLOW_NO_API_KEY"] == "0"
    # Grafana: never an empty admin password (which means admin/admin), no anonymous viewer.
    grafana = services["grafana"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
    password_file = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    assert grafana["depends_on"]["grafana-password"]["condition"] == "service_completed_successfully"
    assert password_file in " ".join(services["grafana-password"]["command"])
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    # The chart's container hardening and a restart policy that acts on failure.
    svc = services[server]
    assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"]
    assert svc["read_only"] is True and "/tmp" in svc["tmpfs"]
    assert svc["restart"] == "on-failure"
    assert any(v["target"] == "/cache/vllm" for v in svc["volumes"])  # the report's directory


def test_bind_address_and_opt_outs_come_from_the_environment():
    services = rendered("cpu", env={"VLLM_LING_BIND_ADDRESS": "0.0.0.0", "VLLM_LING_ALLOW_NO_API_KEY": "1",
                                    "GRAFANA_ANONYMOUS": "true", "GRAFANA_ADMIN_PASSWORD": "s3cret"})
    assert services["gateway"]["ports"][0]["host_ip"] == "0.0.0.0"
    assert services["vllm-ling-cpu"]["environment"]["VLLM_LING_ALLOW_NO_API_KEY"] == "1"
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert services["grafana-password"]["environment"]["GRAFANA_ADMIN_PASSWORD"] == "s3cret"


def test_grafana_password_step_generates_once_or_takes_the_environment(tmp_path):
    """The one-shot's script, run by sh against a temporary directory."""
    import os
    import stat
    import subprocess

    services = rendered("cpu", env={"GRAFANA_ADMIN_PASSWORD": ""})
    script = services["grafana-password"]["command"][0].replace("/var/lib/grafana", str(tmp_path))
    script = script.replace("$$", "$")  # compose's escape for a literal $
    env = {"PATH": os.environ["PATH"]}

    def run_step(password=""):
        result = subprocess.run(["sh", "-c", script], env={**env, "GRAFANA_ADMIN_PASSWORD": password},
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = run_step()
    secret = (tmp_path / "admin-password").read_text()
    assert len(secret) >= 16 and secret != "admin" and f"(shown once): {secret}" in first
    assert stat.S_IMODE((tmp_path / "admin-password").stat().st_mode) == 0o600
    again = run_step()
    assert secret not in again and (tmp_path / "admin-password").read_text() == secret
    run_step("chosen-password")
    assert (tmp_path / "admin-password").read_text() == "chosen-password"
