"""gpumem.set_limit and its companions, over fake devices (fake_c.py): no GPU needed."""
import pytest
import torch

import gpumem
from fake_c import GiB, FakeC, use_fake_c

MiB = 1 << 20


def test_set_limit_installs_gpumem_and_caps_every_device(fake_c):
    gpumem.set_limit("4GB")
    assert fake_c.installed
    assert fake_c.limits() == [4 * GiB, 4 * GiB]


def test_the_cap_reaches_the_allocator(fake_c):
    gpumem.set_limit("64MB")
    with pytest.raises(MemoryError):
        fake_c.malloc(0, 100 * MiB)


@pytest.mark.parametrize("device", [1, "cuda:1", torch.device("cuda", 1)])
def test_set_limit_on_one_device_leaves_the_others(fake_c, device):
    gpumem.set_limit("2GB", device=device)
    assert fake_c.limits() == [8 * GiB, 2 * GiB]


def test_an_int_is_a_byte_count(fake_c):
    gpumem.set_limit(123456789)
    assert gpumem.get_limit(0) == 123456789


def test_a_float_is_a_fraction_of_the_device(fake_c):
    gpumem.set_limit(0.25)
    assert gpumem.get_limit(0) == 2 * GiB


def test_a_tiny_float_is_read_without_an_exponent(fake_c):
    gpumem.set_limit(1e-05)
    assert gpumem.get_limit(0) == int(8 * GiB * 0.00001)


def test_a_percentage_is_of_the_device(fake_c):
    gpumem.set_limit("50%")
    assert fake_c.limits() == [4 * GiB, 4 * GiB]


@pytest.mark.parametrize("none", [None, "none"])
def test_none_lifts_the_limit(fake_c, none):
    gpumem.set_limit("1GB")
    gpumem.set_limit(none)
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_the_limit_can_be_raised_and_lowered_at_run_time(fake_c):
    gpumem.set_limit("1GB")
    gpumem.set_limit("3GB")
    assert gpumem.get_limit(0) == 3 * GiB
    gpumem.set_limit("512MB")
    assert gpumem.get_limit(0) == 512 * MiB


def test_set_limit_installs_only_once(fake_c):
    gpumem.set_limit("1GB")
    gpumem.set_limit("2GB")
    assert fake_c.install_calls == 1


@pytest.mark.parametrize("limit", ["lots", "-1GB", "9GB", "0", "1.5", -5, 0, 1.5, 2.0, float("nan")])
def test_a_bad_limit_is_refused_naming_it_and_the_forms(fake_c, limit):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit(limit)
    message = str(caught.value)
    assert str(limit) in message
    assert gpumem._C.limit_forms in message


@pytest.mark.parametrize("limit", [True, False, [4], b"4GB", {"limit": 4}])
def test_a_limit_of_the_wrong_type_is_a_type_error_naming_the_forms(fake_c, limit):
    with pytest.raises(TypeError) as caught:
        gpumem.set_limit(limit)
    assert repr(limit) in str(caught.value)
    assert "4GB" in str(caught.value)


def test_a_bad_limit_changes_nothing(fake_c):
    with pytest.raises(ValueError):
        gpumem.set_limit("lots")
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_a_limit_too_big_for_one_device_changes_no_device(monkeypatch):
    fake = FakeC([8 * GiB, 2 * GiB])
    use_fake_c(monkeypatch, fake)
    gpumem.set_limit("1GB")
    with pytest.raises(ValueError, match="more than the device total of 2.00 GiB"):
        gpumem.set_limit("4GB")
    assert fake.limits() == [1 * GiB, 1 * GiB]


def test_percentages_follow_each_devices_own_total(monkeypatch):
    fake = FakeC([8 * GiB, 2 * GiB])
    use_fake_c(monkeypatch, fake)
    gpumem.set_limit("50%")
    assert fake.limits() == [4 * GiB, 1 * GiB]


@pytest.mark.parametrize("device, index", [(2, 2), (-1, -1), ("cuda:7", 7)])
def test_a_device_that_does_not_exist_is_refused_naming_it_and_changes_nothing(fake_c, device, index):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit("1GB", device=device)
    assert f"no CUDA device {index};" in str(caught.value)
    assert "0..1" in str(caught.value)
    assert not fake_c.installed


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "nonsense"])
def test_a_device_that_is_not_cuda_is_refused(fake_c, device):
    with pytest.raises(ValueError, match="cpu|nonsense"):
        gpumem.set_limit("1GB", device=device)


@pytest.mark.parametrize("device", [True, 1.0])
def test_a_device_of_the_wrong_type_is_a_type_error(fake_c, device):
    with pytest.raises(TypeError):
        gpumem.set_limit("1GB", device=device)


def test_set_limit_after_pytorch_initialized_cuda_says_how_to_fix_it_and_changes_nothing(fake_c, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as caught:
        gpumem.set_limit("1GB")
    message = str(caught.value)
    assert "already initialized CUDA" in message
    assert "GPUMEM_LIMIT" in message and "gpumem.enable()" in message
    assert not fake_c.installed
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_set_limit_after_cuda_started_under_gpumem_is_allowed(fake_c, monkeypatch):
    gpumem.enable()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    gpumem.set_limit("1GB", device="cuda")
    assert fake_c.limits() == [8 * GiB, 1 * GiB]


def test_get_limit_reads_the_current_device_without_starting_cuda(fake_c, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA would start"))
    gpumem.set_limit("1GB", device=0)
    assert gpumem.get_limit() == 1 * GiB


def test_enable_installs_without_changing_limits(fake_c):
    gpumem.enable()
    assert gpumem.is_enabled()
    assert fake_c.limits() == [8 * GiB, 8 * GiB]


def test_is_enabled_is_false_until_installed(fake_c):
    assert not gpumem.is_enabled()


def test_stats_are_the_devices_statistics(fake_c):
    fake_c.malloc(1, 3 * MiB)
    assert gpumem.stats(1)["allocated_bytes.all.current"] >= 3 * MiB
    assert gpumem.stats(0)["allocated_bytes.all.current"] == 0


def test_reset_peak_stats_reaches_the_named_device(fake_c):
    gpumem.reset_peak_stats("cuda:1")
    assert fake_c.peak_resets == [1]


def test_empty_cache_returns_cached_segments(fake_c):
    address = fake_c.malloc(0, 3 * MiB)
    fake_c.sims[0].free(address)
    gpumem.empty_cache()
    assert fake_c.sims[0].reserved(0) == 0


def test_set_release_threshold_applies_to_every_device(fake_c):
    gpumem.set_release_threshold(0.8)
    assert fake_c.release_thresholds == [0.8, 0.8]


def test_set_release_threshold_on_one_device(fake_c):
    gpumem.set_release_threshold(0.5, device=1)
    assert fake_c.release_thresholds == [0.0, 0.5]


@pytest.mark.parametrize("share", ["0.5", True, None])
def test_a_release_threshold_that_is_not_a_number_is_a_type_error(fake_c, share):
    with pytest.raises(TypeError, match="release threshold"):
        gpumem.set_release_threshold(share)


# ---- without a CUDA device ----------------------------------------------------------------------


@pytest.fixture
def no_device(monkeypatch):
    fake = FakeC([])
    use_fake_c(monkeypatch, fake)
    return fake


@pytest.mark.parametrize("limit, device", [("4XB", None), ("4XB", 0), ("-1GB", None), (float("nan"), None)])
def test_without_a_device_a_bad_limit_is_still_named_first(no_device, limit, device):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit(limit, device=device)
    assert str(limit) in str(caught.value) and gpumem._C.limit_forms in str(caught.value)
    assert not no_device.installed


@pytest.mark.parametrize("call", [
    lambda: gpumem.set_limit("4GB"),
    lambda: gpumem.set_limit("4GB", device=0),
    lambda: gpumem.set_limit("4GB", device="cuda"),
    lambda: gpumem.get_limit(),
    lambda: gpumem.get_limit(0),
    lambda: gpumem.set_segments("plain"),
    lambda: gpumem.set_segments("plain", device="cuda:1"),
    lambda: gpumem.get_segments(),
    lambda: gpumem.stats(),
    lambda: gpumem.reset_peak_stats(0),
    lambda: gpumem.set_release_threshold(0.5),
    lambda: gpumem.report(0),
    lambda: gpumem.device_mem_info(),
    lambda: gpumem.timeline.start(),
    lambda: gpumem.timeline.start(devices=[0]),
], ids=["set_limit", "set_limit-0", "set_limit-cuda", "get_limit", "get_limit-0", "set_segments",
        "set_segments-cuda:1", "get_segments", "stats", "reset_peak_stats", "set_release_threshold", "report-0",
        "device_mem_info", "timeline", "timeline-0"])
def test_without_a_device_every_call_raises_the_same_runtime_error(no_device, call):
    with pytest.raises(RuntimeError) as caught:
        call()
    assert str(caught.value) == "gpumem: no CUDA device is visible to this process (see CUDA_VISIBLE_DEVICES)"
    assert not no_device.installed


@pytest.mark.parametrize("share", [5, -0.5, float("nan")])
def test_without_a_device_a_bad_release_threshold_is_still_named_first(no_device, share):
    with pytest.raises(ValueError, match=rf"bad release threshold {share}: expected a share of the limit"):
        gpumem.set_release_threshold(share)


def test_a_bad_release_threshold_changes_no_device(fake_c):
    with pytest.raises(ValueError, match="bad release threshold 1.5"):
        gpumem.set_release_threshold(1.5)
    assert fake_c.release_thresholds == [0.0, 0.0]


# ---- the user's values in messages ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["4\x00GB", "4\x1b[2JGB", "9" * 10_000_000 + "XB"], ids=["nul", "escape", "long"])
def test_a_bad_limit_is_shown_escaped_and_cut(fake_c, value):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit(value)
    message = str(caught.value)
    assert message.startswith(f"gpumem: bad limit {gpumem.settings.echo.shown(value, quote=chr(34))}: ")
    assert message.isprintable() and len(message) < 2000


def test_a_huge_int_limit_is_refused_naming_it(fake_c):
    with pytest.raises(ValueError, match=r"limit 18446744073709551616 is out of range"):
        gpumem.set_limit(1 << 64)
    with pytest.raises(ValueError, match=r"limit <a int> is out of range"):
        gpumem.set_limit(10 ** 5000)  # more digits than Python writes as text


@pytest.mark.parametrize("device", ["cuda:\x1b[31m", "x" * 1_000_000], ids=["escape", "long"])
def test_a_bad_device_is_shown_escaped_and_cut(fake_c, device):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit("1GB", device=device)
    assert caught.value.args[0].isprintable() and len(str(caught.value)) < 300


def test_a_limit_of_the_wrong_type_is_shown_cut(fake_c):
    with pytest.raises(TypeError) as caught:
        gpumem.set_limit([1] * 1_000_000)
    assert "[1, 1, 1," in str(caught.value) and "… (3000000 characters)" in str(caught.value)
    assert len(str(caught.value)) < 1000


@pytest.mark.parametrize("limit, problem", [
    ("\udcff", "it holds the byte 0xff (character 1), which is not UTF-8 text"),
    ("4GB\ud800", "it holds the lone surrogate \\ud800 (character 4), which is not text"),
], ids=["a-byte-that-is-not-utf-8", "a-lone-surrogate"])
def test_a_limit_that_is_not_utf_8_is_a_value_error_naming_it_and_changes_nothing(fake_c, limit, problem):
    with pytest.raises(ValueError) as caught:
        gpumem.set_limit(limit)
    message = str(caught.value)
    assert message.startswith(f'gpumem: bad limit "{limit.encode("unicode_escape").decode()}": {problem}')
    assert gpumem._C.limit_forms in message and message.isprintable()
    assert not fake_c.installed and fake_c.limits() == [8 * GiB, 8 * GiB]
