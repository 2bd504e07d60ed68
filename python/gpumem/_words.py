"""A setting that takes one of a few names ("growable" or "plain", "capped" or "device"), read the
same way everywhere: any case, blanks around ignored."""
from __future__ import annotations


def forms(words: tuple[str, ...]) -> str:
    return " or ".join(f'"{word}"' for word in words)


def one_of(value: object, words: tuple[str, ...], what: str) -> str:
    """The name `value` gives; anything else raises, naming `what`, the value and the accepted
    forms: ValueError for a string, TypeError for another type."""
    if not isinstance(value, str):
        raise TypeError(f"gpumem: {what} {value!r} ({type(value).__name__}) is not a string; give {forms(words)}")
    word = value.strip().lower()
    if word not in words:
        raise ValueError(f"gpumem: bad {what} {value!r}: give {forms(words)}")
    return word
