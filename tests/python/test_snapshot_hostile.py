"""Reading hostile snapshot files (gpumem.snapshot_file).

Every bad file raises SnapshotError naming the file and the place in it, in time and memory bounded
by the file's size. The files are made here, small: with pickle.dumps, or from pickle's opcodes by
hand where they need what the pickler never writes (a value built from shared references, a memo
index far ahead). Reads that would hang or exhaust memory if the reader regressed run in a child
process with a timeout and a cap on its memory, so that they fail instead of stopping the run.
"""
from __future__ import annotations

import json
import os
import pathlib
import pickle
import struct
import subprocess
import sys
import time

import pytest

from gpumem.trace import plain_data, snapshot_file
from gpumem.trace.snapshot_file import DEVICE_TOTALS_KEY, MAX_BYTES, MAX_DEVICES, SnapshotError, from_dict, load

DATA = pathlib.Path(__file__).parent / "data"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOLE = "@@HOLE@@"  # a value that a hand-made fragment of pickle replaces
FAR = 1 << 20  # memo indices for hand-made fragments, far above those the pickler uses


def alloc(**fields) -> dict:
    return {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 100, **fields}


def block(**fields) -> dict:
    return {"address": 1 << 30, "size": 512, "requested_size": 512, "state": "active_allocated", **fields}


def segment(**fields) -> dict:
    return {"device": 0, "address": 1 << 30, "total_size": 2 * MiB, "allocated_size": 512, "stream": 0,
            "segment_type": "small", "blocks": [block()], **fields}


def snapshot(*events: dict, segments: tuple = (), **top) -> dict:
    return {"segments": list(segments), "device_traces": [list(events or [alloc()])], **top}


def write(tmp_path, content: bytes, name: str = "snapshot.pickle") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def with_fragment(value: dict, fragment: bytes) -> bytes:
    """A pickle of `value` with the string HOLE replaced by `fragment`, opcodes that push one value."""
    data = pickle.dumps(value, protocol=2)  # no frames, whose lengths the fragment would change
    hole = pickle.BINUNICODE + struct.pack("<I", len(HOLE)) + HOLE.encode()
    assert data.count(hole) == 1
    return data.replace(hole, fragment)


def put(index: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", index)


def get(index: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", index)


def doubled(levels: int, kind: str = "list") -> bytes:
    """A value whose every level holds the level below twice, by memo references: 2^levels parts
    for whatever walks it, from 15 bytes a level."""
    out = (pickle.EMPTY_LIST if kind == "list" else pickle.EMPTY_TUPLE) + put(FAR)
    for level in range(1, levels + 1):
        below = get(FAR + level - 1)
        pair = pickle.EMPTY_LIST + pickle.MARK + below + below + pickle.APPENDS if kind == "list" else (
            below + below + pickle.TUPLE2)
        out += pickle.POP + pair + put(FAR + level)
    return out


def nested(depth: int) -> bytes:
    """Lists nested `depth` deep: each APPEND puts the list on top into the one below it."""
    return pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)


def rejected(path, *needles: str, **where) -> str:
    with pytest.raises(SnapshotError) as caught:
        load(path, **where)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message and len(message) < len(str(path)) + 400
    for needle in needles:
        assert needle in message
    return message


CHILD = r"""
import importlib.util, json, resource, sys
module_path, snapshot_path, memory, max_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
# The reader's modules alone (the two, and the echo and file reading they use), without the gpumem package
# (and torch) they live in.
def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
for name in ("settings.echo", "settings.files", "trace.plain_data"):
    load_module("gpumem." + name, module_path.replace("trace/snapshot_file.py", name.replace(".", "/") + ".py"))
module = load_module("snapshot_file", module_path)
try:
    module.load(snapshot_path, max_size=max_size)
    outcome = {"error": None, "message": ""}
except Exception as error:
    outcome = {"error": type(error).__name__, "message": str(error)}
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent, through fork and exec
with open("/proc/self/status") as status:
    peak = next(line for line in status if line.startswith("VmHWM:"))
outcome["peak_mib"] = int(peak.split()[1]) // 1024
print(json.dumps(outcome))
"""


def load_in_child(path, timeout: float = 30, memory: int = GiB, max_size: int = snapshot_file.MAX_FILE_SIZE) -> dict:
    """load(path, max_size) in a fresh interpreter with `memory` bytes of address space, for `timeout`
    seconds: {"error": the exception's type name or None, "message", "peak_mib": its peak resident memory}."""
    completed = subprocess.run([sys.executable, "-c", CHILD, snapshot_file.__file__, str(path), str(memory),
                                str(max_size)], capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


def rejected_in_child(path, *needles: str, **where) -> dict:
    outcome = load_in_child(path, **where)
    assert outcome["error"] == "SnapshotError", outcome
    assert str(path) in outcome["message"] and "\n" not in outcome["message"]
    for needle in needles:
        assert needle in outcome["message"], outcome
    return outcome


# ---- files that are not snapshots ---------------------------------------------------------------


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "snapshot.pickle"
    os.mkfifo(fifo)
    rejected_in_child(fifo, "is a FIFO, not a snapshot file")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_character_device_is_refused_without_reading_it():
    rejected_in_child("/dev/zero", "is a character device, not a snapshot file")


def test_a_directory_is_refused(tmp_path):
    rejected(tmp_path, "is a directory, not a snapshot file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_refused_with_the_reason(tmp_path):
    path = write(tmp_path, pickle.dumps(snapshot()))
    os.chmod(path, 0)
    rejected(path, "cannot be read (Permission denied)")


def test_a_huge_file_with_a_wrong_first_byte_is_refused_before_the_rest_is_read(tmp_path):
    path = tmp_path / "sparse.pickle"
    with open(path, "wb") as file:
        file.truncate(3 * GiB)  # sparse: no disk, and zeros where a pickle has its header
    started = time.monotonic()
    outcome = rejected_in_child(path, "not a pickle: it starts with b'\\x00\\x00'", max_size=4 * GiB)
    assert time.monotonic() - started < 10 and outcome["peak_mib"] < 100


def sparse(tmp_path, size: int, start: bytes = b"") -> pathlib.Path:
    """A file of `size` bytes that takes no disk: `start`, then zeros."""
    path = tmp_path / "sparse.pickle"
    with open(path, "wb") as file:
        file.write(start)
        file.truncate(size)
    return path


def test_a_file_larger_than_the_cap_is_refused_by_its_size_before_a_byte_is_read(tmp_path):
    path = sparse(tmp_path, GiB, pickle.PROTO + b"\x04")
    outcome = rejected_in_child(path, f"is {GiB} bytes, larger than the cap of {snapshot_file.MAX_FILE_SIZE} bytes "
                                      "(256 MiB) on a snapshot file", "max_size", "--max-size")
    assert outcome["peak_mib"] < 100


def test_max_size_sets_the_cap(tmp_path):
    path = write(tmp_path, pickle.dumps(snapshot()))
    size = os.path.getsize(path)
    assert load(path, max_size=size).events(0)[0].size == 512
    rejected(path, f"is {size} bytes, larger than the cap of {size - 1} bytes", max_size=size - 1)


@pytest.mark.parametrize("max_size, error", [(0, ValueError), (-1, ValueError), ("1GB", TypeError),
                                             (True, TypeError), (1.5, TypeError)])
def test_a_bad_max_size_is_refused_naming_it(tmp_path, max_size, error):
    with pytest.raises(error, match="max_size"):
        load(write(tmp_path, pickle.dumps(snapshot())), max_size=max_size)


def test_a_huge_file_that_goes_wrong_at_byte_2_is_refused_before_the_rest_is_read(tmp_path):
    path = sparse(tmp_path, GiB, pickle.PROTO + b"\x04")
    outcome = rejected_in_child(path, "the byte 0x00, which is no opcode", "(the opcode at byte 2)", max_size=2 * GiB)
    assert outcome["peak_mib"] < 100


ONE_BYTE_VALUES = 2 * MiB


@pytest.mark.parametrize("content", [
    b"\x80\x04](" + pickle.EMPTY_DICT * ONE_BYTE_VALUES + b"e.",
    b"\x80\x04](" + pickle.EMPTY_LIST * ONE_BYTE_VALUES + b"e.",
    b"\x80\x04" + pickle.MARK * ONE_BYTE_VALUES,
], ids=["empty-dicts", "empty-lists", "marks"])
def test_values_that_would_take_more_than_48_bytes_a_byte_of_the_file_are_refused(tmp_path, content):
    baseline = load_in_child(write(tmp_path, b"\x80\x04N.", "small.pickle"))["peak_mib"]
    outcome = rejected_in_child(write(tmp_path, content), "too large to read: its values would take more than")
    assert outcome["peak_mib"] - baseline < 56 * ONE_BYTE_VALUES // MiB


def test_each_memo_entry_takes_a_slot_not_a_dict_entry(tmp_path):
    baseline = load_in_child(write(tmp_path, b"\x80\x04N.", "small.pickle"))["peak_mib"]
    content = b"\x80\x04" + pickle.NONE + pickle.MEMOIZE * ONE_BYTE_VALUES + pickle.STOP
    outcome = rejected_in_child(write(tmp_path, content), "the top level is None, not a dict")
    assert outcome["peak_mib"] - baseline < 16 * ONE_BYTE_VALUES // MiB


@pytest.mark.parametrize("protocol", [0, 1])
def test_a_pickle_of_protocol_0_or_1_is_refused_by_its_header(tmp_path, protocol):
    rejected(write(tmp_path, pickle.dumps(snapshot(), protocol=protocol)), "not a pickle: it starts with",
             "a protocol from 2 to 5")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_pickle_of_protocol_2_to_5_is_read(tmp_path, protocol):
    assert load(write(tmp_path, pickle.dumps(snapshot(), protocol=protocol))).events(0)[0].size == 512


def test_the_reader_reads_no_more_than_the_size_the_file_had_when_opened(tmp_path, monkeypatch):
    path = write(tmp_path, pickle.dumps(snapshot(), protocol=2))
    monkeypatch.setattr(snapshot_file, "_regular_size", lambda fd, name: 20)  # as if it grew after fstat
    rejected(path, "not a pickle: it ends")


# ---- unpickling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA.glob("*.pickle") if p.stem != "with_global"))
def test_the_reader_reads_each_committed_snapshot_as_pickle_does(name):
    data = (DATA / f"{name}.pickle").read_bytes()
    assert plain_data.loads(data) == pickle.loads(data)


@pytest.mark.parametrize("content, problem", [
    (b"\x80\x04\x8c\x05ab", "it ends inside an opcode (the file is cut short)"),
    (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"ab.", "it ends inside an opcode"),
    (b"\x80\x04N", "it ends before its STOP opcode"),
    (b"\x80\x04\x8c\x02\xff\xfe.", "it holds text that is not UTF-8 (invalid start byte at byte 0 of it)"),
    (b"\x80\x04a.", "it takes a value from an empty stack"),
    (b"\x80\x04h\x05.", "it refers to memo entry 5, which it never stored"),
    (b"\x80\x04}Na.", "it adds to an empty dict, not to a list"),
    (b"\x80\x04]e.", "it takes the values above a MARK it never set"),
    (b"\x80\x04}(Nu.", "it gives SETITEMS 1 values"),
    (b"\x80\x04NN.", "it ends with 2 values and 0 marks on its stack"),
    (pickle.dumps(snapshot()) + b"junk", "4 bytes follow its STOP opcode"),
    (pickle.dumps({"segments": set()}, protocol=4), "the opcode EMPTY_SET, which plain data never needs"),
    (b"\x80\x04\xff", "the byte 0xff, which is no opcode"),
    (b"\x80\x04\x80\x09N.", "it names protocol 9"),
    (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", "it has a frame longer than the rest of the file"),
    (b"\x80\x04\x8b\xff\xff\xff\xff.", "it gives an integer a length of -1 bytes"),
    (b"\x80\x04NN\x93.", "it names a global by None and None, not by two strings"),
], ids=["cut-in-a-string", "string-longer-than-the-file", "no-stop", "not-utf-8", "empty-stack", "memo-never-stored",
        "append-to-a-dict", "no-mark", "odd-setitems", "two-values", "bytes-after-stop", "a-set", "no-opcode",
        "protocol-9", "frame-longer-than-the-file", "negative-length", "global-named-by-none"])
def test_a_damaged_pickle_is_refused_with_the_byte_it_fails_at(tmp_path, content, problem):
    rejected(write(tmp_path, content), problem, "(the opcode at byte ")


@pytest.mark.parametrize("content, key", [
    (b"\x80\x04}]Ns.", "a list"),
    (pickle.dumps({1 << 64: 0}), "18446744073709551616"),
    (pickle.dumps({(1, 2): 0}), "a tuple"),
], ids=["list", "integer-past-64-bits", "tuple"])
def test_a_dict_key_other_than_a_string_or_small_number_is_refused(tmp_path, content, key):
    rejected(write(tmp_path, content), f"it has a dict key that is {key}")


def test_a_tuple_key_of_2_to_the_40_parts_is_refused_without_hashing_it(tmp_path):
    content = b"\x80\x02" + pickle.EMPTY_DICT + doubled(40, "tuple") + pickle.NONE + pickle.SETITEM + pickle.STOP
    rejected_in_child(write(tmp_path, content), "it has a dict key that is a tuple")


def test_a_memo_index_far_past_the_values_stored_costs_no_memory(tmp_path):
    content = b"\x80\x04" + pickle.NONE + put(0x0FFF_FFFF) + pickle.STOP
    outcome = rejected_in_child(write(tmp_path, content), "the top level is None, not a dict")
    assert outcome["peak_mib"] < 100


def test_a_memory_error_while_unpickling_is_a_snapshot_error(tmp_path, monkeypatch):
    def exhausted(reader):
        raise MemoryError

    monkeypatch.setitem(plain_data.OPCODES, pickle.EMPTY_DICT[0], (exhausted, 0))
    rejected(write(tmp_path, pickle.dumps(snapshot())), "too large to read: there is not the memory to hold its values")


def test_a_keyboard_interrupt_while_unpickling_is_not_caught(tmp_path, monkeypatch):
    def interrupted(reader):
        raise KeyboardInterrupt

    monkeypatch.setitem(plain_data.OPCODES, pickle.EMPTY_DICT[0], (interrupted, 0))
    with pytest.raises(KeyboardInterrupt):
        load(write(tmp_path, pickle.dumps(snapshot())))


# ---- values built from shared references --------------------------------------------------------


def holding(place: str, fragment: bytes) -> bytes:
    """A snapshot whose value at `place` (a key of PLACES) is the one that `fragment` pushes."""
    if place == "top-level":
        return b"\x80\x02" + fragment + pickle.STOP
    return with_fragment({
        "action": snapshot(alloc(action=HOLE)),
        "size": snapshot(alloc(size=HOLE)),
        "block-state": snapshot(segments=(segment(blocks=[block(state=HOLE)]),)),
        "segment-type": snapshot(segments=(segment(segment_type=HOLE),)),
        "device-total": snapshot(**{DEVICE_TOTALS_KEY: [HOLE]}),
    }[place], fragment)


PLACES = {
    "action": r"device_traces[0][0]['action'] is a {kind}, not one of alloc",
    "size": r"device_traces[0][0]['size'] is a {kind}, not an integer",
    "block-state": r"segments[0]['blocks'][0]['state'] is a {kind}, not one of active_allocated",
    "segment-type": r"segments[0]['segment_type'] is a {kind}, not a string",
    "device-total": f"{DEVICE_TOTALS_KEY}[0] is a {{kind}}, not an integer",
    "top-level": "the top level is a {kind}, not a dict",
}


@pytest.mark.parametrize("kind", ["list", "tuple"])
@pytest.mark.parametrize("place", sorted(PLACES))
def test_a_value_of_2_to_the_40_parts_is_refused_by_its_type_without_walking_it(tmp_path, place, kind):
    rejected_in_child(write(tmp_path, holding(place, doubled(40, kind))), PLACES[place].format(kind=kind))


@pytest.mark.parametrize("key", ["frames", "allocator_settings", "user_metadata"])
def test_a_value_of_2_to_the_40_parts_where_the_reader_never_looks_is_accepted(tmp_path, key):
    value = snapshot(alloc(frames=HOLE)) if key == "frames" else snapshot(alloc(), **{key: HOLE})
    outcome = load_in_child(write(tmp_path, with_fragment(value, doubled(40))))
    assert outcome["error"] is None, outcome


@pytest.mark.parametrize("place", sorted(PLACES))
def test_a_value_nested_100000_deep_is_refused_by_its_type(tmp_path, place):
    rejected(write(tmp_path, holding(place, nested(100_000))), PLACES[place].format(kind="list"))


def test_a_value_nested_100000_deep_where_the_reader_never_looks_is_accepted(tmp_path):
    value = snapshot(alloc(frames=HOLE), allocator_settings={"roundup_power2_divisions": "@@OTHER@@"})
    content = with_fragment(value, nested(100_000))
    other = pickle.BINUNICODE + struct.pack("<I", 9) + b"@@OTHER@@"
    assert load(write(tmp_path, content.replace(other, nested(100_000)))).events(0)[0].size == 512


# ---- containers reached twice -------------------------------------------------------------------

SHARED_EVENT, SHARED_TRACE, SHARED_SEGMENT, SHARED_BLOCKS, SHARED_BLOCK = (
    alloc(), [alloc()], segment(), [block()], block())
SHARINGS = {
    "an-event-twice-in-a-trace": (snapshot(SHARED_EVENT, SHARED_EVENT), "device_traces[0][1]"),
    "an-event-in-two-traces": ({"segments": [], "device_traces": [[SHARED_EVENT], [SHARED_EVENT]]},
                               "device_traces[1][0]"),
    "a-trace-for-two-devices": ({"segments": [], "device_traces": [SHARED_TRACE, SHARED_TRACE]}, "device_traces[1]"),
    "a-segment-twice": (snapshot(segments=(SHARED_SEGMENT, SHARED_SEGMENT)), "segments[1]"),
    "blocks-of-two-segments": (snapshot(segments=(segment(blocks=SHARED_BLOCKS), segment(blocks=SHARED_BLOCKS))),
                               "segments[1]['blocks']"),
    "a-block-twice": (snapshot(segments=(segment(blocks=[SHARED_BLOCK, SHARED_BLOCK]),)), "segments[0]['blocks'][1]"),
    "segments-that-are-a-trace": ({"segments": SHARED_TRACE, "device_traces": [SHARED_TRACE]}, "segments"),
}


@pytest.mark.parametrize("reader", ["load", "from_dict"])
@pytest.mark.parametrize("sharing", sorted(SHARINGS))
def test_a_container_the_reader_walks_reached_twice_is_refused(tmp_path, sharing, reader):
    value, where = SHARINGS[sharing]
    expected = f"not a memory snapshot: {where} is the same object as an earlier one; a snapshot from torch never"
    if reader == "load":
        rejected(write(tmp_path, pickle.dumps(value)), expected)
    else:
        with pytest.raises(SnapshotError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            from_dict(value)


def test_a_small_file_of_10_to_the_8_shared_events_is_refused_at_once(tmp_path):
    trace = [alloc()] * 100_000
    path = write(tmp_path, pickle.dumps({"segments": [], "device_traces": [trace] * 1000}))
    assert os.path.getsize(path) < 300 * KiB
    started = time.monotonic()
    rejected_in_child(path, "device_traces[0][1] is the same object as an earlier one")
    assert time.monotonic() - started < 10


def test_frames_and_strings_shared_as_torch_shares_them_are_accepted(tmp_path):
    frames = [{"filename": "train.py", "line": 7, "name": "step"}]
    events = [alloc(frames=frames), alloc(action="free_completed", frames=frames)]
    loaded = load(write(tmp_path, pickle.dumps(snapshot(*events, segments=(segment(frames=frames),)))))
    assert [e.action for e in loaded.events(0)] == ["alloc", "free_completed"]


def test_the_reader_stops_past_its_budget_of_entries_walked(monkeypatch):
    monkeypatch.setattr(snapshot_file, "_WALK_PER_BYTE", 0)
    monkeypatch.setattr(snapshot_file, "_WALK_SLACK", 100)
    rejected(str(DATA / "train_like.pickle"), "takes the entries to walk past 100, more than a file of its size holds")


def test_the_raw_trace_is_walked_once():
    class CountedList(list):
        walks = 0

        def __iter__(self):
            CountedList.walks += 1
            return super().__iter__()

    snapshot_ = from_dict({"segments": [], "device_traces": CountedList([CountedList([alloc()])])})
    assert CountedList.walks == 2 and snapshot_.has_times  # device_traces once, its one trace once


# ---- types and ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, problem", [
    (snapshot(alloc(size=-5)), "device_traces[0][0]['size'] is -5, not a size in bytes (0 to 2^62)"),
    (snapshot(alloc(size=MAX_BYTES + 1)), f"['size'] is {MAX_BYTES + 1}, not a size in bytes"),
    (snapshot(alloc(size=1 << 64)), f"['size'] is {1 << 64}, not a size in bytes"),
    (snapshot(alloc(size=True)), "['size'] is True, not an integer"),
    (snapshot(alloc(size={"a": 1, "b": 2, "c": 3})), "['size'] is a dict of 3 keys, not an integer"),
    (snapshot(alloc(size=10 ** 4999)), "['size'] is an integer of 5000 digits, not a size in bytes"),
    (snapshot(segments=(segment(blocks=[block(requested_size=-1)]),)),
     "segments[0]['blocks'][0]['requested_size'] is -1, not a size in bytes"),
    (snapshot(segments=(segment(blocks=[block(size=1 << 63)]),)),
     "segments[0]['blocks'][0]['size'] is 9223372036854775808"),
    (snapshot(segments=(segment(total_size=1 << 63),)), "segments[0]['total_size'] is 9223372036854775808, not a size"),
    (snapshot(segments=(segment(allocated_size=-1),)), "segments[0]['allocated_size'] is -1, not a size"),
    (snapshot(alloc(addr=-1)), "['addr'] is -1, not an address (0 to 2^64 - 1)"),
    (snapshot(alloc(addr=1 << 64)), "['addr'] is 18446744073709551616, not an address"),
    (snapshot(segments=(segment(address=1 << 64),)), "segments[0]['address'] is 18446744073709551616, not an address"),
    (snapshot(segments=(segment(blocks=[block(address=-1)]),)), "segments[0]['blocks'][0]['address'] is -1"),
    (snapshot(segments=(segment(address=(1 << 64) - 512, blocks=[{"size": 512, "state": "inactive"},
                                                                  {"size": 512, "state": "inactive"}]),)),
     "segments[0]['blocks'][1] has no 'address', and the sizes of the blocks before it take its place past 2^64 - 1"),
    (snapshot(alloc(stream=-(1 << 63) - 1)), "['stream'] is -9223372036854775809, not a stream (-2^63 to 2^64 - 1)"),
    (snapshot(alloc(stream=1 << 64)), "['stream'] is 18446744073709551616, not a stream"),
    (snapshot(alloc(time_us=1 << 63)), "['time_us'] is 9223372036854775808, not a time in microseconds"),
    (snapshot(alloc(time_us=-(1 << 63) - 1)), "['time_us'] is -9223372036854775809, not a time"),
    (snapshot(segments=(segment(device=-1),)), "segments[0]['device'] is -1, not a device index (0 to 1023)"),
    (snapshot(segments=(segment(device=MAX_DEVICES),)), "segments[0]['device'] is 1024, not a device index"),
    (snapshot(segments=(segment(device=1 << 70),)), f"segments[0]['device'] is {1 << 70}, not a device index"),
    ({"segments": [], "device_traces": [[] for _ in range(MAX_DEVICES + 1)]},
     "device_traces has 1025 entries, more than 1024"),
    (snapshot(**{DEVICE_TOTALS_KEY: [-1]}),
     f"{DEVICE_TOTALS_KEY}[0] is -1, not a device's memory in bytes (1 to 2^62)"),
    (snapshot(**{DEVICE_TOTALS_KEY: [0]}), f"{DEVICE_TOTALS_KEY}[0] is 0, not a device's memory"),
    (snapshot(**{DEVICE_TOTALS_KEY: [(1 << 64) - 1]}), f"{DEVICE_TOTALS_KEY}[0] is 18446744073709551615, not a"),
    (snapshot(**{DEVICE_TOTALS_KEY: {0: MAX_BYTES + 1}}), f"{DEVICE_TOTALS_KEY}[0] is 4611686018427387905, not a"),
    (snapshot(**{DEVICE_TOTALS_KEY: {-1: GiB}}), f"a key of {DEVICE_TOTALS_KEY} is -1, not a device index"),
    (snapshot(**{DEVICE_TOTALS_KEY: {"0": GiB}}), f"a key of {DEVICE_TOTALS_KEY} is '0', not an integer"),
    (snapshot(**{DEVICE_TOTALS_KEY: [GiB] * (MAX_DEVICES + 1)}),
     f"{DEVICE_TOTALS_KEY} has 1025 entries, more than 1024"),
    (snapshot(alloc(action=["alloc"])), "['action'] is a list, not one of alloc, free_completed"),
    (snapshot(alloc(action=10 ** 4999)), "['action'] is an integer of 5000 digits, not one of alloc"),
    (snapshot(alloc(action="x" * 5000)), f"['action'] is {'x' * 64!r}… (5000 characters), not one of"),
    (snapshot(alloc(action="grow\nsegment")), r"['action'] is 'grow\nsegment', not one of"),
    (snapshot(segments=(segment(blocks=[block(state=["inactive"])]),)),
     "segments[0]['blocks'][0]['state'] is a list, not one of active_allocated"),
    (snapshot(segments=(segment(segment_type=["large"]),)), "segments[0]['segment_type'] is a list, not a string"),
], ids=lambda value: None if isinstance(value, dict) else value[:40])
def test_a_value_of_the_wrong_type_or_out_of_range_is_refused_naming_its_place(tmp_path, value, problem):
    rejected(write(tmp_path, pickle.dumps(value)), "not a memory snapshot: ", problem)


def test_values_at_the_ends_of_their_ranges_are_accepted(tmp_path):
    events = [alloc(addr=0, size=0, stream=-(1 << 63), time_us=-(1 << 63)),
              alloc(addr=(1 << 64) - 1, size=MAX_BYTES, stream=(1 << 64) - 1, time_us=(1 << 63) - 1)]
    segments = (segment(device=MAX_DEVICES - 1, address=(1 << 64) - 512, total_size=MAX_BYTES, allocated_size=0,
                        blocks=[block(address=(1 << 64) - 512, size=0, requested_size=MAX_BYTES)]),)
    totals = {0: 1, MAX_DEVICES - 1: MAX_BYTES}
    loaded = load(write(tmp_path, pickle.dumps(snapshot(*events, segments=segments, **{DEVICE_TOTALS_KEY: totals}))))
    assert [e.size for e in loaded.events(0)] == [0, MAX_BYTES]
    assert loaded.segments[0].device == MAX_DEVICES - 1 and loaded.device_totals == totals


def test_allocator_settings_that_are_a_dict_are_kept_unwalked_and_anything_else_is_dropped():
    settings = {"expandable_segments": [[["anything"]]]}
    assert from_dict(snapshot(allocator_settings=settings)).allocator_settings is settings
    assert from_dict(snapshot(allocator_settings=["expandable_segments"])).allocator_settings == {}


# ---- torch's own snapshots ----------------------------------------------------------------------


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_torchs_in_memory_snapshot_shares_nothing_the_reader_walks(run_python):
    # torch 2.11 shares "frames" lists between events (85 of 238 in one run) and nothing else.
    result = run_python(
        """
        from gpumem.trace.snapshot_file import from_dict
        torch.cuda.memory._record_memory_history(enabled="all")
        kept = [torch.empty(n << 20, device="cuda") for n in (1, 3, 1, 40, 2)]
        del kept[1:3]
        data = torch.cuda.memory._snapshot()
        frames = [e["frames"] for trace in data["device_traces"] for e in trace if e.get("frames")]
        loaded = from_dict(data)
        print(json.dumps({"events": sum(len(t) for t in loaded.traces.values()), "frames": len(frames)}))
        """
    )
    assert result["events"] >= 5 and result["frames"] >= 5


# ---- damaged files, in bulk -----------------------------------------------------------------------

FUZZ_CHILD = r"""
import importlib.util, json, resource, sys
tests_dir, module_path, count, memory = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
sys.path.insert(0, tests_dir)
import mutants
def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
for name in ("settings.echo", "settings.files", "trace.plain_data"):
    load_module("gpumem." + name, module_path.replace("trace/snapshot_file.py", name.replace(".", "/") + ".py"))
module = load_module("snapshot_file", module_path)
outcome = {"read": 0, "refused": 0, "other": []}
for n in range(count):
    try:
        module.loads(mutants.mutant(n), f"mutant {n}")
        outcome["read"] += 1
    except module.SnapshotError as error:
        outcome["refused"] += 1
        if "\n" in str(error) or not str(error).startswith(f"mutant {n}: "):
            outcome["other"].append([n, "message: " + str(error)[:300]])
    except Exception as error:
        outcome["other"].append([n, repr(error)[:300]])
with open("/proc/self/status") as status:
    peak = next(line for line in status if line.startswith("VmHWM:"))
outcome["peak_mib"] = int(peak.split()[1]) // 1024
print(json.dumps(outcome))
"""


def test_damaged_snapshots_are_read_or_refused_with_one_line_in_bounded_memory():
    count = int(os.environ.get("GPUMEM_FUZZ_COUNT", 1500))
    completed = subprocess.run([sys.executable, "-c", FUZZ_CHILD, str(pathlib.Path(__file__).parent),
                                snapshot_file.__file__, str(count), str(GiB)],
                               capture_output=True, text=True, timeout=60 + count / 100)
    assert completed.returncode == 0, completed.stderr[-3000:]
    outcome = json.loads(completed.stdout)
    assert outcome["other"] == [] and outcome["read"] + outcome["refused"] == count
    assert outcome["peak_mib"] < 100  # each is at most 16 KiB: Note [memory] allows it 2 MiB
