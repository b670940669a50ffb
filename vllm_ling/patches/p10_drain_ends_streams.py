"""Patch P10: requests still running when the drain window closes end with an error, not a hang.

What: wraps ``AsyncLLM.shutdown``: once vLLM's engine client has stopped (its requests drained,
or the EngineCore force-killed at ``--shutdown-timeout``), every request the front end still
holds unfinished gets :func:`drain_timeout_error` on its output queue, on the event loop that
owns those queues. ``AsyncLLM.generate`` re-raises it like an engine death (no abort sent to
the dead engine) and vLLM's OpenAI servers turn it into their error event plus ``[DONE]`` for
a stream (HTTP 503 otherwise), so each connection closes and the API server exits.
Why: in drain mode vLLM 0.32's EngineCore never aborts what it still runs; the process manager
kills it at the timeout and the output handler is cancelled, so those requests' queues never
receive anything: their streams hang, uvicorn waits for the connections to close forever and
the API server never exits (``vllm-ling serve`` then kills it, exit 137). Measured on a 2-core
CPU runner, where a 400-token stream outlasts the 30 s drain.
Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations

from vllm_ling.log import get_logger

logger = get_logger("shutdown")
_MARK = "_vllm_ling_drain_ends_streams"
_error_class: type | None = None


def drain_timeout_error(timeout: float | None) -> Exception:
    """The error an unfinished request gets: an ``EngineDeadError`` (so ``generate`` passes it
    on without aborting on the dead engine) that is also a ``GenerationError`` (so the OpenAI
    servers answer it as an error event, status 503, without logging a traceback)."""
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
    window = f"the drain window (--shutdown-timeout {timeout:g} s)" if timeout else "the drain window"
    return _error_class(f"the server stopped before this request finished: {window} ran out; "
                        "retry the request")


def _async_llm():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def is_applied() -> bool:
    return getattr(_async_llm().__dict__.get("shutdown"), _MARK, False)


def end_unfinished(engine, loop, timeout: float | None) -> int:
    """Deliver the drain-timeout error to every request ``engine`` still holds; how many."""
    processor = getattr(engine, "output_processor", None)
    unfinished = processor.get_num_unfinished_requests() if processor is not None else 0
    if not unfinished:
        return 0
    error = drain_timeout_error(timeout)
    logger.warning("%d request(s) still running when vLLM stopped: %s; they end with an error "
                   "(HTTP 503) instead of hanging", unfinished, str(error).partition(": ")[2])
    if loop is not None and not loop.is_closed():
        # shutdown() runs in an executor thread; the queues belong to the event loop
        loop.call_soon_threadsafe(processor.propagate_error, error)
    else:
        processor.propagate_error(error)
    return unfinished


def apply() -> None:
    async_llm = _async_llm()
    original = async_llm.shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        handler = getattr(self, "output_handler", None)
        original(self, timeout=timeout)
        try:
            end_unfinished(self, handler.get_loop() if handler is not None else None, timeout)
        except Exception:  # shutdown must finish whatever happens here
            logger.warning("could not end the requests still running at shutdown", exc_info=True)

    shutdown.__wrapped__ = original
    setattr(shutdown, _MARK, True)
    async_llm.shutdown = shutdown
