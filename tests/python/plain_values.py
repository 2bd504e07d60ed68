"""Random plain data for the reader's differential and fuzz tests, and a comparison of two values that
says where they first differ.

`case(n)` is the n-th pickle of a seeded series: a random value (nested dicts, lists and tuples of
every size the pickler batches differently, integers of every width the opcodes distinguish, floats
of any bit pattern, text with non-ASCII characters and lone surrogates, bytes, booleans, None,
shared references and cycles) pickled with protocol 2 + n % 4. The same n gives the same bytes on
every run.
"""
from __future__ import annotations

import pickle
import random
import struct
from typing import Any, Optional

SEED = 25
MAX_CONTAINERS = 40  # per value: the pickler recurses, and a chain of containers must stay shallow
INTEGER_EDGES = (0, 1, 255, 256, 65535, 65536, -1, -255, -256, 2**31 - 1, -2**31, 2**31, -2**31 - 1, 2**63 - 1,
                 -2**63, 2**64 - 1, 2**64, -2**64, 2**2040, -2**2040, 2**2048)  # BININT1 .. LONG4
FLOAT_EDGES = (0.0, -0.0, 1.0, -1.5, float("inf"), float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308)
CHARACTERS = "abcXYZ019 _-.:/\x00\t\n\x7f\x80éß€中😀\U0010ffff\udcff\ud800"  # lone surrogates: pickle writes them
BATCH_EDGES = (999, 1000, 1001, 2001)  # the pickler writes APPENDS and SETITEMS in batches of 1000


def case(n: int) -> tuple[bytes, int]:
    """The n-th pickle of the series, and its protocol."""
    protocol = 2 + n % 4
    value = Values(random.Random(f"{SEED}:{n}"), protocol).top()
    return pickle.dumps(value, protocol), protocol


class Values:
    def __init__(self, rng: random.Random, protocol: int):
        self.rng = rng
        self.with_bytes = protocol >= 3  # protocol 2 writes bytes as a call of _codecs.encode: a global
        self.containers_left = MAX_CONTAINERS
        self.shared: list = []  # containers, text and bytes made so far, to be referred to again
        self.mutable: list = []  # the lists and dicts, which get references added once all is made

    def top(self) -> Any:
        value = self.value(depth=0)
        for container in self.mutable:  # references to anything made, their ancestors too: cycles
            if self.rng.random() < 0.05:
                self.refer_back(container)
        return value

    def value(self, depth: int) -> Any:
        rng = self.rng
        if self.shared and rng.random() < 0.08:
            return rng.choice(self.shared)
        if depth < 5 and self.containers_left > 0 and rng.random() < 0.4 / (depth + 1):
            self.containers_left -= 1
            return rng.choice((self.list, self.dict, self.tuple))(depth + 1)
        return self.scalar()

    def list(self, depth: int) -> list:
        made = []
        self.shared.append(made)
        self.mutable.append(made)
        made.extend(self.child(depth) for _ in range(self.size()))
        return made

    def dict(self, depth: int) -> dict:
        made = {}
        self.shared.append(made)
        self.mutable.append(made)
        for _ in range(self.size()):
            made[self.key()] = self.child(depth)
        return made

    def tuple(self, depth: int) -> tuple:
        made = tuple(self.child(depth) for _ in range(self.size()))
        self.shared.append(made)
        for item in made:  # a tuple inside itself, through a list: the pickler then writes POP or POP_MARK
            if isinstance(item, list) and self.rng.random() < 0.3:
                item.append(made)
        return made

    def child(self, depth: int) -> Any:
        return self.value(depth) if depth < 5 else self.scalar()

    def refer_back(self, container) -> None:
        target = self.rng.choice(self.shared)
        if isinstance(container, list):
            container.append(target)
        else:
            container[self.key()] = target

    def size(self) -> int:
        roll = self.rng.random()
        if roll < 0.6:
            return self.rng.randrange(4)
        if roll < 0.9:
            return self.rng.randrange(4, 12)
        if roll < 0.995:
            return self.rng.randrange(12, 60)
        self.containers_left = 0  # a large one holds scalars only
        return self.rng.choice(BATCH_EDGES)

    def scalar(self) -> Any:
        kind = self.rng.randrange(8 if self.with_bytes else 7)
        return (self.constant, self.integer, self.integer, self.floating, self.text, self.text, self.integer,
                self.binary)[kind]()

    def key(self) -> Any:
        """A dict key of a kind the reader takes: text, bytes, an integer of at most 64 bits, a float,
        a bool or None."""
        kind = self.rng.randrange(5 if self.with_bytes else 4)
        return (self.flag, self.small_integer, self.floating, self.text, self.binary)[kind]()

    def flag(self) -> Any:
        return self.rng.choice((None, True, False))

    def constant(self) -> Any:
        return self.rng.choice((None, True, False, ()))

    def integer(self) -> int:
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice(INTEGER_EDGES)
        if kind == 1:
            return rng.randrange(256)
        if kind == 2:
            return rng.randrange(65536)
        if kind == 3:
            return rng.randrange(-2**31, 2**31)
        bits = rng.randrange(32, 2100) if rng.random() < 0.95 else rng.randrange(2100, 40000)
        return rng.getrandbits(bits) * rng.choice((1, -1))

    def small_integer(self) -> int:
        return self.rng.randrange(-2**64 + 1, 2**64) if self.rng.random() < 0.3 else self.rng.randrange(-300, 70000)

    def floating(self) -> float:
        if self.rng.random() < 0.3:
            return self.rng.choice(FLOAT_EDGES)
        return struct.unpack(">d", self.rng.randbytes(8))[0]  # any bit pattern: NaNs with payloads too

    def text(self) -> str:
        made = "".join(self.rng.choice(CHARACTERS) for _ in range(self.length()))
        self.shared.append(made)
        return made

    def binary(self) -> bytes:
        made = self.rng.randbytes(self.length())
        self.shared.append(made)
        return made

    def length(self) -> int:
        # SHORT_BINUNICODE and SHORT_BINBYTES up to 255 bytes, BINUNICODE and BINBYTES past it
        return self.rng.randrange(12) if self.rng.random() < 0.9 else self.rng.randrange(60, 300)


def difference(left: Any, right: Any) -> Optional[str]:
    """Where `left` and `right` first differ, or None if they are the same plain data: the same types
    and values (floats bit for bit), and the same sharing: each container of one stands for exactly
    one container of the other, cycles included. Iterative, so any depth compares."""
    pairs: dict[int, int] = {}  # id of a container in left -> id of its counterpart in right
    taken: set[int] = set()
    pending = [(left, right, "value")]
    while pending:
        a, b, where = pending.pop()
        if type(a) is not type(b):
            return f"{where}: {type(a).__name__} against {type(b).__name__}"
        if not isinstance(a, (list, dict, tuple)) or a == ():
            if not _same_scalar(a, b):
                return f"{where}: {a!r:.80} against {b!r:.80}"
            continue
        if id(a) in pairs:
            if pairs[id(a)] != id(b):
                return f"{where}: one object in the first value is two in the second"
            continue
        if id(b) in taken:
            return f"{where}: two objects in the first value are one in the second"
        pairs[id(a)] = id(b)
        taken.add(id(b))
        if len(a) != len(b):
            return f"{where}: {len(a)} entries against {len(b)}"
        if isinstance(a, dict):
            for n, ((key_a, value_a), (key_b, value_b)) in enumerate(zip(a.items(), b.items())):
                pending.append((key_a, key_b, f"{where} key {n}"))
                pending.append((value_a, value_b, f"{where}[{key_a!r:.40}]"))
        else:
            pending.extend((x, y, f"{where}[{n}]") for n, (x, y) in enumerate(zip(a, b)))
    return None


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    return a == b
