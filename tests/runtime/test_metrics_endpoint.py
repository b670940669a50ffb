"""GET /vllm_ling/report (the endpoint plugin) on a bare FastAPI app, and vLLM's gating of it."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.datastructures import State
from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

from test_stat_logger import sample_report  # same directory: the report schema's sample
from vllm_ling.runtime.report import ENV_REPORT_PATH
from vllm_ling.runtime.report_endpoint import ROUTE, ReportEndpointPlugin, make_plugin


def app_with_plugin() -> TestClient:
    plugin = make_plugin()
    assert isinstance(plugin, EndpointPlugin)  # vLLM's runtime-checkable protocol
    app = FastAPI()
    plugin.attach_router(app)
    asyncio.run(plugin.init_state(None, State(), Namespace()))
    return TestClient(app)


def test_report_route_503_until_written_then_200(monkeypatch, tmp_path):
    path = tmp_path / "report.json"
    monkeypatch.setenv(ENV_REPORT_PATH, str(path))
    client = app_with_plugin()
    missing = client.get(ROUTE)
    assert missing.status_code == 503
    assert missing.json()["report_path"] == str(path)
    assert ENV_REPORT_PATH in missing.json()["error"]

    report = sample_report()
    path.write_text(json.dumps(report))
    served = client.get(ROUTE)
    assert served.status_code == 200 and served.json() == report


def test_vllm_loads_the_endpoint_only_when_allow_listed(monkeypatch):
    from vllm import envs
    from vllm.plugins import load_endpoint_plugins

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    envs.disable_envs_cache()  # another test may have enabled it; we change VLLM_PLUGINS
    assert not [p for p in load_endpoint_plugins(("generate",)) if isinstance(p, ReportEndpointPlugin)]
    monkeypatch.setenv("VLLM_PLUGINS", "vllm_ling,vllm_ling_report")
    loaded = [p for p in load_endpoint_plugins(("generate",)) if isinstance(p, ReportEndpointPlugin)]
    assert [p.name for p in loaded] == ["vllm_ling_report"]
