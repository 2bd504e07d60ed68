"""Sharing a GPU between processes, each member a process of its own (sharing_member.py) over a
simulated device of its own and one table file: membership across pid namespaces and forks, a dead
member's slot, and a table that a fault or a same-user writer cannot break (issue 39).

Members publish their figures and answer requests from a thread every ~20 ms: a test waits for
what it expects with a bound (WAIT), and asserts no timing but the bounds the behaviour names.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpumem import _C

GiB = 1 << 30
DEVICE = 8 * GiB
WAIT = 30.0  # the bound for "within a while": generous, for a loaded machine
HELPER = str(Path(__file__).with_name("sharing_member.py"))
BUSY_PID = 0xFFFFFFFF


# ---- the table's layout, for the tests that write it as a same-user process would -------------

U32_FIELDS = {"pid", "uid", "asks", "served"}
# Today's layout (csrc/core/share_table.h), where gpumem does not say its own.
FALLBACK_LAYOUT = {
    "header_bytes": 128, "slot_bytes": 128, "slots": 64,
    "fields": {"pid": 0, "uid": 4, "start_time": 8, "floor": 16, "reserved": 24, "in_use": 32, "asks": 40,
               "served": 44, "asks_served": 48, "given_back": 56, "asks_made": 64},
}


def layout() -> dict:
    return _C.share_table_layout() if hasattr(_C, "share_table_layout") else FALLBACK_LAYOUT


def table_bytes() -> int:
    shape = layout()
    return shape["header_bytes"] + shape["slots"] * shape["slot_bytes"]


class TableFile:
    """The table's file, opened for writing as any process of its user may."""

    def __init__(self, path: str):
        self._file = open(path, "r+b", buffering=0)  # noqa: SIM115 - closed by close()
        self._shape = layout()

    def close(self) -> None:
        self._file.close()

    def _where(self, slot: int, field: str) -> tuple[int, str]:
        shape = self._shape
        offset = shape["header_bytes"] + slot * shape["slot_bytes"] + shape["fields"][field]
        return offset, "<I" if field in U32_FIELDS else "<Q"

    def read(self, slot: int, field: str) -> int:
        offset, form = self._where(slot, field)
        return struct.unpack(form, os.pread(self._file.fileno(), struct.calcsize(form), offset))[0]

    def write(self, slot: int, field: str, value: int) -> None:
        offset, form = self._where(slot, field)
        os.pwrite(self._file.fileno(), struct.pack(form, value), offset)

    def slots(self) -> range:
        return range(self._shape["slots"])

    def slot_of(self, pid: int) -> int:
        found = [i for i in self.slots() if self.read(i, "pid") == pid]
        assert len(found) == 1, f"pid {pid} is in slots {found} of the table"
        return found[0]


# ---- members, each a process ---------------------------------------------------------------------


class Member:
    """A process running sharing_member.py; `prefix` runs it under another command (unshare)."""

    def __init__(self, name: str, logs: Path, prefix: tuple[str, ...] = ()):
        self.name = name
        self._log = logs / f"{name}.stderr"
        env = {key: value for key, value in os.environ.items() if not key.startswith("GPUMEM_")}
        with open(self._log, "w") as err:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True, cwd=str(Path(HELPER).parent), env=env, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self._next(WAIT, "start")["ready"]  # in its own pid namespace

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float, what: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"member {self.name}: no answer to {what!r} in {timeout:.0f} s") from None
        if line is None:
            pytest.fail(f"member {self.name} died ({self.ended()}) during {what!r}:\n{self.stderr()}")
        return json.loads(line)

    def ask(self, *words, timeout: float = WAIT) -> dict:
        command = " ".join(str(word) for word in words)
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pytest.fail(f"member {self.name} died ({self.ended()}) before {command!r}:\n{self.stderr()}")
        return self._next(timeout, command)

    def do(self, *words, timeout: float = WAIT) -> dict:
        """ask, failing the test on an error."""
        answer = self.ask(*words, timeout=timeout)
        assert "error" not in answer, f"member {self.name}: {' '.join(map(str, words))}: {answer}"
        return answer

    def join(self, table: str) -> None:
        self.do("join", table)

    def status(self) -> dict:
        return self.do("status")["status"]

    def others(self) -> list[dict]:
        return self.status()["others"]

    def alive(self) -> bool:
        return self.process.poll() is None

    def ended(self) -> str:
        code = self.process.wait(timeout=5) if self.process.poll() is None else self.process.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def stderr(self) -> str:
        return self._log.read_text()[-4000:]

    def kill(self) -> None:
        """SIGKILL to the member, reaped at once (a zombie has not gone for everyone)."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=WAIT)

    def end_everything(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: what it forked, unshare's child
        except ProcessLookupError:
            pass
        self.process.wait(timeout=WAIT)
        self.process.stdin.close()


@pytest.fixture
def start(tmp_path):
    """start(name, prefix=()) -> a running Member; every one is killed at the end."""
    started: list[Member] = []

    def make(name: str, prefix: tuple[str, ...] = ()) -> Member:
        member = Member(name, tmp_path, prefix)
        started.append(member)
        return member

    yield make
    for member in started:
        member.end_everything()


@pytest.fixture
def spare_processes():
    """The processes a test started beside the members (a Popen, or the pid of a member's forked
    child); each is killed at the end."""
    spares: list = []
    yield spares
    for spare in spares:
        if isinstance(spare, subprocess.Popen):
            spare.kill()
            spare.wait(timeout=WAIT)
            continue
        try:
            os.kill(spare, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def table(tmp_path) -> str:
    where = tmp_path / "run"
    where.mkdir(mode=0o700)
    return str(where / f"share-GPU-test-uid{os.geteuid()}.table")


def wait_for(condition, timeout: float = WAIT):
    """The condition's first true value, or its last value once `timeout` passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(0.02)


def floors(member: Member) -> list[int]:
    return sorted(other["floor"] for other in member.others())


def pids(member: Member) -> list[int]:
    return sorted(other["pid"] for other in member.others())


def with_floor(member: Member, floor: int) -> list[dict]:
    return [other for other in member.others() if other["floor"] == floor]


def ceiling_at_most(member: Member, bytes_: int) -> bool:
    ceiling = member.status()["ceiling"]
    return ceiling is not None and ceiling <= bytes_


def settled(member: Member, seconds: float = 1.0) -> None:
    """Lets a member's thread run many rounds (~20 ms each) before a check that something stays."""
    time.sleep(seconds)
    assert member.alive(), f"member {member.name} died ({member.ended()}):\n{member.stderr()}"


# ---- membership across pid namespaces ------------------------------------------------------------


def unshare_prefix() -> tuple[str, ...]:
    """The command that runs a member in a pid namespace of its own, or a skip if this user cannot."""
    command = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    try:
        tried = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("unshare (util-linux) is not installed")
    if tried.returncode != 0:
        if any(why in tried.stderr for why in ("Operation not permitted", "Permission denied")):
            pytest.skip(f"this user may not make a pid namespace: {tried.stderr.strip()}")
        pytest.fail(f"unshare failed: {tried.stderr.strip()}")
    return command


def test_members_in_different_pid_namespaces_count_each_other_and_a_dead_one_goes_for_all(table, start):
    prefix = unshare_prefix()
    a, c = start("A"), start("C")
    a.join(table)
    a.do("floor", 6 * GiB)
    c.join(table)
    b = start("B-in-container", prefix)
    b.join(table)
    b.do("floor", 1 * GiB)

    assert wait_for(lambda: floors(b) == [0, 6 * GiB]), f"B (own pid namespace) does not see A's floor: {b.others()}"
    assert wait_for(lambda: floors(c) == [1 * GiB, 6 * GiB]), f"C does not see both A and B: {c.others()}"
    assert wait_for(lambda: ceiling_at_most(c, DEVICE - 6 * GiB)), f"C may take A's floor: {c.status()}"
    settled(c)
    assert floors(c) == [1 * GiB, 6 * GiB], f"C lost a member once B had looked: {c.others()}"
    assert floors(b) == [0, 6 * GiB], f"B lost a member: {b.others()}"
    [a_from_b] = with_floor(b, 6 * GiB)
    [b_from_c] = with_floor(c, 1 * GiB)
    [a_from_c] = with_floor(c, 6 * GiB)
    assert a_from_b.get("same_pid_namespace", False) is False
    assert b_from_c.get("same_pid_namespace", False) is False
    assert a_from_c.get("same_pid_namespace", True) is True

    a.kill()
    assert wait_for(lambda: not with_floor(b, 6 * GiB)), f"B still counts the dead A: {b.others()}"
    assert wait_for(lambda: not with_floor(c, 6 * GiB)), f"C still counts the dead A: {c.others()}"
    d = start("D")
    d.join(table)
    assert wait_for(lambda: floors(d) == [0, 1 * GiB]), f"D does not see B and C alone: {d.others()}"


# ---- forks ---------------------------------------------------------------------------------------


def test_a_forked_child_that_exits_normally_leaves_its_parent_a_member(table, start):
    a, b = start("A"), start("B")
    a.join(table)
    a.do("floor", 2 * GiB)
    b.join(table)
    assert wait_for(lambda: floors(b) == [2 * GiB]), b.others()

    assert a.do("fork_exit")["child_exit"] == 0, "A's forked child did not exit normally within 20 s"
    settled(b)
    assert with_floor(b, 2 * GiB) and pids(b) == [a.pid], f"B lost A when A's child exited: {b.others()}"
    assert a.status()["floor"] == 2 * GiB


def test_a_member_killed_goes_although_a_forked_child_holds_its_files(table, start, spare_processes):
    a, b = start("A"), start("B")
    a.join(table)
    a.do("floor", 2 * GiB)
    b.join(table)
    assert wait_for(lambda: pids(b) == [a.pid]), b.others()
    child = a.do("fork_sleep")["child"]
    spare_processes.append(child)

    a.kill()
    assert wait_for(lambda: b.others() == []), f"B still counts the killed A: {b.others()}"
    os.kill(child, 0)  # the child lives on, with A's table open and mapped


# ---- a dead member -------------------------------------------------------------------------------


def test_a_member_killed_while_holding_its_slot_is_dropped_and_its_slot_reclaimed(table, start):
    a, c = start("A"), start("C")
    a.join(table)
    a.do("floor", 1 * GiB)
    a.do("malloc", 512 << 20)
    c.join(table)
    assert wait_for(lambda: pids(c) == [a.pid]), c.others()

    a.kill()
    assert wait_for(lambda: c.others() == []), f"C still counts the killed A: {c.others()}"
    d = start("D")
    d.join(table)
    assert wait_for(lambda: pids(d) == [c.pid]), f"D: {d.others()}"
    assert wait_for(lambda: pids(c) == [d.pid]), f"C: {c.others()}"


# ---- the table's file ----------------------------------------------------------------------------


def test_members_survive_their_table_truncated_and_report_it_or_share_again(table, start):
    a, b = start("A"), start("B")
    a.join(table)
    b.join(table)
    assert wait_for(lambda: pids(a) == [b.pid] and pids(b) == [a.pid])

    os.truncate(table, 0)
    for member in (a, b):
        member.do("churn", 2)  # malloc/free and status calls, with the thread running beside them
    assert a.alive() and b.alive()

    def damage_reported_or_sharing_again(member: Member, other: Member) -> bool:
        status = member.status()
        return status is not None and (status.get("problem") is not None or pids(member) == [other.pid])

    assert wait_for(lambda: damage_reported_or_sharing_again(a, b)), f"A: {a.status()}"
    assert wait_for(lambda: damage_reported_or_sharing_again(b, a)), f"B: {b.status()}"


def hold_lock_forever(path: str, spare_processes: list[int]) -> None:
    """Another process takes the table file's flock and never lets it go."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(1000)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    spare_processes.append(holder)
    assert holder.stdout.readline().strip() == "locked"


def join_bounded(member: Member, table: str, bound: float) -> tuple[dict, float]:
    """The member's join and how long it took; fails the test if it has not ended 5 s past the bound."""
    start_time = time.monotonic()
    try:
        answer = member.ask("join", table, timeout=bound + 5)
    except TimeoutError:
        pytest.fail(f"share_join still waiting after {bound + 5:.0f} s on a table whose lock another process holds")
    return answer, time.monotonic() - start_time


def test_a_held_creation_lock_on_a_fresh_table_ends_the_join_within_a_bound(table, start, spare_processes):
    os.close(os.open(table, os.O_CREAT | os.O_WRONLY, 0o600))  # zero bytes: nobody made the table yet
    hold_lock_forever(table, spare_processes)
    member = start("M")
    answer, took = join_bounded(member, table, 15)
    assert took <= 15, f"share_join took {took:.1f} s"
    if "error" in answer:  # a clear error; else it made a fresh table and joined
        assert answer["error"] == "RuntimeError" and table in answer["message"], answer


def test_a_held_lock_on_a_complete_table_does_not_stop_a_join(table, start, spare_processes):
    first = start("first")
    first.join(table)
    hold_lock_forever(table, spare_processes)
    member = start("M")
    answer, took = join_bounded(member, table, 15)
    assert "error" not in answer and took <= 15, (answer, f"{took:.1f} s")
    assert wait_for(lambda: pids(member) == [first.pid]), member.others()


def zero_filled(path: str, size: int) -> None:
    descriptor = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.ftruncate(descriptor, size)
    os.close(descriptor)


def test_a_half_created_table_with_no_live_member_is_taken_over(table, start):
    zero_filled(table, table_bytes())  # a creator killed after sizing the file
    a, b = start("A"), start("B")
    a.join(table)
    b.join(table)
    assert wait_for(lambda: pids(a) == [b.pid] and pids(b) == [a.pid]), (a.others(), b.others())


def test_a_table_file_of_a_wrong_size_with_no_live_member_is_remade_or_refused_clearly(table, start):
    zero_filled(table, table_bytes() // 2 + 8)
    a, b = start("A"), start("B")
    answer = a.ask("join", table)
    assert a.alive()
    if "error" in answer:
        message = answer["message"]
        assert answer["error"] == "RuntimeError" and table in message, answer
        assert any(what in message for what in ("remove", "delete", "move")), f"says not what to do: {message}"
        return
    b.join(table)
    assert wait_for(lambda: pids(a) == [b.pid] and pids(b) == [a.pid]), (a.others(), b.others())


# ---- what a same-user process writing the table can do ----------------------------------------


@pytest.fixture
def table_file(table):
    """table_file() -> the table, opened for writing once a member made it."""
    opened: list[TableFile] = []

    def open_it() -> TableFile:
        opened.append(TableFile(table))
        return opened[-1]

    yield open_it
    for handle in opened:
        handle.close()


def test_a_member_whose_served_count_is_forged_ahead_still_answers(table, start, table_file):
    a, b = start("A"), start("B")
    b.join(table)
    b.do("free", b.do("malloc", 2 * GiB)["ptr"])  # 2 GiB of free cache, that a request gives back
    assert b.do("reserved")["reserved"] == 2 * GiB
    a.join(table)
    assert wait_for(lambda: pids(a) == [b.pid])
    forged = table_file()
    slot = forged.slot_of(b.pid)
    forged.write(slot, "served", (forged.read(slot, "asks") + 2**31 - 1) & 0xFFFFFFFF)  # as far ahead as it goes

    def b_gave_back() -> bool:
        a.do("floor", 1 * GiB)  # asks the others for their free cache
        return b.do("reserved")["reserved"] == 0

    assert wait_for(b_gave_back), f"B no longer answers: {b.status()}"
    # B counts what it gave back a moment after the memory went.
    assert wait_for(lambda: b.status()["given_back"] >= 2 * GiB), b.status()


def test_a_member_republishes_its_floor_erased_in_the_file(table, start, table_file):
    a, b = start("A"), start("B")
    a.join(table)
    b.join(table)
    b.do("floor", 2 * GiB)
    assert wait_for(lambda: floors(a) == [2 * GiB])
    forged = table_file()
    forged.write(forged.slot_of(b.pid), "floor", 0)
    assert wait_for(lambda: floors(a) == [2 * GiB]), f"B's floor stays erased: {a.others()}"
    settled(a)
    assert floors(a) == [2 * GiB]


def test_slots_parked_busy_by_a_writer_do_not_stop_a_join(table, start, table_file):
    a = start("A")
    a.join(table)
    forged = table_file()
    mine = forged.slot_of(a.pid)
    for slot in forged.slots():
        if slot != mine:
            forged.write(slot, "pid", BUSY_PID)
    c = start("C")
    c.join(table)
    assert wait_for(lambda: pids(c) == [a.pid] and pids(a) == [c.pid]), (c.others(), a.others())


def test_a_forged_huge_floor_is_bounded_and_refusals_are_quick(table, start, table_file):
    a, b = start("A"), start("B")
    a.join(table)
    b.join(table)
    assert wait_for(lambda: pids(a) == [b.pid])
    forged = table_file()
    slot = forged.slot_of(b.pid)
    stop = threading.Event()

    def forge() -> None:  # a writer that keeps at it: the owner's republishing does not undo it for long
        while not stop.is_set():
            forged.write(slot, "floor", 2**64 - 1)
            time.sleep(0.002)

    writer = threading.Thread(target=forge, daemon=True)
    writer.start()
    try:
        time.sleep(0.2)
        outcome = a.do("mallocs", 1 * GiB, 20, timeout=60)
        status = a.status()
    finally:
        stop.set()
        writer.join()
    assert outcome["seconds"] <= 10, f"20 requests took {outcome['seconds']:.1f} s"
    for refusal in outcome["refusals"]:
        assert str(b.pid) in refusal, f"the refusal does not name the member whose floor holds the memory: {refusal}"
    assert status["ceiling"] is None or 0 <= status["ceiling"] <= DEVICE, status
    assert all(other["floor"] <= DEVICE for other in status["others"]), f"a floor above the device: {status['others']}"
