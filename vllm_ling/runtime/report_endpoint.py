"""``GET /vllm_ling/report``: the startup verification report over HTTP (a vLLM endpoint plugin).

Entry point ``vllm.endpoint_plugins: vllm_ling_report``. vLLM 0.32 loads endpoint plugins
only when ``VLLM_PLUGINS`` names them, and ``VLLM_PLUGINS`` is then an allow-list for
*every* plugin group (general, stat logger, endpoint), so enable it with all of ours::

    VLLM_PLUGINS=vllm_ling,vllm_ling_report vllm serve ...

(``vllm-ling serve`` sets that for you.) The route answers 200 with the report JSON, or
503 with ``{"error": ..., "report_path": ...}`` while the workers have not written it yet.
Its ``init_state`` (API-server process, serving state built) also runs the chat template /
parser round-trip check (``vllm_ling.runtime.chat_roundtrip``), and ``attach_router`` adds the
middleware that refuses new requests with 503 while a requested stop drains
(``vllm_ling.runtime.clean_stop``).
"""

from __future__ import annotations

from argparse import Namespace

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from vllm_ling.runtime.report import ENV_REPORT_PATH, ReportReader

ROUTE = "/vllm_ling/report"


class ReportEndpointPlugin:
    """Satisfies vLLM's ``EndpointPlugin`` protocol; reads the report file, nothing else."""

    name = "vllm_ling_report"
    required_tasks = None  # no engine access needed

    def __init__(self) -> None:
        self.reader: ReportReader | None = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(ROUTE, self.get_report, methods=["GET"],
                          summary="vllm-ling startup verification report")
        # requests that arrive while a requested stop drains: 503 with the reason, not vLLM's 500
        from vllm_ling.runtime.clean_stop import RefuseWhileStopping

        app.add_middleware(RefuseWhileStopping)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        # Created here, in the API-server process, so its staleness cut-off is this server's start.
        self.reader = ReportReader()
        # vLLM has built its chat renderer and parsers: prove they agree before serving.
        from vllm_ling.runtime.chat_roundtrip import check_at_startup

        check_at_startup(state, args)

    async def get_report(self) -> JSONResponse:
        if self.reader is None:
            self.reader = ReportReader()
        report = self.reader.read()
        if report is None:
            return JSONResponse(status_code=503, content={
                "error": "the vllm-ling verification report has not been written yet "
                         "(it appears once the workers have loaded the model), or "
                         f"{ENV_REPORT_PATH} is unset",
                "report_path": self.reader.path,
            })
        return JSONResponse(content=report)


def make_plugin() -> ReportEndpointPlugin:
    return ReportEndpointPlugin()
