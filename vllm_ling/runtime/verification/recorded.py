"""The one check every feature gets: each module serves the selection recorded on it.

For each feature (its :class:`~vllm_ling.selection.Reader`), over the census: every module that
serves it must carry a recorded selection, serve exactly what that selection names (choice and
switches), agree with the other modules where the feature is uniform, and be as many as the stage
holds where the reader knows that count. Explicit fallbacks (a later decision serving another
choice than the option asked for) pass and are named. Features sharing a report row (the head's
FP8 weight and its kernel) make one row.
"""

from __future__ import annotations

import collections
from typing import Any

from vllm_ling.runtime.verification.census import Census, Entry
from vllm_ling.runtime.verification.checks import Check, guarded
from vllm_ling.runtime.verification.stage import Stage
from vllm_ling.selection import Reader


def _show(key: tuple) -> str:
    choice, *switches = key
    return f"{choice}" + (f" ({', '.join(map(str, switches))})" if switches else "")


def counts(words) -> str:
    return ", ".join(f"{n} x {word}" for word, n in sorted(collections.Counter(words).items()))


def _diverges(entry: Entry) -> str:
    selected = entry.recorded.served_as()
    if selected[0] != entry.served.key[0]:
        return f"{entry.name} (selected {selected[0]}, serves {entry.served.label})"
    return f"{entry.name} (selected {_show(selected)}, serves {_show(entry.served.key)})"


def finding(reader: Reader, entries: list[Entry], expected: int | None) -> Check:
    """One feature's part of its row."""
    unselected = [e.name for e in entries if e.recorded is None]
    selected = [e for e in entries if e.recorded is not None]
    diverging = [_diverges(e) for e in selected if e.served.key != e.recorded.served_as()]
    first = selected[0].recorded if selected else None
    other = [f"{e.name} (selected {e.recorded.choice}: {e.recorded.reason})" for e in selected
             if reader.uniform and e.recorded != first]
    actual = counts(e.served.label for e in entries) or f"no {reader.what}"
    fallbacks = counts(f"fell back from {e.recorded.fallback_from}: {e.recorded.reason}" for e in selected
                        if e.recorded.fallback_from is not None)
    actual += f"; {fallbacks}" if fallbacks else ""
    for what, names in (("not the recorded selection", diverging), ("no selection recorded", unselected),
                        ("another selection than the first module's", other)):
        if names:
            actual += f"; {what}: {names[:3]}"
    counted = expected is None or len(entries) == expected
    if not counted:
        actual += f"; {len(entries)} {reader.what} where the stage has {expected}"
    return Check(reader.check, counted and not (diverging or unselected or other),
                 f"{len(entries) if expected is None else expected} {reader.what}, each serving the selection "
                 f"recorded on it ({counts(str(e.recorded.choice) for e in selected) or 'none recorded'})",
                 actual, reader.fix)


def check_recorded(census: Census, readers: tuple[Reader, ...], config: Any, stage: Stage,
                   draft_here: bool) -> dict[str, Check]:
    """One row per report row the readers name, in their order."""
    rows: dict[str, Check] = {}
    for reader in readers:
        def run(reader=reader) -> Check:
            expected = reader.expected(config, stage, draft_here) if reader.expected is not None else None
            part = finding(reader, census.of(reader.feature), expected)
            if stage.size > 1:
                part.expected += f" on {stage.label()}"
            return part

        part = guarded(reader.check, run)
        rows[reader.check] = rows[reader.check].and_(part) if reader.check in rows else part
    return rows
