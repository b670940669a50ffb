"""Bytes that tensors occupy, each storage once: views share their base's storage, and the draft shares
the target's head and embedding, so summing ``numel * element_size`` would count memory twice. The
report's weights (:mod:`.verification.assembly`) and KV cache (:mod:`.startup_facts`) are read this way."""

from __future__ import annotations

from typing import Iterable

import torch


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (views share one)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
