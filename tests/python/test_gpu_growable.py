"""Growable segments on a GPU: on by default, under the cap, and what plain segments cannot do.

Each test runs in a fresh process (see run_python).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20
PAGE = 2 * MiB

# Under a 1 GiB cap: 150 tensors of 4, 6 and 8 MiB (900 MiB), every other one freed (450 MiB of holes
# of at most 8 MiB), then one tensor of 512 MiB: it fits under the limit beside the 450 MiB still
# live, but in no hole. With plain segments the holes sit in 20 MiB segments that each keep a live
# tensor, so none can be released and a new 512 MiB segment does not fit under the cap; growable
# segments unmap the holes' pages and map the request's. Reports what happened, with
# memory_reserved() after each step and after empty_cache.
FRAGMENT = """
gpumem.set_limit("1GB")
MiB = 1 << 20
limit = gpumem.get_limit()
reserved = []
tensors = [torch.empty((4, 6, 8)[i % 3] * MiB, dtype=torch.uint8, device="cuda") for i in range(150)]
reserved.append(torch.cuda.memory_reserved())
del tensors[1::2]
allocated = torch.cuda.memory_allocated()
largest_hole = gpumem.report(0).devices[0].largest_free_block
try:
    big = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    error = None
except torch.OutOfMemoryError as e:
    big, error = None, str(e)
reserved.append(torch.cuda.memory_reserved())
torch.cuda.synchronize()
torch.cuda.empty_cache()
print(json.dumps({
    "segments": gpumem.get_segments(), "limit": limit, "allocated_before_big": allocated,
    "largest_hole": largest_hole, "error": error, "reserved": reserved, "max_reserved": torch.cuda.max_memory_reserved(),
    "after_empty_cache": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
    "live_tensors": len(tensors) + (big is not None),
}))
"""


@pytest.fixture(scope="module")
def fragmented(run_python):
    return run_python(FRAGMENT)


def test_growable_segments_are_in_effect_by_default(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.ones(8 << 20, device="cuda")
        print(json.dumps({"segments": gpumem.get_segments(), "supported": gpumem._C.growable_supported(0),
                          "page": gpumem._C.page_size(0)}))
        """
    )
    assert result["supported"], "this GPU's driver reports no CUDA virtual memory management"
    assert result["segments"] == "growable"
    assert result["page"] > 0 and result["page"] & (result["page"] - 1) == 0


def test_a_request_larger_than_every_hole_fits_under_the_limit_with_growable_segments(fragmented):
    assert fragmented["segments"] == "growable"
    assert fragmented["allocated_before_big"] + 512 * MiB <= fragmented["limit"]
    assert fragmented["largest_hole"] < 512 * MiB
    assert fragmented["error"] is None


def test_reserved_stays_under_the_limit_throughout(fragmented):
    assert fragmented["max_reserved"] <= fragmented["limit"]
    assert all(r <= fragmented["limit"] for r in fragmented["reserved"])


def test_empty_cache_brings_reserved_down_to_about_allocated(fragmented):
    # Every size here is whole pages, so each live tensor adds at most the one page it shares.
    slack = PAGE * fragmented["live_tensors"]
    assert fragmented["allocated"] <= fragmented["after_empty_cache"] <= fragmented["allocated"] + slack


def test_the_same_pattern_fails_as_fragmentation_with_plain_segments(run_python):
    # What makes the growable test above mean something: plain segments cannot serve it.
    result = run_python(FRAGMENT, env={"GPUMEM_SEGMENTS": "plain"})
    assert result["segments"] == "plain"
    assert result["error"] is not None and "gpumem: fragmentation" in result["error"]
    assert result["max_reserved"] <= result["limit"]


def test_torch_snapshot_marks_growable_segments_expandable(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        kept = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 6, 30)]
        segments = torch.cuda.memory._snapshot()["segments"]
        print(json.dumps({"expandable": [s["is_expandable"] for s in segments],
                          "total": sum(s["total_size"] for s in segments),
                          "reserved": torch.cuda.memory_reserved()}))
        """
    )
    assert result["expandable"] and all(result["expandable"])
    assert result["total"] == result["reserved"]


def test_gpumem_segments_plain_makes_plain_segments(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        x = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        segments = torch.cuda.memory._snapshot()["segments"]
        print(json.dumps({"segments": gpumem.get_segments(),
                          "expandable": [s["is_expandable"] for s in segments]}))
        """,
        env={"GPUMEM_SEGMENTS": "plain"},
    )
    assert result["segments"] == "plain"
    assert result["expandable"] and not any(result["expandable"])


def test_set_segments_plain_at_run_time_makes_new_memory_plain(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        before = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        gpumem.set_segments("plain")
        after = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        kinds = {}
        for s in torch.cuda.memory._snapshot()["segments"]:
            for name, t in (("before", before), ("after", after)):
                if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]:
                    kinds[name] = s["is_expandable"]
        print(json.dumps({"segments": gpumem.get_segments(), "kinds": kinds}))
        """
    )
    assert result["segments"] == "plain"
    assert result["kinds"] == {"before": True, "after": False}
