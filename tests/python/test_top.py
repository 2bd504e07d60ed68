"""`gpumem top` (gpumem.monitoring.top) over a fake NVML and real files that gpumem.monitoring.publish writes in tmp_path,
and the publisher itself over a simulated device. No GPU, no driver: NVML is the seam top.open_nvml,
/proc is the real one or a tree a test builds."""
from __future__ import annotations

import json
import stat
import re
import os
import subprocess
import sys
import types

import pytest

from gpumem import _C, cli
from gpumem.monitoring import nvml as _nvml, proc as _proc, publish, startup, top
from gpumem.monitoring import published as reading  # the name `published` is this file's helper
from gpumem.settings import environment
from gpumem.settings.run_dir import RunDir, default_run_dir

MiB, GiB = 1 << 20, 1 << 30
UUID = "5e4f0c7a-1111-2222-3333-444455556666"
OTHER_UUID = "0a0b0c0d-1111-2222-3333-444455556666"


class FakeNvml:
    """What gpumem top reads the GPUs through: the GPUs a test gives."""

    def __init__(self, *gpus: _nvml.Gpu):
        self._gpus = list(gpus)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def gpus(self):
        return self._gpus


def gpu(index: int = 0, uuid: str = UUID, processes: dict | None = None) -> _nvml.Gpu:
    """A 140 GiB GPU with these processes: pid -> bytes the driver counts."""
    listed = tuple(_nvml.GpuProcess(pid, used) for pid, used in (processes or {}).items())
    return _nvml.Gpu(index, "NVIDIA H200", f"GPU-{uuid}", 140 * GiB, sum(p.used or 0 for p in listed), listed)


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    where = RunDir(str(tmp_path / "run"), chosen=True)
    publish.prepare(where)
    return where


def identity(pid: int | None = None, job: str = "bert", **changes) -> dict:
    """A process's identity as it publishes it, read from /proc (this process's by default)."""
    pid = os.getpid() if pid is None else pid
    found = {"pid": pid, "start_time": _proc.start_time(pid), "pid_namespace": _proc.pid_namespace(pid), "job": job}
    return {**found, **changes}


def published(run_dir, reserved: int, limit: int = 2 * GiB, uuid: str | None = UUID, outside: int | None = None,
              **who) -> publish.Publisher:
    """A process's file, written by a Publisher over a simulated device holding `reserved` bytes
    (a multiple of 2 MiB) under `limit`; with `outside`, a limit on the whole process, which holds
    that much more outside gpumem."""
    sim = _C.SimAllocator(8 * GiB)
    sim.set_limit_bytes(0, limit)
    sim.set_growable(0, False)
    if outside is not None:
        sim.set_use_outside(0, outside)
        sim.set_scope(0, "process")
    sim.malloc(0, reserved)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(**who), uuid_of=lambda device: uuid)
    assert publisher.step()
    return publisher


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def sleeper():
    """Another live process."""
    child = subprocess.Popen(["sleep", "600"])
    yield child.pid
    child.kill()
    child.wait()


def view(run_dir, *gpus, warn_at: float = 0.85, **where):
    return top.collect(FakeNvml(*gpus), [run_dir.path], warn_at, **where)


def json_of(run_dir, *gpus, args=(), monkeypatch, capsys) -> dict:
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(*gpus))
    monkeypatch.setenv("GPUMEM_RUN_DIR", run_dir.path)
    monkeypatch.delenv("GPUMEM_WARN_AT", raising=False)
    assert cli.main(["top", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def table_of(run_dir, *gpus, args=(), monkeypatch, capsys) -> list[str]:
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(*gpus))
    monkeypatch.setenv("GPUMEM_RUN_DIR", run_dir.path)
    monkeypatch.delenv("GPUMEM_WARN_AT", raising=False)
    assert cli.main(["top", *args]) == 0
    return capsys.readouterr().out.splitlines()


def row_of(lines: list[str], pid: int) -> str:
    [line] = [line for line in lines if f" {pid} " in line]
    return line


# ---- what gpumem top shows ----------------------------------------------------------------------


def test_the_table_lists_every_gpu_and_each_process_with_what_the_driver_counts(run_dir, monkeypatch, capsys):
    lines = table_of(run_dir, gpu(0, processes={4001: 3 * GiB}), gpu(1, OTHER_UUID, processes={4002: 5 * GiB}),
                     monkeypatch=monkeypatch, capsys=capsys)
    assert lines[0].startswith(f"GPU 0  NVIDIA H200  GPU-{UUID}  3.00 GiB of 140.00 GiB used")
    assert lines[1].startswith("GPU 1  NVIDIA H200")
    assert row_of(lines, 4001).split()[:2] == ["0", "4001"] and "3.00 GiB" in row_of(lines, 4001)
    assert row_of(lines, 4002).split()[:2] == ["1", "4002"] and "5.00 GiB" in row_of(lines, 4002)


def test_json_lists_the_gpus_and_the_processes_with_the_drivers_figures(run_dir, monkeypatch, capsys):
    document = json_of(run_dir, gpu(0, processes={4001: 3 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    assert document["format"] == "gpumem-top/1"
    assert document["gpus"][0]["uuid"] == f"GPU-{UUID}" and document["gpus"][0]["total_bytes"] == 140 * GiB
    [process] = document["processes"]
    assert process["gpu"] == 0 and process["pid"] == 4001 and process["used_bytes"] == 3 * GiB
    assert process["in_nvml"] is True and process["gpumem"] is None


def test_a_gpumem_process_is_joined_by_pid_with_its_published_figures(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB, limit=2 * GiB, job="bert")
    pid = os.getpid()
    document = json_of(run_dir, gpu(0, processes={pid: 1280 * MiB, 4001: GiB}), monkeypatch=monkeypatch,
                       capsys=capsys)
    [ours] = [p for p in document["processes"] if p["pid"] == pid]
    assert ours["job"] == "bert" and ours["used_bytes"] == 1280 * MiB and ours["in_nvml"]
    figures = ours["gpumem"]
    assert figures["limit_bytes"] == 2 * GiB
    assert figures["reserved_bytes"] == figures["reserved_peak_bytes"] == figures["allocated_bytes"] == 1 * GiB
    assert figures["ooms"] == {"over_limit": 0, "device_full": 0, "fragmentation": 0}
    assert figures["share_of_limit"] == 0.5 and figures["past_warn_at"] is False
    [other] = [p for p in document["processes"] if p["pid"] == 4001]
    assert other["gpumem"] is None


def test_the_table_shows_the_joined_figures_in_their_columns(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB, limit=2 * GiB, job="bert")
    lines = table_of(run_dir, gpu(0, processes={os.getpid(): 1280 * MiB}), monkeypatch=monkeypatch, capsys=capsys)
    header = next(line for line in lines if "RESERVED" in line).split()
    assert header == ["GPU", "PID", "USER", "JOB", "USED", "LIMIT", "ALLOCATED", "RESERVED", "PEAK", "OOMS", "CAP",
                      "NOTE"]
    cells = row_of(lines, os.getpid()).split()
    assert cells[:2] == ["0", str(os.getpid())]
    assert cells[3:] == ["bert", "1.25", "GiB", "2.00", "GiB", "1.00", "GiB", "1.00", "GiB", "1.00", "GiB", "0", "50%"]


def test_a_device_is_matched_to_its_gpu_by_uuid(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB, uuid=OTHER_UUID)
    pid = os.getpid()
    document = json_of(run_dir, gpu(0, UUID, {pid: GiB}), gpu(1, OTHER_UUID, {pid: 2 * GiB}),
                       monkeypatch=monkeypatch, capsys=capsys)
    by_gpu = {p["gpu"]: p for p in document["processes"]}
    assert by_gpu[0]["gpumem"] is None  # the process has a context there, and no gpumem memory
    assert by_gpu[1]["gpumem"]["reserved_bytes"] == GiB


@pytest.mark.parametrize("uuid", [None, "MIG-7a7a7a7a-1111-2222-3333-444455556666"], ids=["unknown", "mig"])
def test_a_device_whose_uuid_names_no_gpu_is_matched_by_the_one_gpu_nvml_lists_the_pid_on(
        run_dir, monkeypatch, capsys, uuid):
    published(run_dir, reserved=1 * GiB, uuid=uuid)
    pid = os.getpid()
    document = json_of(run_dir, gpu(0, UUID, {4001: GiB}), gpu(1, OTHER_UUID, {pid: 2 * GiB}),
                       monkeypatch=monkeypatch, capsys=capsys)
    [ours] = [p for p in document["processes"] if p["pid"] == pid]
    assert ours["gpu"] == 1 and ours["in_nvml"] and ours["gpumem"]["reserved_bytes"] == GiB


def test_a_process_past_the_share_of_its_cap_is_marked(run_dir, monkeypatch, capsys, sleeper):
    published(run_dir, reserved=1800 * MiB, limit=2 * GiB)  # 88%
    published(run_dir, reserved=1 * GiB, limit=2 * GiB, pid=sleeper)
    pid = os.getpid()
    lines = table_of(run_dir, gpu(0, processes={pid: 2 * GiB, sleeper: GiB}), monkeypatch=monkeypatch, capsys=capsys)
    assert row_of(lines, pid).startswith("!") and "88%" in row_of(lines, pid)
    assert not row_of(lines, sleeper).startswith("!")
    assert "! reserved at 85% of its limit or more (--warn-at, GPUMEM_WARN_AT)" in lines


def test_warn_at_sets_the_share_past_which_a_process_is_marked(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1800 * MiB, limit=2 * GiB)
    document = json_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), args=["--warn-at", "0.9"],
                       monkeypatch=monkeypatch, capsys=capsys)
    assert document["warn_at"] == 0.9
    assert document["processes"][0]["gpumem"]["past_warn_at"] is False


def test_gpumem_warn_at_is_the_default_share(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB, limit=2 * GiB)
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(gpu(0, processes={os.getpid(): GiB})))
    monkeypatch.setenv("GPUMEM_RUN_DIR", run_dir.path)
    monkeypatch.setenv("GPUMEM_WARN_AT", "0.5")
    assert cli.main(["top", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["processes"][0]["gpumem"]["past_warn_at"] is True


def test_a_process_without_a_limit_shows_none_and_its_share_of_the_device(run_dir, monkeypatch, capsys):
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 2 * GiB)
    publish.Publisher(run_dir, source=FixedTotal(sim, 8 * GiB), identity=identity(), uuid_of=lambda d: UUID).step()
    lines = table_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    assert "none" in row_of(lines, os.getpid()).split() and "25%" in row_of(lines, os.getpid())


class FixedTotal:
    """A simulated device that says its total, as gpumem._C does."""

    def __init__(self, sim, total: int):
        self.sim, self.total = sim, total

    def existing_devices(self):
        return self.sim.existing_devices()

    def device_figures(self, device, device_memory=True):
        return self.sim.device_figures(device, device_memory)

    def device_total(self, device):
        return self.total


def test_a_limit_on_the_whole_process_is_shown_with_what_is_outside_and_counted_in_the_share(
        run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB, limit=2 * GiB, outside=800 * MiB)
    nvml = gpu(0, processes={os.getpid(): 1 * GiB + 800 * MiB})
    document = json_of(run_dir, nvml, monkeypatch=monkeypatch, capsys=capsys)
    [ours] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    assert ours["gpumem"]["scope"] == "process" and ours["gpumem"]["process_outside_bytes"] == 800 * MiB
    assert ours["gpumem"]["share_of_limit"] == pytest.approx((1 * GiB + 800 * MiB) / (2 * GiB))
    assert ours["gpumem"]["past_warn_at"] is True  # 89% of the limit; reserved alone is 50%
    row = row_of(table_of(run_dir, nvml, monkeypatch=monkeypatch, capsys=capsys), os.getpid())
    assert row.endswith("limit on the whole process, 800.00 MiB outside gpumem")


def test_a_process_with_a_paused_region_shows_the_bytes_paused(run_dir, monkeypatch, capsys):
    sim = _C.SimAllocator(8 * GiB, page_size=2 * MiB)
    sim.region_create(0, 1)
    sim.region_begin(0, 1)
    sim.malloc(0, 300 * MiB)
    sim.region_end(0, 1)
    paused = sim.region_pause(0, 1, False)
    assert publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda device: UUID).step()
    nvml = gpu(0, processes={os.getpid(): 500 * MiB})
    document = json_of(run_dir, nvml, monkeypatch=monkeypatch, capsys=capsys)
    [ours] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    assert ours["gpumem"]["paused_bytes"] == paused >= 300 * MiB
    row = row_of(table_of(run_dir, nvml, monkeypatch=monkeypatch, capsys=capsys), os.getpid())
    assert row.endswith(f"{_C.format_bytes(paused)} paused (gpumem.pause)")


def test_a_published_process_that_nvml_does_not_list_is_shown_flagged(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=1 * GiB)
    document = json_of(run_dir, gpu(0, processes={4001: GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [ours] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    assert ours["in_nvml"] is False and ours["gpu"] == 0 and ours["used_bytes"] is None
    assert ours["gpumem"]["reserved_bytes"] == GiB
    lines = table_of(run_dir, gpu(0, processes={4001: GiB}), monkeypatch=monkeypatch, capsys=capsys)
    assert row_of(lines, os.getpid()).endswith("not in NVML's list")


def test_a_gpu_that_cannot_be_read_is_listed_with_its_error(run_dir, monkeypatch, capsys):
    broken = _nvml.Gpu(1, "NVIDIA H200", "GPU-x", None, None, error="Unknown Error")
    lines = table_of(run_dir, gpu(0), broken, monkeypatch=monkeypatch, capsys=capsys)
    assert "GPU 1  NVIDIA H200  GPU-x: cannot be read (Unknown Error)" in lines


def test_a_job_name_with_control_characters_is_escaped_in_the_table(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=GiB, job="\x1b[2Jbad")
    out = "\n".join(table_of(run_dir, gpu(0, processes={os.getpid(): GiB}), monkeypatch=monkeypatch, capsys=capsys))
    assert "\x1b" not in out and "\\x1b[2Jbad" in out


# ---- stale files --------------------------------------------------------------------------------


def test_the_file_of_a_pid_that_no_longer_exists_is_ignored_and_removed(run_dir):
    pid = dead_pid()
    publisher = published(run_dir, reserved=GiB, pid=pid, start_time=12345, pid_namespace=_proc.pid_namespace("self"))
    shown = view(run_dir, gpu(0, processes={4001: GiB}))
    assert [row.pid for row in shown.rows] == [4001]
    assert shown.stale_removed == 1 and not os.path.exists(publisher.path)


def test_the_file_of_a_pid_whose_start_time_differs_is_ignored_and_removed(run_dir):
    mine = identity()
    publisher = published(run_dir, reserved=GiB, start_time=mine["start_time"] + 1)  # the pid reused since
    shown = view(run_dir, gpu(0, processes={os.getpid(): GiB}))
    assert [(row.pid, row.figures) for row in shown.rows] == [(os.getpid(), None)]
    assert shown.stale_removed == 1 and not os.path.exists(publisher.path)


def test_a_stale_file_written_again_since_it_was_read_is_not_removed(run_dir):
    publisher = published(run_dir, reserved=GiB, start_time=1)
    [entry], _ = reading.read_entries(run_dir.path)
    publish.write_atomically(publisher.path, {"format": 1, **identity(), "devices": []})  # a new process, same pid
    assert reading.remove_if_unchanged(entry) is False
    assert os.path.exists(publisher.path)


def test_the_count_of_removed_files_is_said_under_the_table(run_dir, monkeypatch, capsys):
    published(run_dir, reserved=GiB, pid=dead_pid(), start_time=1, pid_namespace=_proc.pid_namespace("self"))
    lines = table_of(run_dir, gpu(0), monkeypatch=monkeypatch, capsys=capsys)
    assert "1 stale figures file(s) of ended processes removed" in lines


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "Expecting property name"),
    (b'{"format": 2}', "not a gpumem figures file of format 1"),
    (b'[1, 2]', "not a gpumem figures file of format 1"),
    (b'{"format": 1, "pid": 1}', "its pid is not the one its name says"),
    (b" " * (reading.MAX_FILE_BYTES + 1), "larger than 65536 bytes"),
    (b"[" * 60_000, "maximum recursion depth exceeded"),
])
def test_a_file_that_is_not_a_figures_file_is_skipped_and_named(run_dir, monkeypatch, capsys, content, reason):
    path = os.path.join(run_dir.path, "4001.json")
    with open(path, "wb") as file:
        file.write(content)
    document = json_of(run_dir, gpu(0, processes={4001: GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [problem] = document["problems"]
    assert problem.startswith(f"'{path}': ") and reason in problem
    assert document["processes"][0]["gpumem"] is None


def test_bad_figures_in_a_file_are_skipped(run_dir):
    payload = {"format": 1, **identity(), "devices": [{"index": 0, "uuid": None, "limit": -1}]}
    publish.write_atomically(os.path.join(run_dir.path, f"{os.getpid()}.json"), payload)
    entries, [problem] = reading.read_entries(run_dir.path)
    assert entries == [] and "ooms is not an object" in problem


def test_a_fifo_under_a_figures_files_name_is_skipped_without_blocking(run_dir):
    os.mkfifo(os.path.join(run_dir.path, "4001.json"))
    entries, [problem] = reading.read_entries(run_dir.path)
    assert entries == [] and "not a regular file" in problem


def test_the_default_run_dirs_are_each_users_own(tmp_path):
    uid = os.geteuid()
    (tmp_path / f"gpumem-{uid}").mkdir()
    (tmp_path / f"gpumem-{uid + 1}").mkdir()  # owned by this user, named for another: a plant
    (tmp_path / f"gpumem-{uid + 2}").symlink_to(tmp_path / f"gpumem-{uid}")
    (tmp_path / "other").mkdir()
    assert reading.run_dirs(default_run_dir(), base=str(tmp_path)) == [str(tmp_path / f"gpumem-{uid}")]


def test_gpumem_run_dir_is_the_only_dir_read_when_set(tmp_path):
    chosen = environment.run_dir({"GPUMEM_RUN_DIR": str(tmp_path / "shared")})
    assert reading.run_dirs(chosen, base=str(tmp_path)) == [str(tmp_path / "shared")]


# ---- pid namespaces (a /proc tree of the test's own) --------------------------------------------


def fake_proc(root, processes: dict[int, tuple[int, list[int]]], namespace: str = "pid:[1]", uid: int | None = None) -> str:
    """A /proc with these processes: pid -> (start time, NSpid), each run by `uid` (this process's
    by default), and this process's namespace."""
    uid = os.geteuid() if uid is None else uid
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "ns" / "pid").symlink_to(namespace)
    for pid, (started, ns_pids) in processes.items():
        (root / str(pid)).mkdir()
        fields = ["S"] + ["0"] * 18 + [str(started)] + ["0"] * 5
        (root / str(pid) / "stat").write_text(f"{pid} (python (x)) {' '.join(fields)}\n")
        (root / str(pid) / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nNSpid:\t"
                                                + "\t".join(map(str, ns_pids)) + "\n")
    return str(root)


def test_a_container_process_is_joined_by_the_host_pid_its_nspid_gives(run_dir, tmp_path):
    published(run_dir, reserved=GiB, pid=17, start_time=5000, pid_namespace="pid:[99]", job="in-a-container")
    proc = fake_proc(tmp_path / "proc", {4242: (5000, [4242, 17]), 4243: (6000, [4243, 17])})
    [row] = view(run_dir, gpu(0, processes={4242: 2 * GiB}), proc=proc).rows
    assert (row.pid, row.own_pid, row.job, row.in_nvml) == (4242, 17, "in-a-container", True)
    assert row.figures["reserved"] == GiB


def test_a_process_of_a_namespace_not_seen_from_here_is_shown_until_its_file_goes_stale(run_dir, tmp_path):
    publisher = published(run_dir, reserved=GiB, pid=23, start_time=5000, pid_namespace="pid:[77]")
    proc = fake_proc(tmp_path / "proc", {})
    written = os.stat(publisher.path).st_mtime
    [row] = view(run_dir, gpu(0), proc=proc, now=written + 10).rows
    assert (row.pid, row.own_pid, row.in_nvml, row.gpu) == (None, 23, False, 0)
    stale = view(run_dir, gpu(0), proc=proc, now=written + reading.STALE_SECONDS + 1)
    assert stale.rows == [] and stale.stale_removed == 1 and not os.path.exists(publisher.path)


def test_a_process_of_this_namespace_is_checked_by_its_pid_and_start_time(run_dir, tmp_path):
    published(run_dir, reserved=GiB, pid=31, start_time=700, pid_namespace="pid:[1]")
    proc = fake_proc(tmp_path / "proc", {31: (700, [31])})
    [row] = view(run_dir, gpu(0, processes={31: GiB}), proc=proc).rows
    assert row.pid == 31 and row.figures is not None


# ---- the command ----------------------------------------------------------------------------------


def test_without_pynvml_top_says_what_to_install_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert cli.main(["top"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpumem: error: gpumem top reads the GPUs through NVML, with the nvidia-ml-py package")
    assert "pip install nvidia-ml-py" in err and "Traceback" not in err


def test_nvml_that_cannot_start_is_an_error_with_status_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(start_error="Driver Not Loaded"))
    assert cli.main(["top"]) == 2
    assert "NVML cannot be started (Driver Not Loaded): is the NVIDIA driver installed" in capsys.readouterr().err


def test_watch_refreshes_until_ctrl_c_and_exits_130_quietly(run_dir, monkeypatch, capsys):
    refreshes = []

    def interrupted(seconds):
        refreshes.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(top, "sleep", interrupted)
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(gpu(0, processes={4001: GiB})))
    monkeypatch.setenv("GPUMEM_RUN_DIR", run_dir.path)
    assert cli.main(["top", "--watch", "1.5"]) == 130
    out, err = capsys.readouterr()
    assert refreshes == [1.5] and err == ""
    assert out.startswith("gpumem top, every 1.5 s (Ctrl-C ends it)") and " 4001 " in out


def test_watch_with_json_prints_one_document_a_line_per_refresh(run_dir, monkeypatch, capsys):
    calls = []

    def twice(seconds):
        calls.append(seconds)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(top, "sleep", twice)
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(gpu(0)))
    monkeypatch.setenv("GPUMEM_RUN_DIR", run_dir.path)
    assert cli.main(["top", "--watch", "--json"]) == 130
    lines = capsys.readouterr().out.splitlines()
    assert calls == [2.0, 2.0] and [json.loads(line)["format"] for line in lines] == ["gpumem-top/1"] * 2


@pytest.mark.parametrize("args, needle", [
    (["--watch", "0"], "'0' is not a number of seconds from 0.1 to 86400"),
    (["--watch", "nan"], "'nan' is not a number of seconds"),
    (["--warn-at", "85%"], "'85%' is not a share of the limit in (0, 1]"),
    (["--warn-at", "0"], "'0' is not a share of the limit in (0, 1]"),
])
def test_bad_top_arguments_are_usage_errors(capsys, args, needle):
    with pytest.raises(SystemExit) as caught:
        cli.main(["top", *args])
    assert caught.value.code == 2 and needle in capsys.readouterr().err


def test_a_relative_gpumem_run_dir_is_an_error_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(top, "open_nvml", lambda: FakeNvml(gpu(0)))
    monkeypatch.setenv("GPUMEM_RUN_DIR", "run")
    assert cli.main(["top"]) == 2
    assert "GPUMEM_RUN_DIR='run' cannot be applied: give an absolute path" in capsys.readouterr().err


# ---- NVML through pynvml ------------------------------------------------------------------------


def fake_pynvml(start_error: str | None = None, broken: int | None = None):
    """A pynvml module over two GPUs: 0 with two processes (the second's memory unknown), 1 empty."""
    class NVMLError(Exception):
        pass

    processes = {0: [types.SimpleNamespace(pid=11, usedGpuMemory=3 * GiB),
                     types.SimpleNamespace(pid=12, usedGpuMemory=None)], 1: []}

    def start():
        if start_error:
            raise NVMLError(start_error)

    def handle(index):
        if index == broken:
            raise NVMLError("GPU is lost")
        return index

    return types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=start, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetComputeRunningProcesses=lambda h: processes[h],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=140 * GiB, used=(3 + h) * GiB))


def test_nvml_gives_each_gpu_with_its_processes_and_their_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    with _nvml.Nvml() as nvml:
        first, second = nvml.gpus()
    assert (first.index, first.name, first.uuid, first.total, first.used) == (0, "NVIDIA H200", "GPU-0", 140 * GiB,
                                                                               3 * GiB)
    assert first.processes == (_nvml.GpuProcess(11, 3 * GiB), _nvml.GpuProcess(12, None))
    assert second.processes == () and second.error is None


def test_a_gpu_nvml_cannot_read_comes_with_its_error_and_the_others_still_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(broken=0))
    with _nvml.Nvml() as nvml:
        first, second = nvml.gpus()
    assert first.error == "GPU is lost" and first.processes == ()
    assert second.error is None and second.used == 4 * GiB


# ---- publishing -----------------------------------------------------------------------------------


def test_nothing_is_published_before_a_device_has_held_memory(run_dir):
    sim = _C.SimAllocator(GiB, 2)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None)
    assert publisher.step()
    assert os.listdir(run_dir.path) == []


def test_the_file_holds_the_identity_and_the_figures_of_each_device_in_use(run_dir):
    sim = _C.SimAllocator(8 * GiB, 2)
    sim.set_limit_bytes(1, 4 * GiB)
    sim.free(sim.malloc(1, 300 * MiB))
    sim.malloc(1, 100 * MiB)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(job="bert"), uuid_of=lambda d: f"uuid-{d}")
    publisher.step()
    with open(publisher.path) as file:
        content = json.load(file)
    assert content["format"] == 1 and content["job"] == "bert"
    assert (content["pid"], content["start_time"]) == (os.getpid(), _proc.start_time(os.getpid()))
    assert content["pid_namespace"] == os.readlink("/proc/self/ns/pid")
    [device] = content["devices"]  # device 0 was never used: not asked, not made
    stats = sim.stats(1)
    assert device["index"] == 1 and device["uuid"] == "uuid-1" and device["limit"] == 4 * GiB
    assert device["reserved"] == stats["reserved_bytes.all.current"]
    assert device["allocated"] == 100 * MiB and device["allocated_peak"] == 300 * MiB
    assert device["reserved_peak"] == stats["reserved_bytes.all.peak"]
    assert sim.existing_devices() == [1]


def test_the_file_counts_out_of_memory_errors_by_case(run_dir):
    sim = _C.SimAllocator(8 * GiB)
    sim.set_limit_bytes(0, 100 * MiB)
    with pytest.raises(MemoryError):
        sim.malloc(0, 200 * MiB)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None)
    publisher.step()
    with open(publisher.path) as file:
        assert json.load(file)["devices"][0]["ooms"] == {"over_limit": 1, "device_full": 0, "fragmentation": 0}


def test_the_file_is_replaced_whole_by_renaming_a_temporary_beside_it(run_dir, monkeypatch):
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(publish.os, "replace", lambda src, dst: (renames.append((src, dst)), real_replace(src, dst)))
    publisher = published(run_dir, reserved=GiB)
    [(temporary, final)] = renames
    assert final == publisher.path and os.path.dirname(temporary) == run_dir.path
    name = os.path.basename(publisher.path)
    assert os.path.basename(temporary).startswith(f".{name}.") and temporary.endswith(".tmp")
    assert os.listdir(run_dir.path) == [name]
    assert os.stat(publisher.path).st_mode & 0o777 == 0o600


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(run_dir, monkeypatch):
    path = os.path.join(run_dir.path, "4001.json")
    publish.write_atomically(path, {"figures": "old"})

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish.os, "replace", full)
    with pytest.raises(OSError, match="No space left on device"):
        publish.write_atomically(path, {"figures": "new"})
    assert os.listdir(run_dir.path) == ["4001.json"]
    with open(path) as file:
        assert json.load(file) == {"figures": "old"}


def _keeping(function, calls: list):
    def keep(*args):
        calls.append(args)
        return function(*args)

    return keep


def test_the_publisher_rewrites_the_file_only_when_a_figure_changed(run_dir, monkeypatch):
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 100 * MiB)
    writes = []
    monkeypatch.setattr(publish, "write_atomically", _keeping(publish.write_atomically, writes))
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None,
                                  clock=lambda: 0.0)
    publisher.step()
    publisher.step()
    assert len(writes) == 1
    sim.malloc(0, 100 * MiB)
    publisher.step()
    assert len(writes) == 2
    with open(publisher.path) as file:
        assert json.load(file)["devices"][0]["allocated"] == 200 * MiB


def clocked_publisher(run_dir):
    """A Publisher over a simulated device holding 100 MiB, on a clock the test sets (now[0]), that
    has written its file once at time 0."""
    now = [0.0]
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 100 * MiB)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None,
                                  clock=lambda: now[0])
    publisher.step()
    return publisher, now


def test_an_unchanged_file_is_touched_at_each_heartbeat(run_dir):
    publisher, now = clocked_publisher(run_dir)
    os.utime(publisher.path, (1, 1))
    now[0] = publish.HEARTBEAT_SECONDS - 1
    publisher.step()
    assert os.stat(publisher.path).st_mtime == 1
    now[0] = publish.HEARTBEAT_SECONDS
    publisher.step()
    assert os.stat(publisher.path).st_mtime > 1


def test_a_file_removed_from_under_the_publisher_is_written_again_at_the_heartbeat(run_dir):
    publisher, now = clocked_publisher(run_dir)
    os.unlink(publisher.path)
    now[0] = publish.HEARTBEAT_SECONDS
    assert publisher.step()
    with open(publisher.path) as file:
        assert json.load(file)["devices"][0]["allocated"] == 100 * MiB


def test_stop_removes_the_file_and_nothing_is_written_after(run_dir):
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 100 * MiB)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None)
    publisher.step()
    publisher.stop()
    assert os.listdir(run_dir.path) == []
    sim.malloc(0, 100 * MiB)
    assert publisher.step() is False
    assert os.listdir(run_dir.path) == []


def test_the_thread_publishes_and_stop_ends_it(run_dir):
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 100 * MiB)
    publisher = publish.Publisher(run_dir, source=sim, identity=identity(), uuid_of=lambda d: None)
    publisher.start()  # the first step runs at once
    publisher.stop()
    publisher._thread.join()
    assert os.listdir(run_dir.path) == []


def test_a_forked_child_leaves_its_parents_file_alone(run_dir):
    publisher = published(run_dir, reserved=GiB)
    child = os.fork()
    if child == 0:
        publisher.stop()
        os._exit(0)
    os.waitpid(child, 0)
    assert os.path.exists(publisher.path)


class Failing:
    def existing_devices(self):
        return [0]

    def device_figures(self, device, device_memory=True):
        raise RuntimeError("the figures cannot be read")


def test_an_error_is_one_line_on_stderr_then_publishing_stops_without_raising(run_dir, capsys):
    publisher = publish.Publisher(run_dir, source=Failing(), identity=identity(), uuid_of=lambda d: None)
    assert publisher.step() is False
    assert publisher.step() is False
    [line] = capsys.readouterr().err.splitlines()
    assert line == ("gpumem: figures for `gpumem top` are no longer published (the figures cannot be read); the "
                    "program goes on (GPUMEM_PUBLISH=0 turns publishing off).")


def test_a_default_run_dir_another_user_could_enter_is_refused(tmp_path):
    path = tmp_path / "gpumem-x"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    with pytest.raises(PermissionError, match="is not a private directory of this user .* set GPUMEM_RUN_DIR"):
        publish.prepare(RunDir(str(path)))


def test_a_default_run_dir_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "gpumem-x").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="is not a private directory of this user"):
        publish.prepare(RunDir(str(tmp_path / "gpumem-x")))


def test_a_missing_run_dir_is_made_private(tmp_path):
    publish.prepare(RunDir(str(tmp_path / "gpumem-x")))
    assert os.stat(tmp_path / "gpumem-x").st_mode & 0o777 == 0o700


def test_a_run_dir_that_cannot_be_used_is_one_line_and_the_program_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(startup, "_process_publisher", None)
    (tmp_path / "file").write_text("")
    assert startup.publish_for_environment(RunDir(str(tmp_path / "file" / "run"), chosen=True)) is None
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"gpumem: figures for `gpumem top` are not published in '{tmp_path}/file/run' (")
    assert line.endswith("the program goes on (GPUMEM_PUBLISH=0 turns publishing off).")


# ---- GPUMEM_PUBLISH, GPUMEM_RUN_DIR ---------------------------------------------------------------


def test_publishing_is_on_by_default_in_the_default_run_dir():
    assert environment.publish_dir({}) == RunDir(f"/tmp/gpumem-{os.geteuid()}")


def test_gpumem_publish_0_turns_publishing_off():
    assert environment.publish_dir({"GPUMEM_PUBLISH": "0"}) is None


def test_gpumem_run_dir_chooses_the_directory():
    assert environment.publish_dir({"GPUMEM_RUN_DIR": "/srv/gpumem/"}) == RunDir("/srv/gpumem", chosen=True)


@pytest.mark.parametrize("variable, text, forms", [
    ("GPUMEM_PUBLISH", "yes", 'give "1" (publish, the default) or "0"'),
    ("GPUMEM_RUN_DIR", "relative/run", "give an absolute path of a directory"),
    ("GPUMEM_RUN_DIR", "", "give an absolute path of a directory"),
])
def test_a_bad_publishing_setting_names_the_variable_and_the_accepted_forms(variable, text, forms):
    with pytest.raises(ValueError, match=rf"{variable}=.* cannot be applied: {re.escape(forms)}"):
        environment.publish_dir({variable: text})


def test_a_bad_gpumem_publish_at_autoload_stops_the_program(hook_devices, stopped, monkeypatch):
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_PUBLISH", "on")
    assert stopped().startswith('gpumem: bad GPUMEM_PUBLISH "on": give "1" (publish, the default) or "0"')


def test_publishing_starts_when_cuda_starts_in_the_run_dir(hook_devices, monkeypatch, tmp_path):
    from gpumem import _autoload

    queued, started = [], []
    monkeypatch.setattr(startup.torch.cuda, "_lazy_call", queued.append)
    monkeypatch.setattr(startup, "publish_for_environment", started.append)
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("GPUMEM_PUBLISH", raising=False)
    _autoload.install()
    assert started == []
    [start] = queued
    start()
    assert started == [RunDir(str(tmp_path), chosen=True)]


def test_with_gpumem_publish_0_nothing_is_queued_for_cuda_start(hook_devices, monkeypatch):
    from gpumem import _autoload

    queued = []
    monkeypatch.setattr(startup.torch.cuda, "_lazy_call", queued.append)
    hook_devices("4GB")
    monkeypatch.setenv("GPUMEM_PUBLISH", "0")
    monkeypatch.delenv("GPUMEM_METRICS_PORT", raising=False)
    _autoload.install()
    assert queued == []


# ---- whose figures: Note [whose figures] in gpumem.monitoring.top --------------------------------------------

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user owns needs root")
OTHER_UID = 54321  # a user with no name on the machine: shown by its uid


def another_users(path) -> None:
    os.chown(path, OTHER_UID, OTHER_UID)


@pytest.fixture
def planted_dir(tmp_path) -> RunDir:
    """Another user's run directory, private to them."""
    where = RunDir(str(tmp_path / "planted"), chosen=True)
    publish.prepare(where)
    return where


@as_root
@pytest.mark.parametrize("planted_first", [True, False], ids=["planted-read-first", "planted-read-last"])
def test_a_file_another_user_plants_for_a_process_is_skipped_and_the_real_one_shown(run_dir, planted_dir,
                                                                                     planted_first):
    published(run_dir, reserved=1 * GiB)
    forged = published(planted_dir, reserved=2 * GiB, limit=4 * GiB)
    another_users(forged.path)
    another_users(planted_dir.path)
    dirs = [planted_dir.path, run_dir.path] if planted_first else [run_dir.path, planted_dir.path]
    shown = top.collect(FakeNvml(gpu(0, processes={os.getpid(): GiB})), dirs, 0.85)
    [row] = shown.rows
    assert row.figures["reserved"] == 1 * GiB and row.figures["limit"] == 2 * GiB
    [problem] = shown.problems
    assert problem == (f"'{forged.path}': the file is {OTHER_UID}'s, but it names process {os.getpid()}, which runs "
                       f"as root: not its figures")


@as_root
def test_a_planted_file_alone_gives_the_process_no_figures(planted_dir):
    another_users(published(planted_dir, reserved=2 * GiB).path)
    shown = top.collect(FakeNvml(gpu(0, processes={os.getpid(): GiB})), [planted_dir.path], 0.85)
    assert [(row.pid, row.figures) for row in shown.rows] == [(os.getpid(), None)]


@as_root
def test_a_process_of_another_user_is_shown_with_its_figures_and_labelled_with_its_user(run_dir):
    child = subprocess.Popen(["sleep", "600"], user=OTHER_UID, group=OTHER_UID)
    try:
        another_users(published(run_dir, reserved=GiB, pid=child.pid).path)
        nvml = gpu(0, processes={child.pid: GiB, os.getpid(): GiB})
        rows = {row.pid: row for row in top.collect(FakeNvml(nvml), [run_dir.path], 0.85).rows}
        assert rows[child.pid].user == str(OTHER_UID) and rows[child.pid].figures["reserved"] == GiB
        assert rows[os.getpid()].user == "root" and rows[os.getpid()].figures is None
    finally:
        child.kill()
        child.wait()


def test_a_file_whose_owner_is_not_the_processs_user_is_skipped_naming_both(run_dir, tmp_path):
    published(run_dir, reserved=GiB, pid=31, start_time=700, pid_namespace="pid:[1]")
    proc = fake_proc(tmp_path / "proc", {31: (700, [31])}, uid=OTHER_UID)
    shown = view(run_dir, gpu(0, processes={31: GiB}), proc=proc)
    assert [(row.pid, row.figures) for row in shown.rows] == [(31, None)]
    assert shown.problems[0].endswith(f"names process 31, which runs as {OTHER_UID}: not its figures")


def test_a_container_processs_file_is_checked_against_its_host_processs_user(run_dir, tmp_path):
    published(run_dir, reserved=GiB, pid=17, start_time=5000, pid_namespace="pid:[99]")
    proc = fake_proc(tmp_path / "proc", {4242: (5000, [4242, 17])}, uid=OTHER_UID)
    shown = view(run_dir, gpu(0, processes={4242: 2 * GiB}), proc=proc)
    assert [(row.pid, row.figures) for row in shown.rows] == [(4242, None)]
    assert "names process 4242" in shown.problems[0]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o733])
def test_a_run_dir_others_may_write_to_is_skipped_unless_sticky(run_dir, mode):
    published(run_dir, reserved=GiB)
    os.chmod(run_dir.path, mode)
    shown = view(run_dir, gpu(0, processes={os.getpid(): GiB}))
    assert [row.figures for row in shown.rows] == [None]
    assert shown.problems == [f"'{run_dir.path}' is writable by other users and not sticky (mode "
                              f"{stat.filemode(stat.S_IFDIR | mode)}): any of them could remove or replace the "
                              "files in it; make it sticky (chmod +t), as /tmp is, or private"]
    os.chmod(run_dir.path, mode | stat.S_ISVTX)
    assert view(run_dir, gpu(0, processes={os.getpid(): GiB})).rows[0].figures["reserved"] == GiB


def test_a_gpumem_run_dir_others_may_write_to_without_the_sticky_bit_is_refused_for_publishing(tmp_path):
    where = tmp_path / "shared"
    where.mkdir(mode=0o777)
    os.chmod(where, 0o777)
    with pytest.raises(PermissionError, match="is writable by other users and not sticky"):
        publish.prepare(RunDir(str(where), chosen=True))
    os.chmod(where, 0o1777)
    publish.prepare(RunDir(str(where), chosen=True))


@pytest.mark.parametrize("namespace", ["here", "elsewhere"])
def test_a_file_whose_time_is_ahead_of_the_clock_is_skipped(run_dir, tmp_path, namespace):
    if namespace == "here":
        publisher, proc = published(run_dir, reserved=GiB), _proc.PROC
    else:
        publisher = published(run_dir, reserved=GiB, pid=23, start_time=5000, pid_namespace="pid:[77]")
        proc = fake_proc(tmp_path / "proc", {})
    ahead = os.stat(publisher.path).st_mtime + 3600
    os.utime(publisher.path, (ahead, ahead))
    shown = view(run_dir, gpu(0, processes={os.getpid(): GiB}), proc=proc, now=ahead - 3600)
    assert all(row.figures is None for row in shown.rows)
    assert shown.problems == [f"'{publisher.path}': written 3600 s in the future: no heartbeat can be read from it"]
    assert os.path.exists(publisher.path)


def test_the_uid_of_a_process_is_its_effective_uid():
    assert _proc.uid_of(os.getpid()) == os.geteuid()
    assert _proc.uid_of(dead_pid()) is None
