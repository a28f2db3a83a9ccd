"""Reading a checkpoint directory's JSON files (torch-free: the gateway reads them too)."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """The checkpoint directory is missing, incomplete or corrupt."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"missing {path.name} in {path.parent}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
