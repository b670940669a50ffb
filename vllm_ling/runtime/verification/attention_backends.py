"""Which attention backend vLLM chose for each kind of attention layer, read from the loaded layers.

vLLM picks the MLA layers' decode backend (and their prefill backend) per platform and flags: on
sm_90 FlashAttention 3's MLA kernel unless ``--attention-backend`` says otherwise (the real H100
step, ``benchmarks/results/step_profile_real_h100.md``), CUTLASS or FlashInfer MLA on sm_100, and
so on; the KDA layers get their mamba backend (the metadata builder; the kernels are the ones the
known answers name). A fact, not a check: the report states what each layer holds
(``layer.get_attn_backend()``, and an MLA layer's ``prefill_backend``), so an A/B of a backend shows
that the backend asked for is the one that served.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_ling.log import one_line

NOTE_PREFIX = "attention backends: "


def _name(get) -> str:
    """The backend's registry name (``FLASH_ATTN_MLA``), or why it could not be read."""
    try:
        backend = get()
        return backend.get_name() if hasattr(backend, "get_name") else getattr(backend, "__name__", str(backend))
    except Exception as exc:  # a layer that cannot say is reported as such, not a crash
        return f"unreadable ({one_line(exc)})"


def _prefill_name(module) -> str | None:
    """An MLA layer's prefill backend (None: the layer has none, e.g. not an MLA layer)."""
    prefill = getattr(module, "prefill_backend", None)
    return None if prefill is None else _name(lambda: type(prefill))


def _entries(counts: Counter) -> list[dict[str, Any]]:
    return [{"model": role, "layer": layer, "layers": n, "backend": backend, "prefill": prefill}
            for (role, layer, backend, prefill), n in counts.items()]


def attention_backends(target, draft) -> list[dict[str, Any]]:
    """One entry per (model, layer class, decode backend, prefill backend) with its layer count; a
    module the draft shares with the target counts once, under the target."""
    groups: Counter = Counter()
    seen: set[int] = set()
    for role, model in (("target", target), ("draft", draft)):
        for _, module in (model.named_modules() if model is not None else ()):
            get = getattr(module, "get_attn_backend", None)
            if id(module) in seen or not callable(get):
                continue
            seen.add(id(module))
            groups[(role, type(module).__name__, _name(get), _prefill_name(module))] += 1
    return _entries(groups)


def merge_stages(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's entries from its ranks': one tensor-parallel rank per pipeline stage (the others
    hold the same layers), the stages' layer counts added."""
    total: Counter = Counter()
    for rank in ranks:
        if rank.get("tp_rank", 0) != 0:
            continue
        for e in rank.get("attention_backends") or ():
            total[(e["model"], e["layer"], e["backend"], e["prefill"])] += e["layers"]
    return _entries(total)


def describe(entries: list[dict[str, Any]]) -> str:
    """One line for the report's notes: ``target MLAAttention x5: FLASH_ATTN_MLA (prefill FLASH_ATTN); ...``."""
    return NOTE_PREFIX + "; ".join(
        f"{e['model']} {e['layer']} x{e['layers']}: {e['backend']}"
        + (f" (prefill {e['prefill']})" if e["prefill"] else "") for e in entries)
