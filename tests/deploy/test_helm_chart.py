"""helm/vllm-ling rendered by the real Helm for the main value combinations; every manifest
validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict); the CRD
objects (LeaderWorkerSet, ServiceMonitor, PrometheusRule) checked structurally, with their
embedded pod templates validated as Pods; bad values must fail the render."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from ._tools import CHART_DIR, MONITORING_DIR, find_tool, run

# The chart's minimum (Chart.yaml kubeVersion) and the newest schemas the validator ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PrometheusRule"}

COMBINATIONS = {
    "single-default": [],
    "single-monitoring": ["--set", "metrics.serviceMonitor.enabled=true",
                          "--set", "metrics.prometheusRule.enabled=true",
                          "--set", "metrics.dashboards.enabled=true",
                          "--set", "ingress.enabled=true", "--set", "ingress.host=ling.example.com"],
    "single-2gpu-no-warmup-no-key": ["--set", "single.gpus=2", "--set", "warmup.enabled=false",
                                     "--set", "apiKey.enabled=false",
                                     "--set", "networkPolicy.enabled=false",
                                     "--set", "podDisruptionBudget.enabled=false",
                                     "--set", "storage.hummingCache.type=emptyDir"],
    "multinode-tcp": ["--set", "mode=multinode", "--set", "storage.models.accessModes={ReadOnlyMany}",
                      "--set", "storage.hummingCache.type=emptyDir"],
    "multinode-rdma-monitoring": ["-f", str(CHART_DIR / "values-two-sparks.yaml"),
                                  "--set", "metrics.dashboards.enabled=true"],
    "multinode-pp": ["--set", "mode=multinode", "--set", "multinode.nodes=4",
                     "--set", "multinode.tensorParallelSize=2", "--set", "multinode.pipelineParallelSize=2",
                     "--set", "storage.models.type=hostPath", "--set", "storage.hummingCache.type=hostPath",
                     "--set", "replicas=2"],
    "single-3-replicas-pinned": ["--set", "replicas=3", "--set", "image.digest=sha256:" + "ab" * 32,
                                 "--set", "serving.shutdownTimeout=120"],
}


def helm(*args):
    return run([find_tool("helm", "HELM"), *args])


def render(extra: list[str]) -> list[dict]:
    result = helm("template", "ling", str(CHART_DIR), "--namespace", "serving", *extra)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def rendered():
    return {name: render(args) for name, args in COMBINATIONS.items()}


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs):
    """(name, pod spec) of every pod the release creates, CRD templates included."""
    specs = []
    for d in docs:
        if d["kind"] == "Deployment":
            specs.append((d["metadata"]["name"], d["spec"]["template"]))
        if d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            specs.append((d["metadata"]["name"] + "-leader", lwt["leaderTemplate"]))
            specs.append((d["metadata"]["name"] + "-worker", lwt["workerTemplate"]))
    return specs


def test_helm_lint_strict():
    for extra in ([], ["-f", str(CHART_DIR / "values-two-sparks.yaml")]):
        result = helm("lint", "--strict", str(CHART_DIR), *extra)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("combination", COMBINATIONS)
@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_manifest_validates_against_kubernetes_schemas(rendered, combination, k8s_version):
    docs = rendered[combination]
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, k8s_version, strict=True)
    # The pod templates inside the LeaderWorkerSet are core PodTemplateSpecs: validate them as Pods.
    for name, template in pod_specs(docs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, k8s_version, strict=True)


def test_validator_rejects_a_bad_manifest(rendered):
    """kubernetes-validate must catch errors, so the test above cannot pass vacuously."""
    deployment = json.loads(json.dumps(by_kind(rendered["single-default"], "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    deployment["spec"]["replicass"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_workload_kind_per_mode(rendered):
    assert len(by_kind(rendered["single-default"], "Deployment")) == 1
    assert not by_kind(rendered["single-default"], "LeaderWorkerSet")
    for name in ("multinode-tcp", "multinode-rdma-monitoring", "multinode-pp"):
        assert not by_kind(rendered[name], "Deployment")
        (lws,) = by_kind(rendered[name], "LeaderWorkerSet")
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert lws["spec"]["startupPolicy"] in ("LeaderCreated", "LeaderReady")
        assert set(lwt) <= {"size", "leaderTemplate", "workerTemplate", "restartPolicy",
                            "subGroupPolicy", "volumeClaimTemplates"}  # LWS v1 field names
        assert isinstance(lwt["size"], int) and lwt["size"] >= 2
    lws = by_kind(rendered["multinode-pp"], "LeaderWorkerSet")[0]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4 and lws["spec"]["replicas"] == 2


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_multinode_leader_runs_ray_head_and_vllm_with_parallel_sizes(rendered):
    lws = by_kind(rendered["multinode-pp"], "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]
    leader = lws["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["workerTemplate"]["spec"]["containers"][0]
    assert leader["command"][:2] == ["vllm-ling-ray", "head"] and "--nodes=4" in leader["command"]
    assert worker["command"][:2] == ["vllm-ling-ray", "worker"]
    assert any("$(LWS_LEADER_ADDRESS)" in a for a in worker["command"])
    env = env_of(leader)
    assert env["VLLM_LING_TENSOR_PARALLEL_SIZE"] == "2" and env["VLLM_LING_PIPELINE_PARALLEL_SIZE"] == "2"
    assert "ports" not in worker  # workers serve nothing; only the leader is behind the Service
    assert lws["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    assert lws["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-worker"


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_restricted_pod_security(rendered, combination):
    rdma = combination == "multinode-rdma-monitoring"
    for name, template in pod_specs(rendered[combination]):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma else []), name
            limits = container["resources"]["limits"]
            assert ("rdma/rdma_shared_device_a" in limits) == rdma, name
        assert spec.get("hostNetwork", False) == rdma, name  # values-two-sparks.yaml sets it


def test_probes_cover_model_load_and_jit(rendered):
    container = by_kind(rendered["single-default"], "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    init = by_kind(rendered["single-default"], "Deployment")[0]["spec"]["template"]["spec"]["initContainers"]
    assert init[0]["command"] == ["vllm-ling", "warmup"]
    assert "initContainers" not in by_kind(rendered["single-2gpu-no-warmup-no-key"], "Deployment")[0][
        "spec"]["template"]["spec"]


def test_api_key_comes_from_a_secret_and_no_secret_is_rendered(rendered):
    for combination, docs in rendered.items():
        assert not by_kind(docs, "Secret"), combination
    container = by_kind(rendered["single-default"], "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    key = env_of(container)["VLLM_API_KEY"]
    assert key == {"secretKeyRef": {"name": "vllm-ling-api-key", "key": "api-key"}}
    no_key = by_kind(rendered["single-2gpu-no-warmup-no-key"], "Deployment")[0]["spec"]["template"]["spec"]
    assert "VLLM_API_KEY" not in env_of(no_key["containers"][0])
    # Without a key the chart says so explicitly, or vllm-ling serve would refuse to start.
    assert env_of(no_key["containers"][0])["VLLM_LING_ALLOW_NO_API_KEY"] == "1"
    assert "VLLM_LING_ALLOW_NO_API_KEY" not in env_of(container)


def test_pvcs_and_pdb(rendered):
    claims = {d["metadata"]["name"] for d in by_kind(rendered["single-default"], "PersistentVolumeClaim")}
    assert claims == {"ling-vllm-ling-models", "ling-vllm-ling-humming-cache"}
    volumes = {v["name"]: v for v in by_kind(rendered["single-default"], "Deployment")[0]["spec"][
        "template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "ling-vllm-ling-models"
    assert volumes["humming-cache"]["persistentVolumeClaim"]["claimName"] == "ling-vllm-ling-humming-cache"
    assert not by_kind(rendered["multinode-pp"], "PersistentVolumeClaim")


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_pdb_only_for_several_replicas_and_covering_every_pod_of_a_group(rendered):
    # One replica: a budget would either block node drains or protect nothing.
    assert not by_kind(rendered["single-default"], "PodDisruptionBudget")
    assert not by_kind(rendered["multinode-tcp"], "PodDisruptionBudget")
    (pdb,) = by_kind(rendered["single-3-replicas-pinned"], "PodDisruptionBudget")
    service = by_kind(rendered["single-3-replicas-pinned"], "Service")[0]
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    # Two groups of four pods: one pod (one group) down at a time, Ray workers included.
    (pdb,) = by_kind(rendered["multinode-pp"], "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    pods = pod_specs(rendered["multinode-pp"])
    assert {name.rsplit("-", 1)[1] for name, _ in pods} == {"leader", "worker"}
    for name, template in pods:
        assert _matches(pdb["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]), name


def test_grace_period_and_prestop_follow_the_shutdown_timeout(rendered):
    """terminationGracePeriodSeconds = preStop pause + vLLM's drain + the launcher's 30 s
    teardown allowance; the server gets the drain time as VLLM_LING_SHUTDOWN_TIMEOUT."""
    from vllm_ling.launcher.supervisor import TEARDOWN_MARGIN_S

    for combination, drain in (("single-default", 30), ("single-3-replicas-pinned", 120),
                               ("multinode-tcp", 30)):
        for name, template in pod_specs(rendered[combination]):
            spec = template["spec"]
            assert spec["terminationGracePeriodSeconds"] == 5 + drain + TEARDOWN_MARGIN_S, name
            server = spec["containers"][0]
            env = {e["name"]: e.get("value") for e in server.get("env", [])}
            if name.endswith("-worker"):
                continue
            assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
            assert env["VLLM_LING_SHUTDOWN_TIMEOUT"] == str(drain)


def test_image_digest_pins_every_container(rendered):
    for combination, pinned in (("single-default", False), ("single-3-replicas-pinned", True),
                                ("multinode-pp", False)):
        for name, template in pod_specs(rendered[combination]):
            spec = template["spec"]
            for container in spec["containers"] + spec.get("initContainers", []):
                expected = "vllm-ling:0.1.0" + ("@sha256:" + "ab" * 32 if pinned else "")
                assert container["image"] == expected, (combination, name)


def test_service_monitor_selects_the_service_port(rendered):
    docs = rendered["single-monitoring"]
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (service,) = by_kind(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    # job="vllm-ling", as the alert rules expect
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "vllm-ling"
    assert not by_kind(rendered["single-default"], "ServiceMonitor")


def test_prometheus_rule_carries_the_alerts_unchanged(rendered):
    (rule,) = by_kind(rendered["single-monitoring"], "PrometheusRule")
    source = yaml.safe_load((MONITORING_DIR / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert set(r) >= {"alert", "expr"}
    assert not by_kind(rendered["single-default"], "PrometheusRule")


def test_dashboards_configmap_carries_the_dashboards(rendered):
    (cm,) = [d for d in by_kind(rendered["single-monitoring"], "ConfigMap")
             if d["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    sources = {p.name: json.loads(p.read_text()) for p in (MONITORING_DIR / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in cm["data"].items()} == sources


def test_network_policy_and_ingress_keep_unauthenticated_paths_inside(rendered):
    docs = rendered["single-monitoring"]
    (policy,) = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert "ipBlock" not in peer  # no address range outside the cluster is admitted
    (ingress,) = by_kind(docs, "Ingress")
    paths = [p["path"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]]
    assert paths == ["/v1"]


@pytest.mark.parametrize("args,message", [
    (["--set", "mode=multinode", "--set", "multinode.nodes=1"], "minimum"),
    (["--set", "mode=cluster"], "mode"),
    (["--set", "optimizations.verify=loose"], "verify"),
    (["--set", "replicaz=2"], "replicaz"),
    (["--set", "serving.gpuMemoryUtilization=1.5"], "gpuMemoryUtilization"),
    (["--set", "mode=multinode", "--set", "storage.models.accessModes={ReadOnlyMany}",
      "--set", "storage.hummingCache.type=emptyDir", "--set", "multinode.tensorParallelSize=4"],
     "must equal multinode.nodes"),
    (["--set", "mode=multinode"], "ReadWriteOnce models claim"),
    (["--set", "mode=multinode", "--set", "storage.models.type=hostPath"], "humming cache"),
    (["--set", "apiKey.existingSecret="], "apiKey.existingSecret"),
    (["--set", "multinode.rdma.enabled=true"], "only applies to mode=multinode"),
    (["--set", "ingress.enabled=true"], "ingress.host"),
    (["--set", "image.digest=latest"], "digest"),
    (["--set", "mode=multinode", "--set", "storage.models.type=hostPath", "--set",
      "storage.hummingCache.type=hostPath", "--set", "multinode.rayAuth.existingSecret="],
     "multinode.rayAuth.existingSecret"),
])
def test_bad_values_fail_the_render(args, message):
    result = helm("template", "ling", str(CHART_DIR), *args)
    assert result.returncode != 0, f"render succeeded with {args}"
    assert message in result.stderr, result.stderr


# The leader and worker commands the chart renders run for real, against a real two-node Ray
# cluster, in tests/deploy/test_ray_two_nodes.py.


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_servers_get_the_ling3_parsers(rendered, combination):
    """Every server pod runs `vllm-ling serve` with Ling-3's parsers (it adds --enable-auto-tool-choice)."""
    for name, pod in pod_specs(rendered[combination]):
        if name.endswith("-worker"):
            continue  # Ray workers serve nothing
        env = env_of(pod["spec"]["containers"][0])
        assert (env["VLLM_LING_TOOL_CALL_PARSER"], env["VLLM_LING_REASONING_PARSER"]) == ("ling3", "ling3"), name


def test_ray_token_auth_on_every_pod_of_a_group(rendered):
    """Ray's GCS runs code for anyone who reaches it; with token auth (Ray >= 2.52) every Ray
    node of the group gets RAY_AUTH_MODE=token and the token from the Secret."""
    for name, template in pod_specs(rendered["multinode-tcp"]):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "vllm-ling-ray-token", "key": "token"}, name
    for name, template in pod_specs(rendered["single-default"]):
        assert "RAY_AUTH_MODE" not in {e["name"] for e in template["spec"]["containers"][0]["env"]}
