"""The plain-data pickle reader (gpumem._plain_data) reads what pickle.loads reads, for the opcodes
Python's pickler writes for dicts, lists, tuples, strings, bytes and numbers at protocols 2 to 5."""
from __future__ import annotations

import pickle

import pytest

from gpumem import _plain_data


def read(data: bytes):
    return _plain_data.PlainReader(data).load()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("size", [4, 5, 1000, 1001])
def test_a_tuple_of_four_or_more_items_is_read_as_that_tuple(protocol, size):
    value = tuple(range(size))
    assert read(pickle.dumps(value, protocol)) == value
    assert read(pickle.dumps([value, "after"], protocol)) == [value, "after"]
