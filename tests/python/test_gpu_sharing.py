"""docs/usage.md's worked example of sharing a GPU, run as written on a GPU: a service started with
GPUMEM_FLOOR=20GB beside a training job started with GPUMEM_SHARE=on, two programs that never call
gpumem.enable() (they import gpumem only to read their figures), and the same through
`gpumem run --floor/--share`. The floor holds and free cache moves to the process that needs it.
And a floor that does not fit the devices stops torch's CUDA init, and every CUDA call after it."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest
import torch

from conftest import environment_without_gpumem_settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GiB = 1 << 30
FLOOR_GIB = 20  # GPUMEM_FLOOR=20GB, as docs/usage.md's example

# A program that knows nothing of gpumem: it holds 1 GiB tensors as told on stdin, one reply a line.
PROGRAM = """
import json, sys, torch

held = []
for command in sys.stdin:
    verb, *args = command.split()
    if verb == "hold":  # hold N GiB in all, or as many as the device lets it
        try:
            while len(held) < int(args[0]):
                held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            pass
    elif verb == "free":  # the tensors go; the memory stays in the cache
        held.clear()
    reply = {"held": len(held), "reserved": torch.cuda.memory_reserved(0)}
    if verb == "figures":  # read only: the program never enables gpumem
        import gpumem
        reply.update(enabled=gpumem.is_enabled(), sharing=gpumem.sharing.status(0))
    print(json.dumps(reply), flush=True)
"""


class Program:
    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)

    def ask(self, line: str, seconds: float = 300) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], seconds)
        reply = self.process.stdout.readline() if ready else ""
        assert reply, f"no reply to {line!r}: {self.process.stderr.read()[-4000:] if not ready else ''}"
        return json.loads(reply)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        assert self.process.returncode == 0, self.process.stderr.read()[-4000:]


def environment(run_dir: str, **settings: str) -> dict:
    return {**environment_without_gpumem_settings(), "GPUMEM_RUN_DIR": run_dir, **settings}


# The service in a container's pid namespace: the worked example with one member in another namespace.
IN_A_PID_NAMESPACE = "variables, the service in a pid namespace of its own"
UNSHARE = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")


def unshare_or_skip() -> None:
    try:
        tried = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("unshare (util-linux) is not installed")
    if tried.returncode != 0:
        pytest.skip(f"this user may not make a pid namespace: {tried.stderr.strip()}")


def started(how: str, side: str, run_dir: str) -> Program:
    """The service (side "serve") or the training job ("train"), started as docs/usage.md starts it
    (`how` "variables") or through `gpumem run` ("gpumem run"); with IN_A_PID_NAMESPACE, the
    service as with "variables" but in a pid namespace of its own (unshare), as in a container."""
    program = [sys.executable, "-c", PROGRAM]
    if how == IN_A_PID_NAMESPACE and side == "serve":
        return Program([*UNSHARE, *program], environment(run_dir, GPUMEM_FLOOR=f"{FLOOR_GIB}GB"))
    if how in ("variables", IN_A_PID_NAMESPACE):
        setting = {"GPUMEM_FLOOR": f"{FLOOR_GIB}GB"} if side == "serve" else {"GPUMEM_SHARE": "on"}
        return Program(program, environment(run_dir, **setting))
    option = ["--floor", f"{FLOOR_GIB}GB"] if side == "serve" else ["--share"]
    return Program([sys.executable, "-m", "gpumem", "run", *option, "--", *program], environment(run_dir))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 48 * GiB,
                    reason="the worked example's 20 GB floor needs a GPU of 48 GiB or more")
@pytest.mark.whole_gpu
@pytest.mark.parametrize("how", ["variables", "gpumem run", IN_A_PID_NAMESPACE])
def test_the_worked_example_holds_the_floor_and_moves_the_cache(tmp_path, how):
    if how == IN_A_PID_NAMESPACE:
        unshare_or_skip()
    apart = how == IN_A_PID_NAMESPACE
    run_dir = str(tmp_path / "run")
    total = torch.cuda.get_device_properties(0).total_memory
    serve = started(how, "serve", run_dir)
    train = None
    try:
        assert serve.ask("hold 2")["held"] == 2  # S: uses 2 GiB most of the time
        train = started(how, "train", run_dir)
        grown = train.ask("hold 1000")  # T: no cap, grows as far as it is let
        assert 0 < grown["held"] and grown["reserved"] <= total - FLOOR_GIB * GiB
        # S can take its 20 GiB at any time, T holding all it grew to.
        assert serve.ask(f"hold {FLOOR_GIB}")["held"] == FLOOR_GIB
        figures = serve.ask("figures")
        assert figures["enabled"] and figures["sharing"]["floor"] == FLOOR_GIB * GiB
        # Each sees the other as a member, and whether it is in its own pid namespace.
        assert [o["same_pid_namespace"] for o in figures["sharing"]["others"]] == [not apart], figures
        seen_by_train = train.ask("figures")["sharing"]["others"]
        assert [(o["same_pid_namespace"], o["floor"]) for o in seen_by_train] == [(not apart, FLOOR_GIB * GiB)]
        # T's tensors go; S, past its floor on a device T filled, gets the memory T cached, which T
        # gives back (asked, or on its frees as a borrower beside a floor: docs/usage.md).
        # Asked, T gives back what the device lacks for S's 4 GiB (less what was free), a chunk more
        # at most; as a borrower it may give back more on its own frees, counted apart.
        train.ask("free")
        given_before = train.ask("figures")["sharing"]["given_back"]
        assert serve.ask(f"hold {FLOOR_GIB + 4}")["held"] == FLOOR_GIB + 4
        after = train.ask("figures")
        given = after["sharing"]["given_back"] - given_before
        from gpumem import _C
        assert after["enabled"] and after["reserved"] < grown["reserved"], (grown, after)
        assert given <= 4 * GiB + _C.MAX_CHUNK, (grown, after)
    finally:
        for program in (serve, train):
            if program is not None:
                program.close()


@pytest.mark.parametrize("floor, says", [("5:8GB", 'bad GPUMEM_FLOOR "5:8GB" on device 5: there is no CUDA device 5'),
                                         ("100TB", 'bad GPUMEM_FLOOR "100TB" on device 0: it comes to 100.00 TiB, more '
                                                   "than the device total")])
def test_a_floor_that_does_not_fit_stops_cuda_init_and_every_cuda_call_after_it(tmp_path, floor, says):
    if floor == "5:8GB" and torch.cuda.device_count() > 5:
        pytest.skip("the machine has a device 5")
    code = """
import torch
for attempt in range(2):
    try:
        torch.empty(1, device="cuda")
        print("allocated")
    except Exception as error:
        print(str(error).splitlines()[0] if attempt else str(error))
"""
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               env=environment(str(tmp_path / "run"), GPUMEM_FLOOR=floor))
    assert completed.returncode == 0, completed.stderr
    assert "allocated" not in completed.stdout
    assert completed.stdout.count(says) == 2, completed.stdout
    run_dir = tmp_path / "run"  # checked before any table is joined: none was made
    assert not run_dir.exists() or not [name for name in os.listdir(run_dir) if name.endswith(".table")]
