"""vLLM's stderr, forwarded by ``vllm-ling serve``'s supervisor (:mod:`vllm_ling.launcher.supervisor`).

What a user reads at the end of a stop or a refusal is the launcher's last line, on a line of its
own: third-party reports that say nothing about the server, printed at interpreter exit, and the
tracebacks that follow a recorded refusal stay off the console unless ``VLLM_LOGGING_LEVEL=DEBUG``.
Standard library only.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from typing import Callable


class StderrRelay:
    """Forwards vLLM's stderr to ours, line by line, and ends it on a newline, so the launcher's
    last line stands on its own. Third-party reports printed at interpreter exit that say nothing
    about the server (Triton's nanobind reference-leak check, multiprocessing's resource tracker
    warning about leaked semaphores) are shown only at ``VLLM_LOGGING_LEVEL=DEBUG``; so are the
    tracebacks printed once ``refused()`` says a refusal was recorded (multiprocessing prints the
    engine core's failure to start, a consequence of the refusal, outside any logger: the same rule
    as :class:`vllm_ling.refusal._LogFilter`'s for logged ones). Remembers the last line that
    reports an error (vLLM's parser's ``error: ...``)."""

    NANOBIND = (b"nanobind: leaked ", b" - leaked ", b" - ... skipped remainder",
                b"nanobind: this is likely caused by a reference counting issue")
    NANOBIND_URL = b"See https://nanobind.readthedocs.io/en/latest/refleaks.html"
    RESOURCE_TRACKER = b"resource_tracker: There appear to be "

    TRACEBACK = b"Traceback (most recent call last):"
    CHAINED = (b"The above exception was the direct cause", b"During handling of the above exception")

    def __init__(self, source, show_exit_noise: bool = False, refused: Callable[[], bool] = lambda: False):
        self.source = source
        self.show_exit_noise = show_exit_noise
        self.refused = refused
        self._traceback: str | None = None  # None, "frames", or "message" (its exception line seen)
        self._held: bytes | None = None  # multiprocessing's "Process Name:" line, until we know
        self.last_error: str | None = None
        self.dropped = 0
        self._in_nanobind = False
        self._after_tracker = False
        self.thread = threading.Thread(target=self._run, name="vllm-ling-stderr", daemon=True)

    def start(self) -> "StderrRelay":
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def _is_exit_noise(self, line: bytes) -> bool:
        if line.startswith(self.NANOBIND[0]) or line.startswith(self.NANOBIND[3]):
            self._in_nanobind = True
            return True
        if self._in_nanobind and (line.startswith(self.NANOBIND[1:3]) or line.startswith(self.NANOBIND_URL)):
            return True
        self._in_nanobind = False
        if self.RESOURCE_TRACKER in line and b"leaked" in line:
            self._after_tracker = True
            return True
        after, self._after_tracker = self._after_tracker, False
        return after and line.lstrip().startswith(b"warnings.warn(")

    def _is_consequence(self, line: bytes) -> bool:
        """Part of a traceback printed after a recorded refusal."""
        if line.startswith(self.TRACEBACK):
            if self._traceback is None and not self.refused():
                return False
            self._traceback = "frames"
            return True
        if self._traceback is None:
            return False
        if line.startswith((b" ", b"\t", b"\n")) or line.startswith(self.CHAINED):
            return True
        if self._traceback == "frames":  # the exception's own line ends the frames
            self._traceback = "message"
            return True
        self._traceback = None
        return False

    def _lines(self):
        for line in iter(self.source.readline, b""):
            # nanobind's report ends without a newline: what another process writes next is glued to it
            while line.startswith(self.NANOBIND_URL) and len(line.rstrip(b"\n")) > len(self.NANOBIND_URL):
                yield self.NANOBIND_URL + b"\n"
                line = line[len(self.NANOBIND_URL):]
            yield line if line.endswith(b"\n") else line + b"\n"

    def _quiet(self, line: bytes) -> list[bytes]:
        """What of ``line`` (and a held "Process Name:" line before it) is shown."""
        held, self._held = self._held, None
        if self.show_exit_noise:
            return [x for x in (held, line) if x is not None]
        if self._is_consequence(line):
            self.dropped += 1 + (held is not None)
            return []
        if self._is_exit_noise(line):
            self.dropped += 1
            return [held] if held is not None else []
        if line.startswith(b"Process ") and line.rstrip().endswith(b":") and self._traceback is None:
            self._held = line  # multiprocessing's heading of the traceback that may follow
            return [held] if held is not None else []
        return [x for x in (held, line) if x is not None]

    def _run(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in itertools.chain(self._lines(), [None]):  # None: the end, a held line goes out
            shown = self._quiet(line) if line is not None else [self._held] if self._held else []
            for text in shown:
                self._write(out, text)

    def _write(self, out, line: bytes) -> None:
        if b"error: " in line:
            self.last_error = line.decode(errors="replace").strip()
        try:
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()
        except (OSError, ValueError):
            pass  # our stderr is gone: keep draining the pipe so vLLM never blocks on it


def non_empty(path: str | None) -> bool:
    """Whether the file at ``path`` exists and holds something."""
    try:
        return bool(path) and os.path.getsize(path) > 0
    except OSError:
        return False
