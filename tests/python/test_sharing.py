"""Sharing a GPU (gpumem.sharing): the settings, their errors, and what `gpumem top` and the
metrics show. The protocol itself is tested in C++ (tests/cpp/test_sharing.cpp)."""
from __future__ import annotations

import os

import pytest

from gpumem import _C, cli, sharing
from gpumem.monitoring import metrics, publish, published, top
from gpumem.settings import environment, floors

from test_report import wait_for
from test_top import UUID, gpu, identity, run_dir, table_of, json_of  # noqa: F401 - fixtures

GiB = 1 << 30


def test_a_floor_is_read_per_device_in_the_limit_grammar():
    assert floors.floor_assignments("0:20GB,1:8GB") == [(0, "20GB"), (1, "8GB")]
    assert floors.floor_assignments("20GB") == [(-1, "20GB")]


def test_a_bad_floor_names_the_variable_the_value_and_the_accepted_forms():
    with pytest.raises(environment.SettingError) as raised:
        environment.floor({"GPUMEM_FLOOR": "20XB"})
    message = str(raised.value)
    assert "GPUMEM_FLOOR" in message and "20XB" in message and floors.floor_forms() in message


def test_gpumem_share_takes_on_or_off():
    assert environment.share({"GPUMEM_SHARE": "on"}) is True
    assert environment.share({"GPUMEM_SHARE": "off"}) is False
    with pytest.raises(environment.SettingError, match='"on" or "off"'):
        environment.share({"GPUMEM_SHARE": "maybe"})


def test_a_floor_implies_sharing_and_nothing_asks_for_it_by_default():
    assert environment.sharing_asked({"GPUMEM_FLOOR": "20GB"})
    assert not environment.sharing_asked({})
    assert not environment.sharing_asked({"GPUMEM_SHARE": "off"})


def test_a_floor_is_bytes_of_the_device_and_none_is_no_floor():
    assert floors.floor_bytes("50%", 100 * GiB, 100 * GiB) == 50 * GiB
    assert floors.floor_bytes("20GB", 140 * GiB, 140 * GiB) == 20 * GiB
    assert floors.floor_bytes("none", 140 * GiB, 140 * GiB) == 0


def test_a_floor_above_the_hard_cap_is_refused_with_both_figures():
    with pytest.raises(ValueError, match="above the hard cap of 20.00 GiB"):
        floors.floor_bytes("30GB", 140 * GiB, 20 * GiB)


def test_a_gpu_uuid_that_cannot_name_a_file_is_refused():
    with pytest.raises(RuntimeError, match="UUID"):
        sharing.table_path("/tmp/run", "../../etc/passwd")
    assert sharing.table_path("/tmp/run", "GPU-" + UUID).endswith(f"share-GPU-{UUID}-uid{os.geteuid()}.table")


def test_the_environment_list_checks_the_sharing_settings():
    assert (floors.FLOOR_VARIABLE, environment.floor) in environment.SETTINGS
    assert (floors.SHARE_VARIABLE, environment.share) in environment.SETTINGS


def test_gpumem_info_prints_the_floor_a_setting_sets_on_each_device(fake_c, monkeypatch):
    monkeypatch.setenv("GPUMEM_FLOOR", "1:2GB")
    assert cli._env_floors(2) == [None, 2 * GiB]


class SharingSource:
    """A simulated device's figures, as a process that shares its GPU publishes them."""

    def __init__(self, sim, status):
        self._sim, self._status = sim, status

    def __getattr__(self, name):
        return getattr(self._sim, name)

    def device_figures(self, device, device_memory=True):
        return {**self._sim.device_figures(device, device_memory), "sharing": self._status}


def sharing_status(**figures) -> dict:
    base = {"table": "t", "floor": 0, "ceiling": None, "borrowed": 0, "floor_short": 0, "asks_made": 0,
            "asks_served": 0, "given_back": 0, "others": []}
    return {**base, **figures}


def publish_sharing(run_dir, status):  # noqa: F811 - the fixture's value
    sim = _C.SimAllocator(8 * GiB)
    sim.set_growable(0, False)
    sim.malloc(0, 1 * GiB)
    source = SharingSource(sim, status)
    publisher = publish.Publisher(run_dir, source=source, identity=identity(), uuid_of=lambda device: UUID)
    assert publisher.step()
    return publisher


def test_top_shows_the_floor_what_is_borrowed_and_what_was_given_back(run_dir, monkeypatch, capsys):  # noqa: F811
    publish_sharing(run_dir, sharing_status(floor=2 * GiB, borrowed=0, given_back=3 * GiB, asks_served=2))
    lines = table_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    header = next(line for line in lines if "RESERVED" in line)
    assert header.split()[-5:] == ["FLOOR", "BORROWED", "GAVE", "BACK", "NOTE"]
    cells = next(line for line in lines if f" {os.getpid()} " in line).split()
    assert cells[-6:] == ["2.00", "GiB", "0", "bytes", "3.00", "GiB"]


def test_top_json_has_the_sharing_figures(run_dir, monkeypatch, capsys):  # noqa: F811
    publish_sharing(run_dir, sharing_status(floor=2 * GiB, borrowed=GiB, given_back=3 * GiB, asks_served=2))
    document = json_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    [process] = [p for p in document["processes"] if p["pid"] == os.getpid()]
    figures = process["gpumem"]
    assert figures["sharing"] is True
    assert (figures["floor_bytes"], figures["borrowed_bytes"], figures["given_back_bytes"]) == (2 * GiB, GiB, 3 * GiB)
    assert figures["releases_on_request"] == 2


def test_top_keeps_its_columns_where_nobody_shares(run_dir, monkeypatch, capsys):  # noqa: F811
    publish_sharing(run_dir, None)
    lines = table_of(run_dir, gpu(0, processes={os.getpid(): 2 * GiB}), monkeypatch=monkeypatch, capsys=capsys)
    header = next(line for line in lines if "RESERVED" in line)
    assert "FLOOR" not in header


def test_a_published_sharing_figure_that_is_not_a_count_is_refused():
    device = {"index": 0, "uuid": None, "device_total": None, "limit": 1, "allocated": 0, "allocated_peak": 0,
              "reserved": 0, "reserved_peak": 0, "ooms": {case: 0 for case in metrics.OOM_CASES},
              "floor": -1}
    with pytest.raises(ValueError, match="floor"):
        published._checked_device(device)


def test_the_metrics_have_the_sharing_figures_and_the_releases_on_request():
    sim = _C.SimAllocator(8 * GiB)
    sim.malloc(0, 1 * GiB)
    figures = sim.device_figures(0)
    figures["sharing"] = sharing_status(floor=2 * GiB, borrowed=GiB, floor_short=0, given_back=3 * GiB,
                                        asks_served=2, asks_made=5)
    samples = {name: value for name, value, _ in metrics._device_samples(figures)}
    assert samples["gpumem_floor_bytes"] == 2 * GiB
    assert samples["gpumem_borrowed_bytes"] == GiB
    assert samples["gpumem_given_back_bytes"] == 3 * GiB
    assert samples["gpumem_releases_on_request"] == 2
    assert samples["gpumem_requests_made"] == 5
    figures["sharing"] = None
    assert "gpumem_floor_bytes" not in {name for name, _, _ in metrics._device_samples(figures)}


# ---- the compiled member, over simulated devices (two allocators, one table) --------------------


@pytest.fixture
def table(tmp_path) -> str:
    where = tmp_path / "run"
    where.mkdir(mode=0o700)
    return str(where / f"share-GPU-{UUID}-uid{os.geteuid()}.table")


def sims(count: int, table: str):
    made = []
    for _ in range(count):
        sim = _C.SimAllocator(8 * GiB)
        sim.set_growable(0, False)
        sim.share_join(0, table)
        made.append(sim)
    return made


def test_a_device_that_does_not_share_has_no_sharing_status():
    assert _C.SimAllocator(8 * GiB).share_status(0) is None


def test_members_of_one_table_see_each_other_and_a_floor_lowers_the_others_ceiling(table):
    a, b = sims(2, table)
    assert a.share_set_floor(0, 2 * GiB) == 0
    a.malloc(0, 1 * GiB)
    with pytest.raises(MemoryError) as raised:
        b.malloc(0, 7 * GiB)
    assert "Sharing the GPU" in str(raised.value) and "floor 2.00 GiB" in str(raised.value)
    status = b.share_status(0)
    assert [other["floor"] for other in status["others"]] == [2 * GiB]
    assert status["ceiling"] == 6 * GiB
    assert status["asks_made"] >= 1
    b.malloc(0, 6 * GiB)
    assert b.device_figures(0)["sharing"]["borrowed"] == 6 * GiB


def test_a_floor_that_the_device_cannot_give_is_reported_short(table):
    a, b = sims(2, table)
    b.malloc(0, 7 * GiB)  # live: of an 8 GiB GPU (by the table), only 1 GiB is left for a
    # b's figures reach the table from its own thread: wait for them, as a loaded machine may run
    # that thread late (a's floor would otherwise be read against a b that holds nothing yet).
    wait_for(lambda: [other["in_use"] for other in a.share_status(0)["others"]] == [7 * GiB])
    assert a.share_set_floor(0, 4 * GiB) == 3 * GiB
    assert a.share_status(0)["floor_short"] == 3 * GiB
    a.malloc(0, 4 * GiB)  # a's own simulated device has the room, so it is honoured as it is used
    assert a.share_status(0)["floor_short"] == 0


def test_leaving_frees_the_slot(table):
    a, b = sims(2, table)
    assert len(a.share_status(0)["others"]) == 1
    b.share_leave()
    assert b.share_status(0) is None
    assert a.share_status(0)["others"] == []


def test_a_floor_is_granted_from_what_the_others_floors_leave_and_the_warning_names_them(table, monkeypatch):
    a, b = sims(2, table)
    assert a.share_grant_floor(0, 6 * GiB)["granted"] == 6 * GiB
    monkeypatch.setattr(sharing, "_C", b)  # sharing.set_floor over b, as the package calls it
    with pytest.warns(RuntimeWarning) as warned:
        short = sharing.set_floor(0, 6 * GiB)
    assert short == 4 * GiB
    text = str(warned[0].message)
    assert "granted only 2.00 GiB" in text and f"pid {os.getpid()}: 6.00 GiB" in text
    assert b.share_status(0)["floor"] == 2 * GiB
    with pytest.raises(MemoryError) as raised:  # past its granted floor, the others' floor stands in the way
        b.malloc(0, 3 * GiB)
    assert "raising it cannot help" in str(raised.value)
