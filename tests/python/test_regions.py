"""gpumem.region, pause and resume refuse bad input with a message naming the value and the
accepted forms, before any device is touched and changing nothing (no GPU needed). What they do on
a GPU is tests/python/test_gpu_regions.py's; the core's bookkeeping, tests/cpp/test_pause.cpp's."""
import pytest

import gpumem


@pytest.mark.parametrize("tag, says", [("", "non-empty string"), (5, "5"), (None, "None")])
def test_a_bad_tag_is_refused(tag, says):
    with pytest.raises(TypeError, match="region tag") as caught:
        with gpumem.region(tag):
            pass
    assert says in str(caught.value) and '"kv_cache"' in str(caught.value)
    assert gpumem.paused() == {}


def test_a_bad_backup_is_refused():
    with pytest.raises(TypeError, match=r"backup 'yes' is not a bool; give True .* False .* or None"):
        with gpumem.region("weights", backup="yes"):
            pass


@pytest.mark.parametrize("call", [gpumem.pause, gpumem.resume, gpumem.prepare_backups, gpumem.drop_backups])
def test_an_unknown_region_is_named_with_the_regions_there_are(call):
    with pytest.raises(ValueError, match=r"no region 'nowhere': regions are made by .* \(made so far: none yet\)"):
        call("nowhere")
    with pytest.raises(TypeError, match="region tag"):
        call(7)


def test_with_no_region_pause_and_resume_of_everything_change_nothing(monkeypatch):
    emptied = []
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: emptied.append(True))
    assert gpumem.resume() == 0
    assert gpumem.prepare_backups() == 0
    assert gpumem.pause() == 0
    assert emptied == [True]  # pause() of everything gives back the other cache too
    assert gpumem.paused() == {}


def test_the_core_holds_what_prepare_pinned_for_the_pause_and_keeps_it_after_the_resume():
    """The calls prepare_backups and drop_backups make, on the simulated device (the GPU's own
    are tests/python/test_gpu_regions.py's)."""
    from gpumem import _C
    MiB = 1 << 20
    sim = _C.SimAllocator(1 << 30, page_size=2 * MiB)
    sim.region_create(0, 1)
    sim.region_begin(0, 1)
    block = sim.malloc(0, 100 * MiB)
    sim.region_end(0, 1)
    prepared = sim.region_prepare_backup(0, 1)
    assert prepared >= 100 * MiB
    assert sim.region_prepare_backup(0, 1) == 0  # held already
    paused = sim.region_pause(0, 1, True)
    assert sim.region_prepare_backup(0, 1) == 0 and sim.region_drop_backup(0, 1) == 0  # paused: the backup is in use
    assert sim.region_resume(0, 1) == paused
    assert sim.region_drop_backup(0, 1) == prepared  # the pause copied into what was prepared, nothing more
    sim.free(block)
