"""Reading a file from outside (a snapshot, a figures file another process published): in chunks,
and never more than the caller allows, so a file's size bounds what reading it costs.
"""
from __future__ import annotations

import os

_CHUNK = 1 << 24


def read_at_most(fd: int, count: int) -> bytes:
    """Up to `count` bytes from `fd`, fewer at its end, in chunks: a bound on what one read can cost."""
    chunks = []
    while count > 0:
        chunk = os.read(fd, min(count, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
