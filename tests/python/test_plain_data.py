"""The plain-data pickle reader (gpumem.trace.plain_data) reads what pickle.loads reads, for the opcodes
Python's pickler writes for dicts, lists, tuples, strings, bytes and numbers at protocols 2 to 5."""
from __future__ import annotations

import os
import pickle
import pickletools
import struct

import pytest

import mutants
import plain_values
from gpumem.trace import plain_data

# The opcodes Python's pickler writes for plain data at protocols 2 to 5 (and so torch, whose
# torch.cuda.memory._dump_snapshot calls pickle.dump).
PICKLER_WRITES = {
    "PROTO", "FRAME", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "LONG4",
    "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "MARK", "POP", "POP_MARK", "APPEND", "APPENDS", "SETITEM",
    "SETITEMS", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET",
}


def read(data: bytes):
    return plain_data.PlainReader(data).load()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("size", [4, 5, 1000, 1001])
def test_a_tuple_of_four_or_more_items_is_read_as_that_tuple(protocol, size):
    value = tuple(range(size))
    assert read(pickle.dumps(value, protocol)) == value
    assert read(pickle.dumps([value, "after"], protocol)) == [value, "after"]


def fuzz_count(default: int) -> int:
    """GPUMEM_FUZZ_COUNT, else `default`: CI runs a few thousand cases; a run of one's own may ask
    for 100000 (GPUMEM_FUZZ_COUNT=100000 python -m pytest test_plain_data.py)."""
    return int(os.environ.get("GPUMEM_FUZZ_COUNT", default))


def test_the_reader_reads_random_plain_data_as_pickle_loads_does():
    count = fuzz_count(3000)
    for n in range(count):
        data, protocol = plain_values.case(n)
        reader = plain_data.PlainReader(data)
        found = plain_values.difference(reader.load(), pickle.loads(data))
        assert found is None, f"case {n} (protocol {protocol}, {len(data)} bytes): {found}"
        # within the memory bound without its slack: see Note [memory]
        assert reader.spent <= plain_data.MEMORY_PER_BYTE * len(data), f"case {n}"


def test_the_random_pickles_use_every_opcode_the_pickler_writes_for_plain_data():
    seen = set()
    for n in range(2000):
        seen.update(opcode.name for opcode, _, _ in pickletools.genops(plain_values.case(n)[0]))
    # BINUNICODE8 and BINBYTES8 come only past 4 GiB: test_opcodes_the_pickler_writes_past_4_gib below
    assert seen == {name for name in PICKLER_WRITES if not name.endswith("8")}


def opcodes(*parts: bytes) -> bytes:
    return b"\x80\x04" + b"".join(parts) + pickle.STOP


@pytest.mark.parametrize("data", [
    opcodes(pickle.BINUNICODE8, struct.pack("<Q", 3), "aé".encode()),
    opcodes(pickle.BINBYTES8, struct.pack("<Q", 3), b"\x00\xff\x80"),
    b"\x80\x04" + pickle.FRAME + struct.pack("<Q", 2) + pickle.NONE + pickle.STOP,
], ids=["BINUNICODE8", "BINBYTES8", "FRAME"])
def test_opcodes_the_pickler_writes_past_4_gib_are_read_as_pickle_loads_reads_them(data):
    assert plain_values.difference(read(data), pickle.loads(data)) is None


@pytest.mark.parametrize("data", [
    opcodes(pickle.MARK, pickle.POP, pickle.NONE),
    opcodes(pickle.NONE, pickle.MARK, pickle.POP),
    opcodes(pickle.EMPTY_LIST, pickle.MARK, pickle.MARK, pickle.POP, pickle.NONE, pickle.APPENDS),
], ids=["mark-then-value", "value-then-mark", "nested-marks"])
def test_pop_on_an_empty_stack_above_a_mark_takes_the_mark_as_pickle_does(data):
    assert plain_values.difference(read(data), pickle.loads(data)) is None


@pytest.mark.parametrize("data", [
    opcodes(pickle.NONE, pickle.LONG_BINPUT, struct.pack("<I", 7), pickle.POP, pickle.LONG_BINGET,
            struct.pack("<I", 7)),
    opcodes(pickle.EMPTY_LIST, pickle.MEMOIZE, pickle.NONE, pickle.BINPUT, b"\x05", pickle.APPEND, pickle.NONE,
            pickle.MEMOIZE, pickle.APPEND, pickle.BINGET, b"\x02", pickle.APPEND),
], ids=["far-index", "memoize-after-a-far-index"])
def test_memo_indices_past_those_stored_are_read_as_pickle_reads_them(data):
    assert plain_values.difference(read(data), pickle.loads(data)) is None


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("value", [[{} for _ in range(100_000)], [[] for _ in range(100_000)],
                                   [{None: None} for _ in range(100_000)], [{"": {}} for _ in range(100_000)]],
                         ids=["empty-dicts", "empty-lists", "one-item-dicts", "nested-dicts"])
def test_the_densest_output_of_the_pickler_counts_under_the_memory_per_byte(value, protocol):
    data = pickle.dumps(value, protocol)
    reader = plain_data.PlainReader(data)
    assert reader.load() == value
    assert reader.spent <= plain_data.MEMORY_PER_BYTE * len(data)


def test_damaged_pickles_read_as_pickle_loads_reads_them_or_raise_bad_pickle():
    read_whole = 0
    for n in range(fuzz_count(1500)):
        data = mutants.mutant(n)
        reader = plain_data.PlainReader(data)
        try:
            value = reader.load()
        except plain_data.BadPickle:
            continue
        read_whole += 1
        if not reader.sparse:  # pickle.loads would allocate a slot for each memo index below one put far ahead
            found = plain_values.difference(value, pickle.loads(data))
            assert found is None, f"mutant {n}: {found}"
    assert read_whole > 0  # some damage leaves a pickle: those must read as pickle reads them
