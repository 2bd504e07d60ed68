"""The run directory: one rule decides whether it is trusted (gpumem.monitoring.published.run_dir_problem), for
`gpumem top` reading it, a process publishing its figures in it and a GPU's sharing table in it;
and the names a publisher writes there, which nobody can take first in a directory shared with
other users."""
from __future__ import annotations

import os
import re
import time

import pytest

from fake_c import GiB, FakeC, use_fake_c
from gpumem import _C, sharing
from gpumem.monitoring import publish, published, top
from gpumem.settings.run_dir import RunDir

from test_top import FakeNvml, gpu, identity


def directory(tmp_path, mode: int, name: str = "run") -> RunDir:
    path = tmp_path / name
    path.mkdir()
    path.chmod(mode)
    return RunDir(str(path), chosen=True)


def publisher_over_a_sim(run_dir: RunDir, **who) -> publish.Publisher:
    sim = _C.SimAllocator(8 * GiB)
    sim.set_growable(0, False)
    sim.malloc(0, GiB)
    return publish.Publisher(run_dir, source=sim, identity=identity(**who), uuid_of=lambda device: None)


# ---- one rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, read, publishing, sharing_table", [
    (0o700, None, None, None),
    (0o1777, None, None, "is writable by other users (mode drwxrwxrwt)"),
    (0o777, "is writable by other users and not sticky", "is writable by other users and not sticky",
     "is writable by other users and not sticky"),
    (0o1770, None, None, "is writable by other users (mode drwxrwx--T)"),
    (0o755, None, None, None),
], ids=["private", "sticky-shared", "open", "sticky-group", "readable"])
def test_one_rule_says_what_a_run_directory_is_trusted_for(tmp_path, mode, read, publishing, sharing_table):
    where = directory(tmp_path, mode)
    for use, expected in [(published.READ, read), (published.PUBLISH, publishing), (published.SHARE, sharing_table)]:
        problem = published.run_dir_problem(where, use)
        assert (problem is None) if expected is None else problem.startswith(expected), (use, problem)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_sharing_table_needs_a_directory_of_this_user(tmp_path):
    where = directory(tmp_path, 0o700)
    os.chown(where.path, 4242, 4242)
    assert published.run_dir_problem(where, published.PUBLISH) is None  # root may write anywhere
    assert published.run_dir_problem(where, published.SHARE).startswith(
        f"belongs to uid 4242, not to this user (uid {os.geteuid()}): its owner could replace a GPU's sharing table")


def test_a_default_directory_named_for_another_uid_is_a_plant(tmp_path):
    plant = tmp_path / f"gpumem-{os.geteuid() + 1}"
    plant.mkdir(mode=0o700)
    problem = published.run_dir_problem(RunDir(str(plant)), published.READ)
    assert problem.startswith(f"belongs to uid {os.geteuid()}, not to the uid {os.geteuid() + 1} its name says")


@pytest.fixture
def planted(monkeypatch):
    """The rule says every directory is planted: each use must refuse, with its reason."""
    uses = []

    def rule(run_dir, use):
        uses.append(use)
        return "is planted (the one rule says so)"

    monkeypatch.setattr(published, "run_dir_problem", rule)
    return uses


def test_publishing_refuses_what_the_rule_refuses(tmp_path, planted):
    with pytest.raises(PermissionError, match=r"is planted \(the one rule says so\)"):
        publish.prepare(directory(tmp_path, 0o700))
    assert planted == [published.PUBLISH]


def test_top_skips_what_the_rule_refuses(tmp_path, planted):
    where = directory(tmp_path, 0o700)
    shown = top.collect(FakeNvml(gpu(0)), [where.path], 0.85)
    assert shown.problems == [f"'{where.path}' is planted (the one rule says so)"]
    assert planted == [published.READ]


def test_a_sharing_table_is_refused_where_the_rule_refuses_before_it_is_opened(tmp_path, monkeypatch, planted):
    fake = FakeC([8 * GiB])
    use_fake_c(monkeypatch, fake)
    monkeypatch.setattr(sharing, "gpu_uuid", lambda index: "GPU-0000")
    with pytest.raises(RuntimeError, match=r"cannot hold the GPU's table: .* is planted \(the one rule says so\)"):
        sharing.join(0, directory(tmp_path, 0o700))
    assert fake.joined == [] and planted == [published.SHARE]


def test_a_sharing_table_is_refused_in_a_sticky_shared_directory_before_it_is_opened(tmp_path, monkeypatch):
    fake = FakeC([8 * GiB])
    use_fake_c(monkeypatch, fake)
    monkeypatch.setattr(sharing, "gpu_uuid", lambda index: "GPU-0000")
    with pytest.raises(RuntimeError, match=r"is writable by other users \(mode drwxrwxrwt\): any of them could take"):
        sharing.join(0, directory(tmp_path, 0o1777))
    assert fake.joined == []


def test_a_sharing_table_joins_in_a_private_directory(tmp_path, monkeypatch):
    fake = FakeC([8 * GiB])
    use_fake_c(monkeypatch, fake)
    monkeypatch.setattr(sharing, "gpu_uuid", lambda index: "GPU-0000")
    monkeypatch.setattr(sharing, "_joined_in", os.getpid())  # registers no atexit callback here
    where = directory(tmp_path, 0o700)
    sharing.join(0, where)
    assert fake.joined == [(0, sharing.table_path(where.path, "GPU-0000"))]


# ---- names nobody can take first ------------------------------------------------------------------


def test_a_name_taken_first_in_a_shared_sticky_directory_does_not_stop_publishing(tmp_path, capsys):
    shared = directory(tmp_path, 0o1777)
    # What another user can make first in a sticky directory: the name the process would use.
    # A directory under it, as a file of another user would, makes the rename over it fail.
    os.mkdir(os.path.join(shared.path, f"{os.getpid()}.json"))
    publisher = publisher_over_a_sim(shared)
    assert publisher.step(), capsys.readouterr().err
    entries, problems = published.read_entries(shared.path)
    assert [entry.path for entry in entries] == [publisher.path]
    assert problems == [f"'{shared.path}/{os.getpid()}.json': not a regular file"]


def test_each_publisher_picks_a_name_nobody_can_predict(tmp_path):
    where = directory(tmp_path, 0o700)
    names = {os.path.basename(publisher_over_a_sim(where).path) for _ in range(20)}
    assert len(names) == 20
    assert all(re.fullmatch(rf"{os.getpid()}-[0-9a-f]{{16}}\.json", name) for name in names)


def test_top_reads_the_new_names_and_an_older_gpumems_alike(tmp_path):
    where = directory(tmp_path, 0o700)
    new = publisher_over_a_sim(where)
    assert new.step()
    old = publisher_over_a_sim(where, pid=os.getppid())
    old.path = os.path.join(where.path, f"{os.getppid()}.json")  # an older gpumem's name
    assert old.step()
    entries, problems = published.read_entries(where.path)
    assert sorted(entry.pid for entry in entries) == sorted([os.getpid(), os.getppid()]) and problems == []


def test_a_stale_file_beside_a_live_one_of_the_same_pid_is_removed_and_the_live_one_shown(tmp_path):
    where = directory(tmp_path, 0o700)
    stale = publisher_over_a_sim(where, start_time=1)  # a killed process whose pid this one now has
    assert stale.step()
    live = publisher_over_a_sim(where)
    assert live.step()
    shown = top.collect(FakeNvml(gpu(0, processes={os.getpid(): GiB})), [where.path], 0.85)
    assert shown.stale_removed == 1 and os.listdir(where.path) == [os.path.basename(live.path)]
    assert shown.rows[0].figures is not None


def test_a_stale_temporary_of_a_new_name_is_removed(tmp_path):
    where = directory(tmp_path, 0o700)
    temporary = os.path.join(where.path, f".{os.getpid()}-0123456789abcdef.json.k2j4x8.tmp")
    open(temporary, "w").close()
    old = time.time() - published.STALE_SECONDS - 10
    os.utime(temporary, (old, old))
    published.remove_stale_temporaries(where.path, time.time())
    assert os.listdir(where.path) == []
