"""Reading a JSON file a user named, with errors that name it (results, reports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str, label: str, error: type[Exception]) -> Any:
    """The parsed file; ``error(f"{label}: ...")`` when it is missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{label}: file not found")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{label}: not JSON ({exc})") from exc
