"""One pass over the loaded models: every module that serves a feature, with the selection
recorded on it and what it serves, read by the feature's :class:`~vllm_ling.selection.Reader`.

Target then draft; a module the draft shares with the target (its head, its embedding) is counted
once, under the target's name. Every check that needs the served modules reads them here; a
reader that raises on a module makes that module serve nothing, named, so its check fails.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_ling.log import one_line
from vllm_ling.selection import Feature, Reader, Selection, Served, recorded


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str                     # "target.model.layers.2.mlp.experts"
    module: Any
    reader: Reader
    recorded: Selection | None    # what the module's selector chose (None: nothing did)
    served: Served                # what the module serves, read from its method and state


@dataclasses.dataclass(frozen=True)
class Census:
    entries: tuple[Entry, ...]

    def of(self, feature: Feature) -> list[Entry]:
        return [e for e in self.entries if e.reader.feature is feature]


def _served(reader: Reader, module) -> Served:
    try:
        return reader.served(module)
    except Exception as exc:  # reading it failed: it serves nothing the check can accept
        return Served.of(None, label=f"reading it raised {one_line(exc)}")


def take_census(target, draft, readers: tuple[Reader, ...]) -> Census:
    entries, seen = [], set()
    for prefix, model in (("target", target), ("draft", draft)):
        for name, module in (model.named_modules() if model is not None else ()):
            if id(module) in seen:
                continue
            seen.add(id(module))
            entries += [Entry(f"{prefix}.{name}" if name else prefix, module, r, recorded(module, r.feature),
                              _served(r, module))
                        for r in readers if r.applies(module)]
    return Census(tuple(entries))
