"""P10: a request still running when vLLM's drain window closes ends with an error instead of
waiting forever. vLLM's own AsyncLLM.shutdown, OutputProcessor and RequestOutputCollector run
here on a real event loop; only the EngineCore client (a process in a server) is a stand-in
whose shutdown returns, as vLLM's does once it has killed the EngineCore at the timeout. The
end-to-end case (a stream cut by SIGTERM) is the last test of tests/deploy/test_entrypoint_server.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from patch_refusal import assert_refuses_changed_source

pytest.importorskip("vllm")


@pytest.fixture
def async_llm(monkeypatch):
    """AsyncLLM with vLLM's own shutdown (restored after the test)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    upstream = AsyncLLM.__dict__["shutdown"]
    monkeypatch.setattr(AsyncLLM, "shutdown", getattr(upstream, "__wrapped__", upstream))
    return AsyncLLM


def _engine(async_llm_cls, output_processor, handler):
    engine = async_llm_cls.__new__(async_llm_cls)  # no engine processes: only what shutdown reads
    engine.engine_core = SimpleNamespace(shutdown=lambda timeout=None: None)
    engine.output_processor = output_processor
    engine.output_handler = handler
    return engine


def _stop_with_one_request_running(async_llm_cls, timeout=8.0, handler_sees_death=False):
    """One request waiting on its queue; shutdown() from an executor thread, as vLLM's API
    server calls it. With ``handler_sees_death`` the output handler notices the killed
    EngineCore while the engine client stops (vLLM's ``propagate_error(EngineDeadError())``
    on the loop, before the handler is cancelled), as it sometimes does on a 2-core runner.
    What the waiting request got within 2 s (None: still waiting)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    async def scenario():
        processor = OutputProcessor(None, log_stats=False)
        queue = RequestOutputCollector(RequestOutputKind.DELTA, "req-1")
        processor.request_states["req-1"] = SimpleNamespace(queue=queue)
        loop = asyncio.get_running_loop()
        handler = loop.create_task(asyncio.sleep(3600))  # the output handler
        engine = _engine(async_llm_cls, processor, handler)
        if handler_sees_death:
            import time

            from vllm.v1.engine.exceptions import EngineDeadError

            def client_shutdown(timeout=None):
                loop.call_soon_threadsafe(lambda: engine.output_processor.propagate_error(EngineDeadError()))
                time.sleep(0.2)  # the kill and the handler's reaction, before shutdown returns

            engine.engine_core = SimpleNamespace(shutdown=client_shutdown)
        waiting = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, lambda: engine.shutdown(timeout=timeout))
        done, _ = await asyncio.wait({waiting}, timeout=2)
        waiting.cancel()
        # AsyncLLM.__del__ calls shutdown again at garbage collection, after this loop closed
        engine.engine_core = SimpleNamespace(shutdown=lambda timeout=None: None)
        return waiting.exception() if done else None

    return asyncio.run(scenario())


def test_the_request_hangs_without_p10(async_llm):
    from vllm_ling.patches import p10_drain_ends_streams as p10

    assert not p10.is_applied()
    assert _stop_with_one_request_running(async_llm) is None


def test_p10_ends_the_request_with_a_503_engine_dead_error(async_llm):
    from vllm.exceptions import GenerationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_ling.patches import p10_drain_ends_streams as p10
    from vllm_ling.patches.registry import apply_all

    assert "P10 drain-timeout-ends-streams" in apply_all("register", ids=("P10",))
    assert p10.is_applied()
    error = _stop_with_one_request_running(async_llm, timeout=8.0)
    # EngineDeadError: AsyncLLM.generate re-raises it without aborting on the dead engine;
    # GenerationError: the OpenAI servers answer it as an error event, no traceback logged
    assert isinstance(error, EngineDeadError) and isinstance(error, GenerationError), repr(error)
    assert error.status_code == 503
    assert "--shutdown-timeout 8 s" in str(error)


def test_an_engine_death_seen_during_shutdown_is_answered_as_the_drain_timeout(async_llm):
    """Without P10 the request gets vLLM's bare EngineDeadError (HTTP 500 "EngineCore encountered
    an issue"); with it, the drain-timeout error naming the window."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_ling.patches import p10_drain_ends_streams as p10
    from vllm_ling.patches.registry import apply_all

    bare = _stop_with_one_request_running(async_llm, handler_sees_death=True)
    assert type(bare) is EngineDeadError, repr(bare)
    apply_all("register", ids=("P10",))
    error = _stop_with_one_request_running(async_llm, timeout=8.0, handler_sees_death=True)
    assert isinstance(error, p10.drain_timeout_error_class()), repr(error)
    assert "--shutdown-timeout 8 s" in str(error)


def test_other_errors_during_shutdown_pass_through(async_llm):
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.sampling_params import RequestOutputKind

    from vllm_ling.patches import p10_drain_ends_streams as p10

    processor = OutputProcessor(None, log_stats=False)
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "req-1")
    processor.request_states["req-1"] = SimpleNamespace(queue=queue)
    p10._answer_engine_death_as_drain_timeout(processor, 8.0)
    processor.propagate_error(ValueError("a real bug"))
    got = queue.output  # what the waiting generate() would receive
    assert isinstance(got, ValueError) and str(got) == "a real bug"


def test_p10_leaves_a_drained_shutdown_alone(async_llm):
    """Nothing unfinished (the drain completed): nothing is delivered, nothing logged."""
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_ling.patches import p10_drain_ends_streams as p10

    assert p10.end_unfinished(SimpleNamespace(output_processor=OutputProcessor(None, log_stats=False)),
                              None, 30.0) == 0


def test_p10_refuses_a_changed_upstream_method(async_llm, monkeypatch):
    from vllm_ling.patches import p10_drain_ends_streams as p10

    assert_refuses_changed_source(monkeypatch, "P10", lambda: not p10.is_applied())
