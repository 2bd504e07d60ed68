"""Words in gpumem's settings: those that take one of a few names ("growable" or "plain",
"capped" or "device"), read the same way everywhere (any case, blanks around ignored), and the
check that a value has the UTF-8 form the compiled layer needs.
"""
from __future__ import annotations

from typing import Optional

from gpumem.settings.echo import shown


def forms(words: tuple[str, ...]) -> str:
    return " or ".join(f'"{word}"' for word in words)


def one_of(value: object, words: tuple[str, ...], what: str) -> str:
    """The name `value` gives; anything else raises, naming `what`, the value and the accepted
    forms: ValueError for a string, TypeError for another type."""
    if not isinstance(value, str):
        raise TypeError(f"gpumem: {what} {shown(value)} ({type(value).__name__}) is not a string; "
                        f"give {forms(words)}")
    word = value.strip().lower()
    if word not in words:
        raise ValueError(f"gpumem: bad {what} {shown(value)}: give {forms(words)}")
    return word


def not_utf8(text: str) -> Optional[str]:
    """Why `text` has no UTF-8 form, which the compiled layer needs of every string it takes: the
    first character without one, named; None if every character has one. Bytes that are not
    UTF-8 in an environment variable or an argument reach Python as such characters (U+DC80 to
    U+DCFF, one a byte: "surrogateescape"), and are named as the bytes they were."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"it holds the byte {code - 0xDC00:#04x} (character {error.start + 1}), which is not UTF-8 text"
        return f"it holds the lone surrogate \\u{code:04x} (character {error.start + 1}), which is not text"
    return None
