"""The Ling target and NEXTN draft built in this process (one of each per worker).

Startup verification needs both after vLLM has loaded them and shared the draft's
head and embedding with the target; weak references avoid keeping dead models alive.
"""

from __future__ import annotations

import weakref

_models: dict[str, weakref.ref] = {}


def remember(role: str, model) -> None:
    _models[role] = weakref.ref(model)


def get(role: str):
    ref = _models.get(role)
    return ref() if ref is not None else None
