"""Patch P10: requests still running when the drain window closes end with an error, not a hang.

What: wraps ``AsyncLLM.shutdown``: once vLLM's engine client has stopped (its requests drained,
or the EngineCore force-killed at ``--shutdown-timeout``), every request the front end still
holds unfinished gets :func:`drain_timeout_error` on its output queue, on the event loop that
owns those queues. ``AsyncLLM.generate`` re-raises it like an engine death (no abort sent to
the dead engine) and vLLM's OpenAI servers turn it into their error event plus ``[DONE]`` for
a stream (HTTP 503 otherwise), so each connection closes and the API server exits.
While the engine client stops, an engine death the output handler sees (it can notice the
killed EngineCore before it is cancelled) is answered with the same error instead of vLLM's
"EngineCore encountered an issue" (HTTP 500), which would blame a crash for a planned stop.
Why: in drain mode vLLM 0.32's EngineCore never aborts what it still runs; the process manager
kills it at the timeout and the output handler is cancelled, so those requests' queues never
receive anything: their streams hang, uvicorn waits for the connections to close forever and
the API server never exits (``vllm-ling serve`` then kills it, exit 137). Measured on a 2-core
CPU runner, where a 400-token stream outlasts the 30 s drain; on the same runner the output
handler sometimes wins the race and the stream ended with a 500 blaming an engine crash.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

import sys

from vllm_ling.log import get_logger

logger = get_logger("shutdown")
_MARK = "_vllm_ling_drain_ends_streams"
_error_class: type | None = None


def drain_timeout_error_class() -> type:
    """``DrainTimeoutError``: an ``EngineDeadError`` (so ``generate`` passes it on without
    aborting on the dead engine) that is also a ``GenerationError`` (so the OpenAI servers
    answer it as an error event, status 503, without logging a traceback)."""
    global _error_class
    if _error_class is None:
        from http import HTTPStatus

        from vllm.exceptions import GenerationError
        from vllm.v1.engine.exceptions import EngineDeadError

        class DrainTimeoutError(EngineDeadError, GenerationError):
            def __init__(self, message: str):
                Exception.__init__(self, message)
                self.status_code = HTTPStatus.SERVICE_UNAVAILABLE

        _error_class = DrainTimeoutError
    return _error_class


def drain_timeout_error(timeout: float | None) -> Exception:
    """The error an unfinished request gets, naming the drain window that ran out."""
    window = f"the drain window (--shutdown-timeout {timeout:g} s)" if timeout else "the drain window"
    return drain_timeout_error_class()(
        f"the server stopped before this request finished: {window} ran out; retry the request")


def _async_llm():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def is_applied() -> bool:
    return getattr(_async_llm().__dict__.get("shutdown"), _MARK, False)


def _deliver(processor, timeout: float | None) -> int:
    """Put the drain-timeout error on every unfinished request's queue (on the loop that owns
    them); how many. Logged once per shutdown, whichever path delivers first."""
    unfinished = processor.get_num_unfinished_requests()
    if not unfinished or getattr(processor, _MARK, False):
        return 0
    setattr(processor, _MARK, True)
    error = drain_timeout_error(timeout)
    logger.warning("%d request(s) still running when vLLM stopped: %s; they end with an error "
                   "(HTTP 503) instead of hanging", unfinished, str(error).partition(": ")[2])
    type(processor).propagate_error(processor, error)
    return unfinished


def end_unfinished(engine, loop, timeout: float | None) -> int:
    """Deliver the drain-timeout error to every request ``engine`` still holds; how many."""
    processor = getattr(engine, "output_processor", None)
    unfinished = processor.get_num_unfinished_requests() if processor is not None else 0
    if not unfinished or getattr(processor, _MARK, False):
        return 0
    if loop is not None and not loop.is_closed():
        # shutdown() runs in an executor thread; the queues belong to the event loop
        loop.call_soon_threadsafe(_deliver, processor, timeout)
    else:
        _deliver(processor, timeout)
    return unfinished


def _answer_engine_death_as_drain_timeout(processor, timeout: float | None) -> None:
    """While the engine client stops, the output handler's ``propagate_error(EngineDeadError)``
    (the killed EngineCore noticed before the handler is cancelled) delivers the drain-timeout
    error instead; any other error passes through unchanged."""
    from vllm.v1.engine.exceptions import EngineDeadError

    upstream = type(processor).propagate_error

    def propagate_error(error: Exception) -> None:
        if isinstance(error, EngineDeadError) and not isinstance(error, drain_timeout_error_class()):
            _deliver(processor, timeout)
        else:
            upstream(processor, error)

    processor.propagate_error = propagate_error  # this instance, for the rest of its life


def apply() -> None:
    async_llm = _async_llm()
    original = async_llm.shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        if sys.is_finalizing():  # AsyncLLM.__del__ at interpreter exit: no request is left to answer
            return original(self, timeout=timeout)
        handler = getattr(self, "output_handler", None)
        processor = getattr(self, "output_processor", None)
        try:
            if processor is not None:
                _answer_engine_death_as_drain_timeout(processor, timeout)
        except Exception:  # shutdown must go on; the hang fix below still holds
            logger.warning("could not watch for the engine's death during shutdown", exc_info=True)
        original(self, timeout=timeout)
        try:
            end_unfinished(self, handler.get_loop() if handler is not None else None, timeout)
        except Exception:  # shutdown must finish whatever happens here
            logger.warning("could not end the requests still running at shutdown", exc_info=True)

    shutdown.__wrapped__ = original
    setattr(shutdown, _MARK, True)
    async_llm.shutdown = shutdown
