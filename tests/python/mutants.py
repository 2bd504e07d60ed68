"""Damaged snapshot files for the reader's mutation fuzz test: `mutant(n)` is the n-th of a seeded
series, a valid snapshot (one of the small committed ones, pickled again at protocol 2 to 5) with
bytes flipped, cut off, inserted, deleted or repeated. The same n gives the same bytes on every run."""
from __future__ import annotations

import functools
import pathlib
import pickle
import pickletools
import random

DATA = pathlib.Path(__file__).parent / "data"
SEED = 25
LARGEST_BASE = 16 << 10  # small snapshots, so that thousands of damaged ones read in seconds
# Bytes that mean something to the reader: opcodes, lengths near their limits, protocol numbers.
TELLING = bytes(b"\x00\x01\x02\x04\x05\x7f\x80\xff") + pickle.MARK + pickle.STOP + pickle.BINUNICODE + \
    pickle.LONG4 + pickle.BINGET + pickle.LONG_BINPUT + pickle.APPENDS + pickle.SETITEMS + pickle.TUPLE + \
    pickle.FRAME + pickle.MEMOIZE + pickle.POP + pickle.EMPTY_DICT + pickle.GLOBAL + pickle.STACK_GLOBAL


@functools.lru_cache(maxsize=1)
def bases() -> tuple[bytes, ...]:
    made = []
    for path in sorted(DATA.glob("*.pickle")):
        data = path.read_bytes()
        if len(data) > LARGEST_BASE or path.stem == "with_global":
            continue
        made += [data] + [pickle.dumps(pickle.loads(data), protocol) for protocol in (2, 3, 4, 5)]
    # Frames too, which damage inside makes too long at once: the reader must also meet it unframed.
    return tuple(made + [unframed(data) for data in made if data[1] >= 4])


def unframed(data: bytes) -> bytes:
    """`data` without its FRAME opcodes, a pickle of the same value."""
    frames = [position for opcode, _, position in pickletools.genops(data) if opcode.name == "FRAME"]
    kept, last = [], 0
    for position in frames:
        kept.append(data[last:position])
        last = position + 9  # the opcode and its 8-byte length
    return b"".join(kept) + data[last:]


def mutant(n: int) -> bytes:
    rng = random.Random(f"{SEED}:mutant:{n}")
    data = bytearray(rng.choice(bases()))
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        rng.choice((_flip, _flip, _cut, _insert, _delete, _repeat))(rng, data)
    return bytes(data)


def _byte(rng: random.Random) -> int:
    return rng.choice(TELLING) if rng.random() < 0.5 else rng.randrange(256)


def _flip(rng: random.Random, data: bytearray) -> None:
    if data:
        data[rng.randrange(len(data))] = _byte(rng)


def _cut(rng: random.Random, data: bytearray) -> None:
    del data[rng.randrange(len(data) + 1):]


def _insert(rng: random.Random, data: bytearray) -> None:
    at = rng.randrange(len(data) + 1)
    data[at:at] = bytes(_byte(rng) for _ in range(rng.randrange(1, 17)))


def _delete(rng: random.Random, data: bytearray) -> None:
    at = rng.randrange(len(data) + 1)
    del data[at:at + rng.randrange(1, 65)]


def _repeat(rng: random.Random, data: bytearray) -> None:
    at = rng.randrange(len(data) + 1)
    piece = data[at:at + rng.randrange(1, 65)]
    where = rng.randrange(len(data) + 1)
    data[where:where] = piece * rng.randrange(1, 4)
