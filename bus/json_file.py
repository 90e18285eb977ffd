"""JSON files read with a bounded size and nesting depth: checkpoint metadata (router.json,
expert*.json, autoencoder.json) and partition manifests, which a fleet may be handed by anyone.

    meta = read_json_file(json_path, error=RouterError)   # RouterError("<path>: JSON nested deeper than 64 levels")

Python's json parser recurses once per nesting level: a file of 100000 `[` raises RecursionError, which no
loader expects (a raw traceback instead of a clear error). Here a file larger than `max_bytes`, deeper than
`max_depth`, not UTF-8 or not JSON raises `error` with a message that names the file; reading it may raise
OSError (missing file, a directory, no permission) as `open` does.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Deepest nesting of arrays / objects accepted (the shipped files need 4).
MAX_JSON_DEPTH = 64

#: Largest JSON file read (bytes). Partition manifests list every image index (~0.6 MB for MNIST).
MAX_JSON_BYTES = 64 * 1024 * 1024


def read_json_file(
    path: str | os.PathLike,
    *,
    error: type[Exception] = ValueError,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The JSON value in the file `path`; `error(message naming the file)` if it is larger than `max_bytes`,
    nested deeper than `max_depth` levels, or not valid (UTF-8) JSON."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # never more than the limit, whatever the file claims to be
    if len(data) > max_bytes:
        raise error(f"{name}: larger than {max_bytes} bytes")
    deep = f"{name}: JSON nested deeper than {max_depth} levels"
    try:
        value = json.loads(data)
    except RecursionError:  # deeper than the interpreter's recursion limit (~1000)
        raise error(deep) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{name} is not valid JSON: {exc}") from None
    if _deeper_than(value, max_depth):
        raise error(deep)
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """True if arrays / objects nest more than `limit` levels in `value` (a scalar: 0, `[]`: 1); no recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
