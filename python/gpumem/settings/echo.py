"""The user's own text echoed back in a message, escaped and shortened: one rule for every value
from outside (an argument, a variable, a file) that a message shows.

Note [echoing the user's text]
  A value from outside may hold control characters that would drive the terminal, or run to
  megabytes. A message shows it through `shown`: quoted, non-printable characters escaped as
  Python escapes them, and cut after its first SHOWN_LENGTH characters with the full length said.
  This is the one rule for a value in a message, in both layers: the compiled layer's shown()
  (csrc/core/errors.h) cuts after the same count, of bytes, its strings' unit. A path goes through
  `shown_path`, cut only past what a path can be. A message relayed from a lower layer, which may
  quote such text itself, goes out through `bounded`: escaped the same way and cut after
  MESSAGE_LENGTH.
"""
from __future__ import annotations


SHOWN_LENGTH = 64  # kShownBytes in csrc/core/errors.h; a test holds the two equal
MESSAGE_LENGTH = 1000
PATH_LENGTH = 4096  # PATH_MAX on Linux: a path the system would take is never cut


def shown(value: object, quote: str = "'", limit: int = SHOWN_LENGTH) -> str:
    """`value` as a message shows it: a string quoted with `quote` (as repr quotes it, for the
    default), cut after its first `limit` characters with the full length said, e.g.
    'xxxx'… (10000000 characters), and its non-printable characters escaped; anything else by its
    repr, cut the same way. See Note [echoing the user's text]."""
    if not isinstance(value, str):
        return _cut(_repr(value), limit, "")
    return _cut(value, limit, quote)


def shown_path(path: str) -> str:
    """A file's path or a program's name, as `shown` shows a value, cut only past PATH_LENGTH."""
    return shown(path, limit=PATH_LENGTH)


def bounded(message: str) -> str:
    """A relayed message, escaped and cut as `shown` does, without quotes."""
    return shown(message, quote="", limit=MESSAGE_LENGTH)


def relayed(error: BaseException) -> str:
    """An error's message for a line that says what it stopped, bounded: without the "gpumem: "
    that begins gpumem's own messages (the line says gpumem already), its type for an empty one."""
    return bounded(str(error).removeprefix("gpumem: ") or type(error).__name__)


def _cut(text: str, limit: int, quote: str) -> str:
    # The count is of the value's characters, before escaping, as the compiled layer counts bytes.
    body = quote + "".join(_escaped(char, quote) for char in text[:limit]) + quote
    return body if len(text) <= limit else f"{body}… ({len(text)} characters)"


def _escaped(char: str, quote: str) -> str:
    if quote and char in (quote, "\\"):
        return "\\" + char
    return char if char.isprintable() else repr(char)[1:-1]


def _repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001: a broken __repr__ must not hide the message it is part of
        return f"<a {type(value).__name__}>"
