"""Installing gpumem in a real process: when it can, GPUMEM_LIMIT, devices, and what it refuses.

Each test runs in a fresh process (see run_python).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20


def test_enable_does_not_start_cuda(run_python):
    result = run_python(
        """
        gpumem.enable()
        started = torch.cuda.is_initialized()
        x = torch.ones(1 << 20, device="cuda")
        print(json.dumps({"started": started, "enabled": gpumem.is_enabled(),
                          "allocated": gpumem.stats()["allocated_bytes.all.current"]}))
        """
    )
    assert result["started"] is False
    assert result["enabled"] is True
    assert result["allocated"] >= 4 * MiB


def test_enable_alone_leaves_the_device_uncapped(run_python):
    result = run_python(
        """
        gpumem.enable()
        print(json.dumps({"limit": gpumem.get_limit(), "total": gpumem.device_mem_info()[1]}))
        """
    )
    assert result["limit"] == result["total"]


def test_set_limit_after_pytorch_used_cuda_raises_with_advice_and_the_process_goes_on(run_python):
    result = run_python(
        """
        before = torch.zeros(10, device="cuda")
        try:
            gpumem.set_limit("1GB")
            message = None
        except RuntimeError as error:
            message = str(error)
        after = torch.ones(10, device="cuda").sum().item()
        print(json.dumps({"message": message, "after": after, "enabled": gpumem.is_enabled()}))
        """
    )
    assert result["message"] is not None
    assert "GPUMEM_LIMIT" in result["message"] and "gpumem.enable()" in result["message"]
    assert result["after"] == 10.0
    assert result["enabled"] is False


def test_gpumem_limit_in_the_environment_caps_the_device_at_enable(run_python):
    result = run_python(
        """
        gpumem.enable()
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            refused = None
        except torch.OutOfMemoryError as error:
            refused = str(error)
        print(json.dumps({"limit": gpumem.get_limit(), "refused": refused}))
        """,
        env={"GPUMEM_LIMIT": "768MB"},
    )
    assert result["limit"] == 768 * MiB
    assert result["refused"] is not None and "gpumem" in result["refused"]


def test_a_bad_gpumem_limit_is_an_error_at_enable(run_python):
    result = run_python(
        """
        import os
        # Set after start-up: the autoload would stop the program at `import torch` otherwise.
        os.environ["GPUMEM_LIMIT"] = "4 gigs"
        try:
            gpumem.enable()
            message = None
        except ValueError as error:
            message = str(error)
        print(json.dumps({"message": message, "enabled": gpumem.is_enabled()}))
        """,
    )
    assert result["message"] is not None
    assert "GPUMEM_LIMIT='4 gigs'" in result["message"]
    assert "Accepted forms" in result["message"]
    assert result["enabled"] is False


def test_devices_are_numbered_as_cuda_visible_devices_makes_them(run_python):
    result = run_python(
        """
        try:
            gpumem.set_limit("1GB", device=1)
            message = None
        except ValueError as error:
            message = str(error)
        gpumem.set_limit("1GB", device=0)
        print(json.dumps({"message": message, "limit": gpumem.get_limit(0),
                          "count": torch.cuda.device_count()}))
        """,
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    assert result["count"] == 1
    assert "no CUDA device 1" in result["message"]
    assert result["limit"] == 1 << 30


def test_a_cuda_tensor_passed_to_a_spawned_process_arrives(run_python):
    result = run_python(
        """
        import torch.multiprocessing as mp
        gpumem.set_limit("1GB")
        x = torch.arange(16, device="cuda", dtype=torch.float32)
        process = mp.get_context("spawn").Process(target=torch.Tensor.sum, args=(x,))
        process.start()
        process.join(120)
        print(json.dumps(process.exitcode))
        """
    )
    assert result == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_each_device_has_its_own_cap(run_python):
    result = run_python(
        """
        gpumem.set_limit("1GB", device=0)
        gpumem.set_limit("2GB", device="cuda:1")
        on_one = torch.empty(1536 << 20, dtype=torch.uint8, device="cuda:1")
        try:
            torch.empty(1536 << 20, dtype=torch.uint8, device="cuda:0")
            refused_on_zero = False
        except torch.OutOfMemoryError:
            refused_on_zero = True
        print(json.dumps({"limits": [gpumem.get_limit(0), gpumem.get_limit(1)],
                          "refused_on_zero": refused_on_zero,
                          "reserved_on_one": torch.cuda.memory_reserved(1)}))
        """
    )
    assert result["limits"] == [1 << 30, 2 << 30]
    assert result["refused_on_zero"]
    assert 1536 * MiB <= result["reserved_on_one"] <= 2 << 30


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpumem_limit_caps_each_listed_device(run_python):
    result = run_python(
        """
        gpumem.enable()
        print(json.dumps([gpumem.get_limit(0), gpumem.get_limit(1)]))
        """,
        env={"GPUMEM_LIMIT": "0:1GB,1:2GB"},
    )
    assert result == [1 << 30, 2 << 30]


@pytest.mark.parametrize("segments", ["plain", "growable"])
def test_frees_above_a_lowered_limit_give_memory_back_until_reserved_is_under_it(run_python, segments):
    result = run_python(
        f"""
        gpumem.set_segments({segments!r})
        gpumem.set_limit("1GB")
        tensors = [torch.empty(100 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
        gpumem.set_limit("100MB")
        reserved = [torch.cuda.memory_reserved()]
        while tensors:
            tensors.pop()
            reserved.append(torch.cuda.memory_reserved())
        x = torch.empty(50 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({{"reserved": reserved, "after": torch.cuda.memory_reserved(),
                          "limit": gpumem.get_limit(), "segments": gpumem.get_segments()}}))
        """
    )
    assert result["segments"] == segments
    assert result["reserved"][0] == 800 * MiB
    # Every free while above the limit gives memory back; once under it, frees cache as always.
    assert all(b < a for a, b in zip(result["reserved"], result["reserved"][1:]) if a > result["limit"])
    assert result["reserved"][-1] <= result["limit"] == 100 * MiB
    assert result["after"] <= result["limit"]
