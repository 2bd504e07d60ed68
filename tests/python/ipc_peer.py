"""One side of a CUDA IPC exchange, as a process of its own, driven by test_gpu_ipc.py.

    python ipc_peer.py ROLE [ARGS]

FD is this process's end of a socket pair the test made, used as a multiprocessing Connection (what
multiprocessing.Pipe() is); what goes over it is pickled, as torch.multiprocessing pickles it.

    weights-send FD      two rounds of about 30 weights of mixed shapes and dtypes (views among
                         them), each sent as the reduce_tensor results with their checksums. Round
                         "kept": the sender keeps its tensors until the receiver is done. Round
                         "dropped": once the receiver has rebuilt them, the sender drops its tensors
                         and allocates as much again, written over, before the receiver reads.
                         After each round: ipc_collect, and what the sender still has allocated.
    weights-receive FD   rebuilds them (the rebuild function and arguments reduce_tensor gave),
                         copies them into its own tensors, checks those, drops what it rebuilt
    queue-send KIND SEGMENTS
                         spawns a receiver whose allocator is KIND (native, gpumem) with SEGMENTS,
                         puts CUDA tensors on a torch.multiprocessing Queue; the receiver adds 1 in
                         place and says so; then the sender looks
    refused-send FD      sends one tensor to a receiver that may not import it, then goes on working
    refused-receive FD   tries to rebuild it; reports the error and that it goes on working
    figures-send FD      sends one 1 GiB tensor and its pid; keeps it until the receiver is done
    figures-receive FD   `gpumem top --json`'s rows of both processes before and after it rebuilds it

Each role prints one JSON line last: what it saw. Every wait is bounded by WAIT seconds: a peer that
ends or goes quiet makes the other fail, never hang. The module imports the standard library only
(the test imports `environment` from it); torch comes in each role, after the allocator is chosen.
"""
from __future__ import annotations

import json
import os
import sys

WAIT = 120.0
# A queue receiver waits this long for tensors that follow its "ready" at once: a Queue's feeder thread
# that fails to pickle them prints the error and puts nothing, and the test should not wait WAIT for that.
SOON = 30.0
LIMIT = "25%"  # GPUMEM_LIMIT of a gpumem process: a share of the device, far above what a role holds
CHUNK = 8 << 20  # bytes a checksum reads at a time: its int64 temporaries stay near 200 MiB
SCRIBBLE = 0x5A


def environment(kind: str, segments: str, base: dict) -> dict:
    """The environment a user starts a `kind` process with (gpumem: GPUMEM_LIMIT and GPUMEM_SEGMENTS;
    native: PyTorch's expandable segments for "growable", its default for "plain"), built on `base`
    less every gpumem and allocator setting in it."""
    env = {name: value for name, value in base.items()
           if not name.startswith("GPUMEM_") and name not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if kind == "gpumem":
        env.update(GPUMEM_LIMIT=LIMIT, GPUMEM_SEGMENTS=segments)
    elif segments == "growable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


# ---- what both sides use -------------------------------------------------------------------------

def allocator() -> dict:
    """Which allocator serves this process and the kind of its segments, as it reports them."""
    import torch

    import gpumem

    if gpumem.is_enabled():
        return {"gpumem": True, "segments": gpumem.get_segments()}
    probe = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")  # a segment of its own to look at
    kinds = {"growable" if s.get("is_expandable") else "plain" for s in torch.cuda.memory._snapshot()["segments"]}
    del probe
    return {"gpumem": False, "segments": kinds.pop() if len(kinds) == 1 else sorted(kinds)}


def checksum(t) -> int:
    """An exact, position-sensitive sum of the tensor's bytes in logical order: equal in two
    processes only if every byte is."""
    import torch

    data = t.contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, data.numel(), CHUNK):
        part = data[start:start + CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % 65521 + 1
        total += int((part * weight).sum())
    return total


def layout(t) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype)


def expect(conn, what: str):
    if not conn.poll(WAIT):
        raise TimeoutError(f"no {what} from the other process in {WAIT:.0f} s")
    return conn.recv()  # EOFError: the other process ended


def report(value: dict) -> None:
    print(json.dumps(value), flush=True)


def connection(fd: str):
    from multiprocessing.connection import Connection

    return Connection(int(fd))


# ---- weight sync -----------------------------------------------------------------------------------

def weights(seed: int) -> list:
    """About 30 (name, tensor) pairs as a model's weights come: large and small, odd sizes, every
    common dtype, and views (three slices of one fused tensor, a transpose, an empty and a 0-d one)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)

    def floats(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device="cuda", dtype=dtype)

    def ints(low, high, *shape, dtype):
        return torch.randint(low, high, shape, generator=g, device="cuda", dtype=dtype)

    fused = floats(3 * 1024, 1024)  # a fused q/k/v weight, sent as three views of one storage
    out = [
        ("embed", floats(32000, 1088)),  # 66 MiB: over 64 MiB
        ("lm_head", floats(32000, 1088)),
        ("mlp_up", floats(11008, 4096)),  # 86 MiB
        ("master_fp32", floats(4608, 4096, dtype=torch.float32)),  # 72 MiB
        # Made in fp32 and cast, as a model moved to bf16 is: 256 MiB cut from the 512 MiB freed.
        ("cast_from_fp32", floats(16384, 8192, dtype=torch.float32).to(torch.bfloat16)),
        ("q", fused[:1024]), ("k", fused[1024:2048]), ("v", fused[2048:]),
        ("o_transposed", floats(1024, 512).t()),
        ("odd_fp32", floats(1000003, dtype=torch.float32)),
        ("odd_bf16", floats(1000003)),
        ("odd_fp16", floats(999983, dtype=torch.float16)),
        ("odd_fp64", floats(10007, dtype=torch.float64)),
        ("conv_fp16", floats(64, 3, 7, 7, dtype=torch.float16)),
        ("bias", floats(4096)),
        ("token_ids", ints(0, 32000, 50021, dtype=torch.int64)),
        ("positions_i32", ints(-1000, 1000, 3, 7, 11, 13, dtype=torch.int32)),
        ("quantized_i8", ints(-128, 128, 4096, 1000, dtype=torch.int8)),
        ("bytes_u8", ints(0, 256, 123457, dtype=torch.uint8)),
        ("mask", ints(0, 2, 2049, 17, dtype=torch.uint8).bool()),
        ("scale", floats(dtype=torch.float32)),  # 0-d
        ("empty", floats(0, dtype=torch.float32)),
    ]
    out += [(f"norm_{i}", floats(1024, dtype=torch.float32)) for i in range(6)]
    out += [(f"small_{i}", floats(17 + i, 31)) for i in range(3)]
    return out


def storage_sizes(tensors) -> list[int]:
    """The bytes of each distinct storage under `tensors` (views share one)."""
    return list({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def weights_send(fd: str) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    conn = connection(fd)
    torch.empty(1, device="cuda")  # CUDA and the allocator up before the baseline
    base = torch.cuda.memory_allocated()
    rounds = []
    for seed, name in enumerate(("kept", "dropped")):
        named = weights(seed)
        tensors = [t for _, t in named]
        sizes = storage_sizes(tensors)
        conn.send({"names": [n for n, _ in named], "weights": [reduce_tensor(t) for t in tensors],
                   "sums": [checksum(t) for t in tensors], "layouts": [layout(t) for t in tensors]})
        del named
        expect(conn, "word that the weights are rebuilt")
        figures = {"round": name, "sent_bytes": sum(sizes)}
        scribbles = []
        if name == "dropped":
            del tensors
            figures["allocated_after_drop"] = torch.cuda.memory_allocated() - base
            # The same sizes again, written over: were the memory the receiver holds handed out
            # again, these would take it.
            scribbles = [torch.full((n,), SCRIBBLE, dtype=torch.uint8, device="cuda") for n in sizes]
            torch.cuda.synchronize()
        conn.send("read")
        expect(conn, "word that the receiver let go")
        tensors = scribbles = None
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        figures["allocated_after_collect"] = torch.cuda.memory_allocated() - base
        rounds.append(figures)
    report({"allocator": allocator(), "rounds": rounds})


def weights_receive(fd: str) -> None:
    import torch

    conn = connection(fd)
    torch.empty(1, device="cuda")
    own = None
    rounds = []
    for name in ("kept", "dropped"):
        message = expect(conn, f"weights of round {name!r}")
        if own is None:  # preallocated once, as a receiver holds its copy of the weights
            own = [torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device="cuda")
                   for shape, _, _, dtype in message["layouts"]]
        start = torch.cuda.memory_allocated()
        received = [rebuild(*args) for rebuild, args in message["weights"]]
        layouts = [layout(t) for t in received]
        conn.send("rebuilt")
        expect(conn, "word to read")
        for mine, theirs in zip(own, received):
            mine.copy_(theirs)
        torch.cuda.synchronize()
        holding = torch.cuda.memory_allocated() - start
        received = None
        torch.cuda.synchronize()
        sums = [checksum(t) for t in own]
        after = torch.cuda.memory_allocated() - start
        conn.send("let go")
        rounds.append({
            "round": name, "tensors": len(layouts),
            "layout_differs": [n for n, mine, theirs in zip(message["names"], layouts, message["layouts"])
                               if mine != theirs],
            "values_differ": [n for n, mine, theirs in zip(message["names"], sums, message["sums"]) if mine != theirs],
            "allocated_while_holding": holding, "allocated_after_drop": after,
        })
    report({"allocator": allocator(), "rounds": rounds})


# ---- a torch.multiprocessing Queue, the receiver writing in place -----------------------------------

def started_with(ctx, env: dict, **process):
    """A spawned process started under `env`: spawn's child takes the parent's environment as it
    stands at start(), so this is how one program starts a receiver of another allocator."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        child = ctx.Process(**process)
        child.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return child


def queue_tensors() -> dict:
    import torch

    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(1024, 1024, generator=g, device="cuda")
    return {
        "odd_fp32": torch.randn(1000003, generator=g, device="cuda"),
        "bf16": torch.randn(4096, 4096, generator=g, device="cuda", dtype=torch.bfloat16),
        "large_fp32": torch.randn(4608, 4096, generator=g, device="cuda"),  # 72 MiB
        "int32": torch.randint(-50, 50, (3, 5, 7), generator=g, device="cuda", dtype=torch.int32),
        "fp16": torch.randn(999, generator=g, device="cuda", dtype=torch.float16),
        "rows_100_to_200": base[100:200],  # a view: the rest of `base` must stay as it was
        "base": base,
    }


def queue_send(kind: str, segments: str) -> None:
    import torch
    import torch.multiprocessing as mp

    torch.empty(1, device="cuda")
    ctx = mp.get_context("spawn")
    tensors_queue, replies = ctx.Queue(), ctx.Queue()
    tensors = queue_tensors()
    base = tensors.pop("base")
    expected = {name: t.clone() + 1 for name, t in tensors.items()}
    expected_base = base.clone()
    expected_base[100:200] += 1
    receiver = started_with(ctx, environment(kind, segments, os.environ), target=queue_receive,
                            args=(tensors_queue, replies))
    try:
        ready = replies.get(timeout=WAIT)
        tensors_queue.put(list(tensors.values()))
        reply = replies.get(timeout=WAIT)  # the receiver waits at most SOON for the tensors
        torch.cuda.synchronize()
        seen = {name: bool(torch.equal(t, expected[name])) for name, t in tensors.items()}
        seen["rest_of_base_untouched"] = bool(torch.equal(base, expected_base))
        tensors_queue.put("looked")
        receiver.join(WAIT)
    finally:
        if receiver.is_alive():
            receiver.kill()
            receiver.join(10)
    report({"allocator": allocator(), "receiver": {**ready, **reply}, "seen": seen,
            "receiver_exit": receiver.exitcode})


def queue_receive(tensors_queue, replies) -> None:
    import torch

    replies.put({"allocator": allocator()})
    try:
        tensors = tensors_queue.get(timeout=SOON)
        for t in tensors:
            t.add_(1)
        torch.cuda.synchronize()
        replies.put({"tensors": len(tensors), "error": None})
    except Exception as error:
        replies.put({"tensors": 0, "error": f"{type(error).__name__}: {error}"})
        raise
    tensors_queue.get(timeout=WAIT)  # the sender has looked: the tensors may go


# ---- a receiver that may not import ------------------------------------------------------------

def refused_send(fd: str) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    conn = connection(fd)
    sent = torch.full((16 << 20,), 7.0, device="cuda")  # 64 MiB
    conn.send(reduce_tensor(sent))
    try:
        heard = expect(conn, "the receiver's outcome")
    except EOFError:
        heard = None  # the receiver died: the sender must go on all the same
    more = torch.ones(64 << 20, device="cuda")  # 256 MiB more, used
    more.mul_(2)
    a = torch.randn(1024, 1024, device="cuda")
    product_right = torch.allclose(a @ torch.eye(1024, device="cuda"), a, rtol=1e-2, atol=1e-2)  # TF32 or not
    works = bool(product_right) and bool((more == 2.0).all())
    report({"allocator": allocator(), "heard": heard, "intact": bool((sent == 7.0).all()), "works_after": works})


def refused_receive(fd: str) -> None:
    import torch

    conn = connection(fd)
    rebuild, args = expect(conn, "the tensor")
    try:
        rebuild(*args)
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    works = bool((torch.ones(1 << 20, device="cuda") * 3 == 3).all())
    outcome = {"error": error, "works_after": works}
    conn.send(outcome)
    report({"allocator": allocator(), **outcome})


# ---- whose figures hold received memory ------------------------------------------------------------

def top_rows(pids: list[int]) -> dict:
    """`gpumem top --json`'s rows of `pids` (by pid, as a string): the driver's used bytes and, for a
    gpumem process, its published figures."""
    import subprocess

    shown = subprocess.run([sys.executable, "-m", "gpumem", "top", "--json"], capture_output=True, text=True,
                           timeout=WAIT, check=True)
    rows = {}
    for row in json.loads(shown.stdout)["processes"]:
        if row["pid"] in pids:
            rows[str(row["pid"])] = {"used": row["used_bytes"], **{name: value for name, value in (row["gpumem"] or {}).items()
                                                                if name in ("allocated_bytes", "reserved_bytes", "counted_bytes")}}
    return rows


def figures_send(fd: str) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    conn = connection(fd)
    sent = torch.full((FIGURES_SENT,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    conn.send((os.getpid(), reduce_tensor(sent)))
    expect(conn, "the receiver's figures")
    report({"allocator": allocator(), "intact": bool((sent == 7).all())})


def figures_receive(fd: str) -> None:
    import time

    import torch

    conn = connection(fd)
    torch.empty(1, device="cuda")  # the context, counted before anything arrives
    sender, (rebuild, args) = expect(conn, "the tensor")
    pids = [os.getpid(), sender]
    deadline = time.monotonic() + WAIT / 2  # for all of it: the sender waits WAIT for "done"

    def shown_once_published() -> dict:  # figures are published on a timer: wait for this state's
        while True:
            rows = top_rows(pids)
            if all(str(pid) in rows and "counted_bytes" in rows[str(pid)] for pid in pids) and \
                    rows[str(sender)]["allocated_bytes"] >= FIGURES_SENT:
                return rows
            if time.monotonic() > deadline:
                raise TimeoutError(f"gpumem top did not show both processes' figures: {rows}")
            time.sleep(0.2)

    before = shown_once_published()
    time.sleep(1.5)  # a publication after the state settles
    before = shown_once_published()
    received = rebuild(*args)
    ends = (received[:SAMPLE], received[-SAMPLE:])  # a whole comparison would cache a 1 GiB temporary
    values = all(bool((end == 7).all()) for end in ends)
    torch.cuda.synchronize()
    time.sleep(1.5)
    after = shown_once_published()
    conn.send("done")
    report({"allocator": allocator(), "values": values, "receiver": str(os.getpid()), "sender": str(sender),
            "before": before, "after": after, "scope": __import__("gpumem").get_scope(0),
            "reserved": torch.cuda.memory_reserved(0), "allocated": torch.cuda.memory_allocated(0)})


FIGURES_SENT = 1 << 30  # bytes of the one tensor figures-send sends
SAMPLE = 1 << 20  # bytes at each end of it the receiver reads

ROLES = {"weights-send": weights_send, "weights-receive": weights_receive, "queue-send": queue_send,
         "refused-send": refused_send, "refused-receive": refused_receive,
         "figures-send": figures_send, "figures-receive": figures_receive}

if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
