"""torch.cuda.MemPool under a gpumem cap: a pool with its own allocator, no_split and use_on_oom.

Each test runs in a fresh process (see run_python).
"""
import inspect

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not hasattr(torch.cuda, "MemPool"), reason="torch.cuda.MemPool is not in this PyTorch"),
]

MiB = 1 << 20


def _mem_pool_takes(name: str) -> bool:
    return hasattr(torch.cuda, "MemPool") and name in inspect.signature(torch.cuda.MemPool.__init__).parameters


# A MemPool allocator of plain cudaMalloc / cudaFree that counts its calls and live bytes, built
# with load_inline into a shared library CUDAPluggableAllocator can load.
PLUGGABLE = r'''
import tempfile
from torch.utils.cpp_extension import load_inline

SOURCE = """
#include <cuda_runtime.h>
#include <sys/types.h>
#include <atomic>
#include <cstdint>

static std::atomic<int64_t> allocs{0}, frees{0}, live{0};

extern "C" void* gpumem_test_alloc(ssize_t size, int device, cudaStream_t stream) {
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, size) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  ++allocs;
  live += size;
  return ptr;
}

extern "C" void gpumem_test_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  cudaFree(ptr);
  ++frees;
  live -= size;
}

int64_t alloc_count() { return allocs; }
int64_t free_count() { return frees; }
int64_t live_bytes() { return live; }
"""

counting = load_inline(
    "gpumem_test_pool_allocator", cpp_sources=SOURCE, functions=["alloc_count", "free_count", "live_bytes"],
    with_cuda=True, build_directory=tempfile.mkdtemp(),
)
pluggable = torch.cuda.memory.CUDAPluggableAllocator(counting.__file__, "gpumem_test_alloc", "gpumem_test_free")
'''


@pytest.mark.skipif(not _mem_pool_takes("allocator"), reason="MemPool takes no allocator in this PyTorch")
def test_a_mem_pool_with_its_own_allocator_allocates_through_it_under_the_cap(run_python):
    result = run_python(
        PLUGGABLE,
        """
        gpumem.set_limit("1GB")
        limit = gpumem.get_limit()
        pool = torch.cuda.MemPool(pluggable.allocator())
        with torch.cuda.use_mem_pool(pool):
            inside = torch.full((16 << 20,), 3.0, device="cuda")  # 64 MiB
        outside = torch.full((16 << 20,), 1.0, device="cuda")
        total = (inside + outside).sum().item()
        allocs, live = counting.alloc_count(), counting.live_bytes()
        reserved = torch.cuda.memory_reserved()
        with torch.cuda.use_mem_pool(pool):
            try:
                torch.empty(limit, dtype=torch.uint8, device="cuda")
                over_limit = None
            except torch.OutOfMemoryError as error:
                over_limit = str(error)
        allocs_after_oom = counting.alloc_count()
        del inside
        torch.cuda.synchronize()
        del pool  # releasePool, then emptyCache of its id: its segment goes back through free
        frees, live_after = counting.free_count(), counting.live_bytes()
        print(json.dumps({
            "sum": total, "allocs": allocs, "live": live, "reserved": reserved, "limit": limit,
            "over_limit": over_limit, "allocs_after_oom": allocs_after_oom, "frees": frees,
            "live_after": live_after, "max_reserved": torch.cuda.max_memory_reserved(),
        }))
        """,
        timeout=600,
    )
    assert result["sum"] == 4.0 * (16 << 20)
    assert result["allocs"] == 1
    assert result["live"] == 64 * MiB
    assert result["reserved"] >= 128 * MiB  # the pool's segment counts with gpumem's own
    assert result["over_limit"] is not None
    assert result["allocs_after_oom"] == 1  # refused by the cap before the allocator was asked
    assert result["frees"] == 1
    assert result["live_after"] == 0
    assert result["max_reserved"] <= result["limit"]


@pytest.mark.skipif(not _mem_pool_takes("no_split"), reason="MemPool has no no_split in this PyTorch")
def test_a_no_split_mem_pool_keeps_one_block_per_segment(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB")
        pool = torch.cuda.MemPool(no_split=True)
        with torch.cuda.use_mem_pool(pool):
            tensors = [torch.empty(4096, dtype=torch.uint8, device="cuda") for _ in range(3)]
        segments = torch.cuda.memory_snapshot(mempool_id=pool.id)
        print(json.dumps({"blocks": [len(s["blocks"]) for s in segments]}))
        """
    )
    assert result["blocks"] == [1, 1, 1]


@pytest.mark.skipif(not _mem_pool_takes("use_on_oom"), reason="MemPool has no use_on_oom in this PyTorch")
def test_a_use_on_oom_mem_pool_serves_a_request_the_cap_refuses(run_python):
    result = run_python(
        """
        gpumem.set_limit("300MB")
        outcomes = {}
        for use_on_oom in (False, True):
            pool = torch.cuda.MemPool(use_on_oom=use_on_oom)
            with torch.cuda.use_mem_pool(pool):
                cached = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
            address = cached.data_ptr()
            del cached  # 200 MiB cached in the pool, which is still held
            try:
                borrowed = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
                outcomes[str(use_on_oom)] = borrowed.data_ptr() == address
                del borrowed
            except torch.OutOfMemoryError:
                outcomes[str(use_on_oom)] = "oom"
            del pool
            torch.cuda.empty_cache()
        print(json.dumps(outcomes))
        """
    )
    assert result == {"False": "oom", "True": True}
