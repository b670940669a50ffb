"""How a layer's selection is said in the log, once per process: the optimization serving, one INFO; opted
out, one WARNING; a fallback, one WARNING per reason; nothing on the CPU platform (where the feature does not
apply) nor where another switch decided it (that switch says so). The startup report says the same per layer."""

from __future__ import annotations

import logging

from vllm_ling.log import log_once
from vllm_ling.selection import Platform, Selection


def say_selection(logger: logging.Logger, key: str, selection: Selection, served: bool, enabled: bool,
                  platform: Platform, serving: str, opted_out: str, fallback: str) -> Selection:
    """Say ``selection`` (``served``: the optimization serves; ``enabled``: its option is on) under log keys
    ``key``, ``key-opt-out`` and ``key-off-<reason>``; ``fallback`` is formatted with the selection's reason."""
    if served:
        log_once(logger, logging.INFO, key, serving)
    elif platform is Platform.CPU or (selection.fallback_from is None and enabled):
        pass  # the CPU layer, or another switch's consequence (that switch says so)
    elif selection.fallback_from is None:
        log_once(logger, logging.WARNING, f"{key}-opt-out", opted_out)
    else:
        log_once(logger, logging.WARNING, f"{key}-off-{selection.reason}", fallback.format(reason=selection.reason))
    return selection
