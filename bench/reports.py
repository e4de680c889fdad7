"""Where a benchmark's report goes: the JSON file its `--json` names, folders made as needed."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path | None, report: dict) -> None:
    """Write `report` to `path` (nothing when `path` is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
