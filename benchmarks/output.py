"""Where a benchmark's result goes: the Markdown table printed and written to ``--out``, and the
raw numbers to ``--json`` when given."""

from __future__ import annotations

import json
import os
from typing import Any


def write_outputs(text: str, out_path: str | None, json_path: str | None = None,
                  payload: dict[str, Any] | None = None) -> None:
    """Print ``text``; write it to ``out_path`` and ``payload`` to ``json_path`` where given."""
    print(text)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as fh:
            fh.write(text)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=1)
