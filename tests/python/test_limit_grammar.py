"""The limit grammar (csrc/core/limit_spec.h) as Python sees it through gpumem._C."""
import pytest

from gpumem import _C

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TOTAL = 8 * GiB


@pytest.mark.parametrize("spec", ["4GB", "4 GB", "4gb", "4G", "4GiB", "4 gib", "4096MB", "4294967296"])
def test_sizes_in_every_unit_spelling_mean_the_same_bytes(spec):
    assert _C.parse_limit(spec, TOTAL) == 4 * GiB


@pytest.mark.parametrize(
    "spec, expected",
    [("1.5GB", 3 * GiB // 2), ("750MiB", 750 * MiB), ("512K", 512 * KiB), ("1B", 1), ("2T", 2 << 40)],
)
def test_units_are_binary_and_decimal_sizes_are_exact(spec, expected):
    assert _C.parse_limit(spec, 4 << 40) == expected


@pytest.mark.parametrize("spec, expected", [("50%", TOTAL // 2), ("100%", TOTAL), ("0.25", TOTAL // 4), ("1.0", TOTAL)])
def test_percentages_and_fractions_are_of_the_device_total(spec, expected):
    assert _C.parse_limit(spec, TOTAL) == expected


def test_percentages_round_down_to_whole_bytes():
    assert _C.parse_limit("33.3%", 1000) == 333
    assert _C.parse_limit("0.3333", 1000) == 333


def test_surrounding_white_space_is_ignored():
    assert _C.parse_limit(" \t2GB\n", TOTAL) == 2 * GiB


@pytest.mark.parametrize("spec", ["none", "NONE", " None "])
def test_none_means_no_limit(spec):
    assert _C.parse_limit(spec, TOTAL) is None


BAD_SPECS = [
    "",
    "   ",
    "lots",
    "GB",
    "-1GB",
    "4XB",
    "1.2.3GB",
    "0",
    "0GB",
    "0%",
    "0.0",
    "101%",
    "1.5",
    "9GB",
    "99999999999999999999TB",
]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_a_bad_spec_is_refused_naming_the_text_and_the_accepted_forms(spec):
    with pytest.raises(ValueError) as caught:
        _C.parse_limit(spec, TOTAL)
    message = str(caught.value)
    assert f'"{spec}"' in message
    assert _C.limit_forms in message


def test_a_limit_above_the_device_total_names_the_total():
    with pytest.raises(ValueError, match="more than the device total of 8.00 GiB"):
        _C.parse_limit("9GB", TOTAL)


def test_a_fraction_above_one_suggests_a_unit():
    with pytest.raises(ValueError, match="add a unit"):
        _C.parse_limit("1.5", TOTAL)


def test_the_accepted_forms_list_every_kind_of_spec():
    for example in ('"4GB"', '"50%"', '"0.5"', '"none"', '"1073741824"'):
        assert example in _C.limit_forms


@pytest.mark.parametrize(
    "nbytes, text", [(1, "1 byte"), (512, "512 bytes"), (1536, "1.50 KiB"), (4 * GiB, "4.00 GiB")]
)
def test_format_bytes_uses_binary_units_with_two_decimals(nbytes, text):
    assert _C.format_bytes(nbytes) == text


# ---- GPUMEM_LIMIT lists ------------------------------------------------------------------------


def test_a_single_spec_applies_to_every_device():
    assert [tuple(a) for a in _C.parse_limit_assignments("4GB")] == [(-1, "4GB")]


def test_device_specs_are_listed_in_order():
    assert [tuple(a) for a in _C.parse_limit_assignments("0:4GB,1:50%")] == [(0, "4GB"), (1, "50%")]


def test_white_space_around_items_devices_and_specs_is_ignored():
    assert [tuple(a) for a in _C.parse_limit_assignments(" 0 : 4GB , 1: 8 GB ")] == [(0, "4GB"), (1, "8 GB")]


def test_specs_in_a_list_are_left_for_parse_limit():
    # They need the device's total, so only the list's shape is checked here.
    assert [tuple(a) for a in _C.parse_limit_assignments("0:bogus")] == [(0, "bogus")]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("0:4GB,0:8GB", "device 0 is listed twice"),
        ("4GB,1:8GB", "cannot be combined"),
        ("x:4GB", '"x" is not a non-negative integer'),
        ("-1:4GB", '"-1" is not a non-negative integer'),
        ("0:", "no spec"),
        ("0:4GB,,1:2GB", "empty"),
    ],
)
def test_a_bad_list_is_refused_naming_the_text_and_the_reason(text, reason):
    with pytest.raises(ValueError) as caught:
        _C.parse_limit_assignments(text)
    message = str(caught.value)
    assert f'"{text}"' in message
    assert reason in message
    assert "DEVICE:SPEC" in message


def test_a_refused_spec_is_a_value_error_that_carries_its_parts():
    with pytest.raises(ValueError) as caught:
        _C.parse_limit(" 4XB", TOTAL)
    error = caught.value
    assert isinstance(error, _C.LimitSpecError)
    assert (error.setting, error.spec, error.reason, error.forms) == ("limit", " 4XB", 'unknown unit "XB"', _C.limit_forms)
    assert str(error) == f'gpumem: bad limit " 4XB": unknown unit "XB". Accepted forms: {_C.limit_forms}'


def test_a_refused_gpumem_limit_carries_the_whole_value_and_the_grammars_reason():
    with pytest.raises(_C.LimitSpecError) as caught:
        _C.resolve_limit_text("0:9GB", [TOTAL])
    error = caught.value
    assert (error.setting, error.spec, error.forms) == ("GPUMEM_LIMIT", "0:9GB", _C.limit_forms)
    assert error.reason == "it comes to 9.00 GiB, more than the device total of 8.00 GiB"


def test_a_refused_byte_count_has_no_spec_text():
    sim = _C.SimAllocator(TOTAL)
    with pytest.raises(_C.LimitSpecError) as caught:
        sim.set_limit_bytes(0, 2 * TOTAL)
    error = caught.value
    assert (error.setting, error.spec, error.forms) == ("limit", None, _C.limit_forms)
    assert error.reason == "16.00 GiB is above device 0's total of 8.00 GiB"


def test_python_and_the_compiled_layer_cut_the_users_text_after_as_many_units():
    from gpumem.settings import echo

    assert echo.SHOWN_LENGTH == _C.SHOWN_LENGTH
    assert echo.shown("9" * 100, quote='"') == '"' + "9" * _C.SHOWN_LENGTH + '"… (100 characters)'
