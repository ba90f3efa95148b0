"""Reading a JSON object from a file, with an error that names the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from npuport.errors import NpuportError


def read_json_object(path: Path, error: type[NpuportError] = NpuportError) -> dict[str, Any]:
    """The JSON object in `path`; raises `error` naming the file when it is missing, unreadable or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data
