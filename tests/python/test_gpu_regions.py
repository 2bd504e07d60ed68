"""Regions paused and resumed on a GPU (gpumem.region, pause, resume): the memory goes back to the
device and comes back at the same addresses, contents and captured graphs intact.

Each test runs in a fresh process (see run_python); sizes follow the device's memory.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GiB = 1 << 30

# Weights, an optimizer-like state and a KV-cache-like buffer in a region with a backup, a graph
# captured over the weights, then pause and resume: what the device freed, the contents, the
# addresses and the graph's replay.
ROUND_TRIP = """
gpumem.enable()  # before torch's first CUDA call (get_device_properties starts CUDA)
MiB = 1 << 20
gib = max(1, min(8, torch.cuda.get_device_properties(0).total_memory // (10 << 30)))
with gpumem.region("engine", backup=True):
    weights = torch.randn(gib * 64 * MiB, device="cuda")  # float32: gib x 256 MiB
    state = torch.randn(gib * 32 * MiB, device="cuda")
    cache = torch.empty(gib * 96 * MiB, dtype=torch.uint8, device="cuda").random_(0, 255)
    scratch = torch.empty(gib * 100 * MiB, dtype=torch.uint8, device="cuda")
del scratch  # the region's cache: goes at the pause, not backed up
keep = [t.cpu() for t in (weights, state, cache)]
addresses = [t.data_ptr() for t in (weights, state, cache)]
static_in = torch.ones(1024, device="cuda")
graph = torch.cuda.CUDAGraph()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    out = (weights[:1024] * static_in).sum() + state[:1024].sum()
    torch.cuda.current_stream().synchronize()
    with torch.cuda.graph(graph):
        out = (weights[:1024] * static_in).sum() + state[:1024].sum()
torch.cuda.current_stream().wait_stream(stream)
graph.replay()
before = out.item()
torch.cuda.synchronize()
reserved_before = torch.cuda.memory_reserved()
free_before = torch.cuda.mem_get_info()[0]
paused = gpumem.pause("engine")
free_paused = torch.cuda.mem_get_info()[0]
reserved_paused = torch.cuda.memory_reserved()
listed = gpumem.paused()
resumed = gpumem.resume("engine")
graph.replay()
after = out.item()
same = all(torch.equal(t.cpu(), k) for t, k in zip((weights, state, cache), keep))
print(json.dumps({
    "live": sum(t.numel() * t.element_size() for t in (weights, state, cache)),
    "paused": paused, "resumed": resumed, "listed": listed, "after_listed": gpumem.paused(),
    "freed_on_device": free_paused - free_before, "reserved_before": reserved_before,
    "reserved_paused": reserved_paused, "same": same,
    "same_addresses": addresses == [t.data_ptr() for t in (weights, state, cache)],
    "graph_before": before, "graph_after": after,
}))
"""


@pytest.mark.whole_gpu
def test_a_paused_region_frees_its_memory_and_resumes_at_the_same_addresses_with_its_contents(run_python):
    r = run_python(ROUND_TRIP)
    assert r["paused"] >= r["live"]  # its live tensors' memory went back, whole chunks
    assert r["resumed"] == r["paused"]
    assert r["listed"] == {"engine": r["paused"]} and r["after_listed"] == {}
    # The device got the memory: reserved dropped by what was paused, and the device's free memory
    # rose by at least 99 % of it.
    assert r["reserved_before"] - r["reserved_paused"] >= r["paused"]
    assert r["freed_on_device"] >= 0.99 * r["paused"], r
    assert r["same"] and r["same_addresses"]
    assert r["graph_after"] == r["graph_before"]


def test_without_a_backup_the_memory_comes_back_usable(run_python):
    r = run_python(
        """
        with gpumem.region("kv"):
            kv = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        paused = gpumem.pause("kv")
        gpumem.resume("kv")
        kv.fill_(3)
        print(json.dumps({"paused": paused, "sum": int(kv[:1000].sum()), "ptr_same": True}))
        """
    )
    assert r["paused"] >= 256 << 20 and r["sum"] == 3000


def test_a_prepared_region_pauses_into_the_memory_prepared_and_comes_back_the_same(run_python):
    r = run_python(
        """
        import threading
        with gpumem.region("weights", backup=True):
            weights = torch.randn(64 << 20, device="cuda")  # 256 MiB
            scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del scratch  # the region's cache: prepared for too
        with gpumem.region("kv"):
            kv = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        keep = weights.cpu()
        got = []
        pinning = threading.Thread(target=lambda: got.append(gpumem.prepare_backups()))
        pinning.start()  # every region with a backup, beside other work
        other = torch.ones(32 << 20, device="cuda") * 2
        pinning.join()
        try:
            gpumem.prepare_backups("kv")
            refused = ""
        except ValueError as error:
            refused = str(error)
        paused = gpumem.pause("weights")
        gpumem.resume("weights")
        print(json.dumps({"prepared": got[0], "again": gpumem.prepare_backups("weights"), "paused": paused,
                          "same": torch.equal(weights.cpu(), keep), "other": float(other[-1]), "refused": refused,
                          "dropped": gpumem.drop_backups("weights")}))
        """
    )
    assert r["again"] == 0  # held: the pause copied into it and kept it
    assert 256 << 20 <= r["paused"] <= r["prepared"] and r["same"] and r["other"] == 2.0
    assert r["paused"] <= r["dropped"] <= r["prepared"]  # held: what the pause copied, inside what was prepared
    assert "region 'kv' was made with backup=False" in r["refused"]


def test_a_paused_region_refuses_allocations_and_pausing_inside_a_region_is_refused(run_python):
    r = run_python(
        """
        with gpumem.region("a", backup=True):
            x = torch.ones(4 << 20, device="cuda")
            try:
                gpumem.pause("a")
                inside = None
            except RuntimeError as e:
                inside = str(e)
        gpumem.pause("a")
        try:
            with gpumem.region("a"):
                torch.empty(10, device="cuda")
            refused = None
        except RuntimeError as e:
            refused = str(e)
        y = torch.ones(4 << 20, device="cuda")  # outside the region: as usual
        gpumem.resume("a")
        print(json.dumps({"inside": inside, "refused": refused, "x": float(x.sum()), "y": float(y.sum())}))
        """
    )
    assert "pause after it ends" in r["inside"]
    assert "is paused" in r["refused"] and "gpumem.resume('a')" in r["refused"]
    assert r["x"] == 4 << 20 and r["y"] == 4 << 20


# Another process (NEIGHBOUR_ENV: native PyTorch, or gpumem) takes the memory a paused region gave
# back; resume then fails, the region still paused, and succeeds with its contents once the other
# process has gone.
NEIGHBOUR = """
import os, subprocess, sys
HOLD = '''
import sys, torch
free = torch.cuda.mem_get_info()[0]
x = torch.empty(free - (512 << 20), dtype=torch.uint8, device="cuda")
print("holding", "gpumem" if "gpumem" in sys.modules else "native", flush=True)
sys.stdin.readline()
'''
with gpumem.region("model", backup=True):
    model = torch.randn(2 << 28, device="cuda")   # 2 GiB
keep = model[-1000:].cpu()
gpumem.pause("model")
other = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **NEIGHBOUR_ENV})
held_by = other.stdout.readline().split()
try:
    gpumem.resume("model")
    error = None
except torch.OutOfMemoryError as e:
    error = str(e)
still = gpumem.paused()
other.stdin.write("go\\n"); other.stdin.flush(); other.wait()
resumed = gpumem.resume("model")
print(json.dumps({"error": error, "still": still, "resumed": resumed, "same": torch.equal(model[-1000:].cpu(), keep),
                  "held_by": held_by}))
"""


@pytest.mark.whole_gpu
@pytest.mark.parametrize("neighbour", ["native", "gpumem"])
def test_a_neighbour_uses_the_paused_memory_and_resume_fails_cleanly_until_it_is_back(run_python, neighbour):
    # The neighbour runs as users start it: native PyTorch, or gpumem installed by GPUMEM_LIMIT.
    env = {"GPUMEM_LIMIT": "100%"} if neighbour == "gpumem" else {}
    r = run_python(f"NEIGHBOUR_ENV = {env!r}", NEIGHBOUR)
    assert r["error"] is not None and "region 'model'" in r["error"] and "stays paused" in r["error"], r
    assert list(r["still"]) == ["model"]
    assert r["resumed"] == r["still"]["model"] and r["same"]
    assert r["held_by"] == ["holding", neighbour]


@pytest.mark.whole_gpu
def test_the_rl_example_pauses_its_engine_for_every_training_step(tmp_path):
    """examples/rl_loop.py, run as a user runs it: 10 rounds, each checking the engine's weights;
    the trainer's step uses memory that the cap has room for only while the engine is paused."""
    import json
    import pathlib
    import subprocess
    import sys
    from conftest import environment_without_gpumem_settings
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
    done = subprocess.run([sys.executable, str(example), "10"], capture_output=True, text=True, timeout=300,
                          env=environment_without_gpumem_settings())
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    rounds, summary = lines[:-1], lines[-1]
    assert len(rounds) == 10 and all(r["weights_intact"] for r in rounds)
    assert summary["weights_intact"]
    assert summary["trainer_peak_reserved"] <= summary["limit"]
    assert summary["trainer_peak_beside_a_resident_engine"] > summary["limit"], summary


# A process sharing the GPU (started by `gpumem run --share`) pauses a region with a backup; a
# neighbour started with GPUMEM_SHARE=on fills the device and frees its tensors, keeping the memory
# in its cache. The resume finds the device full and asks the neighbour, as an allocation would.
PAUSER = """
import json, sys, torch, gpumem
with gpumem.region("engine", backup=True):
    weights = torch.randn(1 << 30, device="cuda")  # 4 GiB
def digest():
    return [int(p.sum(dtype=torch.int64)) for p in weights.view(torch.int32).split(64 << 20)]
kept = digest()
for command in sys.stdin:
    reply = {}
    if command.strip() == "pause":
        reply["paused"] = gpumem.pause("engine")
    elif command.strip() == "resume":
        try:
            reply["resumed"] = gpumem.resume("engine")
            reply["same"] = digest() == kept
        except torch.OutOfMemoryError as error:
            reply["error"] = str(error)
    reply.update(reserved=torch.cuda.memory_reserved(0), sharing=gpumem.sharing.status(0))
    print(json.dumps(reply), flush=True)
"""


@pytest.mark.whole_gpu
def test_a_resume_on_a_device_a_sharing_neighbour_filled_asks_it_for_its_cache(tmp_path):
    import sys
    from test_gpu_sharing import PROGRAM, Program, environment
    from test_sharing_processes import wait_for
    run_dir = str(tmp_path / "run")
    pauser = Program([sys.executable, "-m", "gpumem", "run", "--share", "--", sys.executable, "-c", PAUSER],
                     environment(run_dir))
    neighbour = None
    try:
        paused = pauser.ask("pause")
        assert paused["paused"] >= 4 * GiB and paused["sharing"] is not None, paused
        neighbour = Program([sys.executable, "-c", PROGRAM], environment(run_dir, GPUMEM_SHARE="on"))
        grown = neighbour.ask("hold 1000")  # as far as the device lets it
        assert grown["held"] * GiB > torch.cuda.get_device_properties(0).total_memory - paused["paused"] - 8 * GiB
        assert neighbour.ask("free")["reserved"] == grown["reserved"]  # its tensors go, its cache stays
        resumed = pauser.ask("resume")
        assert resumed.get("resumed") == paused["paused"] and resumed["same"], resumed
        assert resumed["sharing"]["asks_made"] > paused["sharing"]["asks_made"], resumed
        # The neighbour counts what it gave back a moment after the memory went.
        wait_for(lambda: neighbour.ask("figures")["sharing"]["given_back"] > 0)
        after = neighbour.ask("figures")
        assert after["sharing"]["given_back"] > 0, after
        assert after["reserved"] < grown["reserved"]
    finally:
        for program in (pauser, neighbour):
            if program is not None:
                program.close()
