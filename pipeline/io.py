"""Small shared file helpers: atomic writes, checksums, JSON."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 8 << 20  # 8 MiB reads keep sha256 near disk speed without holding files in memory


def sha256_file(path: str | Path, chunk: int = _CHUNK) -> str:
    """Hex sha256 of a file, streamed through one reused buffer (no per-chunk allocation)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of an object's canonical JSON (sorted keys, no whitespace)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it into place only if the block succeeds.

    Readers never see a partial file: either the old one or the complete new one.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write pretty JSON atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` merged in, recursively (neither argument is modified)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_json(path: str | Path) -> Any:
    """Read a JSON file."""
    return json.loads(Path(path).read_text())


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` as a terminal or a page may show it: control and other non-printable characters
    escaped (``\\x1b``, ``\\u202e``): a string read from an artifact is data, and raw it could
    move the cursor, clear the screen or reorder what follows it. ``lines``: keep line breaks
    (a message of several lines)."""
    if lines:
        return "\n".join(printable(line) for line in text.split("\n"))
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
