"""Byte counts in messages (gpumem.settings.sizes.format_bytes): the compiled layer's form for any
non-negative int, those past 2^64 included."""
from __future__ import annotations

import pytest

from gpumem import _C
from gpumem.settings import sizes


@pytest.mark.parametrize("count", [0, 1, 2, 1023, 1024, 1536, 5 << 30, (1 << 62) + 1, (1 << 64) - 1])
def test_a_count_below_2_to_the_64_is_written_as_the_compiled_layer_writes_it(count):
    assert sizes.format_bytes(count) == _C.format_bytes(count)


@pytest.mark.parametrize("count, text", [
    (1 << 64, "16777216.00 TiB"),
    (3 << 70, f"{3 << 30}.00 TiB"),
    ((1 << 64) + (1 << 39), "16777216.50 TiB"),
    (8 << 62, "33554432.00 TiB"),
    (1 << 200, "about 2^200 bytes"),
    (1 << 100_000, "about 2^100000 bytes"),
], ids=["2^64", "3-EiB-and-more", "half-a-tib-over", "eight-sizes-of-2^62", "2^200", "a-100000-bit-count"])
def test_a_count_past_2_to_the_64_goes_on_in_tib(count, text):
    assert sizes.format_bytes(count) == text


@pytest.mark.parametrize("count, error", [(-1, ValueError), (-(1 << 70), ValueError), (1.5, TypeError),
                                          (True, TypeError), ("5", TypeError), (None, TypeError)])
def test_anything_but_a_non_negative_int_is_refused_naming_it(count, error):
    with pytest.raises(error, match="byte count"):
        sizes.format_bytes(count)
