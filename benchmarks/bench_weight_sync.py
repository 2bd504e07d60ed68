#!/usr/bin/env python3
"""Weight sync through CUDA IPC: one process sends a model's weights with reduce_tensor, another
copies them into weights of its own, round after round, as an RL trainer updates its inference engine.

The weights: 1.01e9 bf16 parameters (1.88 GiB) in 183 tensors of a Llama-like model with
TinyLlama-1.1B's widths (vocabulary 32000, width 2048, MLP 5632, grouped-query attention with 4
key/value heads of 64) and 20 layers: the embedding and the untied output head, per layer q/k/v/o,
gate/up/down and two norms, the final norm. --layers changes the depth.

A round, timed at the receiver from its request to its copy done (torch.cuda.synchronize included):
the sender runs reduce_tensor over every weight and sends the results through a Pipe; the receiver
rebuilds each tensor (the rebuild function and arguments reduce_tensor gave) and copies it into its
own preallocated tensor. Then the receiver drops what it rebuilt, untimed (release_s). Figures per
configuration: round time (median, max, and the parts: request to weights received, rebuild, copy),
and memory on both sides (memory_allocated, memory_reserved, and NVML's count for the process where
pynvml is installed and NVML lists it) once the rounds are done, the last round's weights still held,
and again after the receiver let them go and the sender ran torch.cuda.ipc_collect().

A configuration is a sender and a receiver, each native or gpumem, and a kind of segments for both
(benchmarks/common.py: gpumem is gpumem.enable()'d, with GPUMEM_SEGMENTS=plain for plain segments;
native is PyTorch's allocator, with expandable_segments:True for growable). --chunk SIZE runs the
gpumem sides with GPUMEM_CHUNK=SIZE (the least chunk of growable memory, docs/usage.md). Each runs in two fresh
processes. One that fails (an exception in either process, or its time running out) is reported as
failed with the error's last line, and the others still run. The run stays within --budget-s
seconds: each configuration gets an equal share of what is left (MIN_SHARE_S at least) and runs
rounds until --rounds are done or its share is spent; once under MIN_SHARE_S seconds are left, the
configurations still to run are skipped.

    python3 benchmarks/bench_weight_sync.py [--pairs native-native,gpumem-gpumem,native-gpumem,gpumem-native]
        [--segments growable,plain] [--chunk 16MB] [--rounds 20] [--layers 20] [--budget-s 300] [--out FILE]

Prints a Markdown table, one row per configuration, after the JSON record (also written to FILE:
the machine, as benchmarks/machine.py records it, and one object per configuration). Without a CUDA
GPU it says so and exits 0, measuring nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from common import check_allocator, log, select_allocator, write_json

HERE = os.path.abspath(__file__)
GiB = 1 << 30
KINDS = ("native", "gpumem")
PAIRS = ("native-native", "gpumem-gpumem", "native-gpumem", "gpumem-native")
SEGMENTS = ("growable", "plain")
MIN_SHARE_S = 30  # a configuration's processes start, make 2 GiB of weights and report in well under this
FINISH_S = 15  # of a share, kept for the figures after the rounds, the check and the exit
OVERRUN_S = 45  # past its share, a configuration's processes are killed (one round at least always runs)
WAIT_S = 120  # the longest one process waits for the other's next message

# TinyLlama-1.1B's widths; 20 layers make 1.01e9 parameters.
VOCAB, WIDTH, MLP, KV_WIDTH = 32000, 2048, 5632, 4 * 64


def weight_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    layer = [("input_layernorm", (WIDTH,)), ("q_proj", (WIDTH, WIDTH)), ("k_proj", (KV_WIDTH, WIDTH)),
             ("v_proj", (KV_WIDTH, WIDTH)), ("o_proj", (WIDTH, WIDTH)), ("post_attention_layernorm", (WIDTH,)),
             ("gate_proj", (MLP, WIDTH)), ("up_proj", (MLP, WIDTH)), ("down_proj", (WIDTH, MLP))]
    shapes = [("embed_tokens", (VOCAB, WIDTH))]
    shapes += [(f"layers.{i}.{name}", shape) for i in range(layers) for name, shape in layer]
    return shapes + [("norm", (WIDTH,)), ("lm_head", (VOCAB, WIDTH))]


def parameter_count(layers: int) -> int:
    count = 0
    for _, shape in weight_shapes(layers):
        n = 1
        for d in shape:
            n *= d
        count += n
    return count


def allocator_name(kind: str, segments: str) -> str:
    """benchmarks/common.py's name for `kind` with `segments`."""
    if kind == "gpumem":
        return "gpumem" if segments == "growable" else "gpumem-plain"
    return "native-expandable" if segments == "growable" else "native"


# ---- one side, in a process of its own -------------------------------------------------------------

class PeerEnded(Exception):
    """The other process ended or failed: its own error is the configuration's."""


def expect(conn) -> dict:
    if not conn.poll(WAIT_S):
        raise TimeoutError(f"no message from the other process in {WAIT_S} s")
    try:
        message = conn.recv()
    except EOFError:
        raise PeerEnded("the other process ended") from None
    if message["op"] == "failed":
        raise PeerEnded("the other process failed")
    return message


def nvml_used(pid: int) -> int | None:
    """What NVML counts for `pid` over every GPU; None without pynvml, or where NVML does not list it
    (a container with its own pid namespace, MIG)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        used = None
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    used = (used or 0) + p.usedGpuMemory
        return used
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def memory_figures() -> dict:
    import torch

    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "nvml_used": nvml_used(os.getpid())}


def checksums(tensors) -> list[int]:
    """Exact sums of the bf16 weights' bits: equal on both sides only if the copies are the weights."""
    import torch

    return [int(t.view(torch.int16).sum(dtype=torch.int64)) for t in tensors]


def sender(conn, layers: int) -> dict:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    # Made in fp32 and cast, as a model initialized and then moved to bf16 is: the fp32 tensors,
    # freed, leave the cache the bf16 ones are cut from.
    weights = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _, shape in weight_shapes(layers)]
    torch.cuda.synchronize()
    conn.send({"op": "ready"})
    share_s = []
    while True:
        message = expect(conn)
        if message["op"] == "send":
            began = time.perf_counter()
            handles = [reduce_tensor(w) for w in weights]
            share_s.append(time.perf_counter() - began)
            conn.send({"op": "weights", "weights": handles})
        elif message["op"] == "figures":
            if message["collect"]:
                torch.cuda.synchronize()
                torch.cuda.ipc_collect()
            conn.send({"op": "figures", "figures": memory_figures()})
        elif message["op"] == "checksums":
            conn.send({"op": "checksums", "sums": checksums(weights)})
        elif message["op"] == "done":
            return {"share_s": share_s}


def receiver(conn, layers: int, rounds: int, deadline: float) -> dict:
    import torch

    own = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _, shape in weight_shapes(layers)]
    expect(conn)  # the sender's weights are made
    timed = []
    held = {}
    for number in range(rounds):
        began = time.perf_counter()
        conn.send({"op": "send"})
        handles = expect(conn)["weights"]
        arrived = time.perf_counter()
        received = [rebuild(*args) for rebuild, args in handles]
        rebuilt = time.perf_counter()
        for mine, theirs in zip(own, received):
            mine.copy_(theirs)
        torch.cuda.synchronize()
        copied = time.perf_counter()
        last = number == rounds - 1 or time.time() + 1.5 * (copied - began) > deadline
        if last:  # the weights of the last round still held, on both sides
            conn.send({"op": "figures", "collect": False})
            held = {"sender": expect(conn)["figures"], "receiver": memory_figures()}
        received = handles = None
        torch.cuda.synchronize()
        timed.append({"round_s": copied - began, "request_to_received_s": arrived - began,
                      "rebuild_s": rebuilt - arrived, "copy_s": copied - rebuilt,
                      "release_s": time.perf_counter() - copied})
        if last:
            break
    conn.send({"op": "figures", "collect": True})
    released = {"sender": expect(conn)["figures"], "receiver": memory_figures()}
    conn.send({"op": "checksums"})
    values_match = expect(conn)["sums"] == checksums(own)
    conn.send({"op": "done"})
    return {"rounds": timed, "memory": {"after_rounds": held, "after_release": released},
            "values_match": values_match}


def last_line(error: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    line = lines[-1] if lines else type(error).__name__
    return line if line.startswith(type(error).__name__) else f"{type(error).__name__}: {line}"


def peer_main(args) -> int:
    """One side: prints one JSON line, {"ok": true, ...} or {"ok": false, "error", "peer_ended"}."""
    from multiprocessing.connection import Connection

    conn = Connection(args.fd)
    try:
        select_allocator(args.allocator)
        check_allocator(args.allocator)
        if args.role == "sender":
            result = sender(conn, args.layers)
        else:
            result = receiver(conn, args.layers, args.rounds, args.deadline)
    except Exception as error:
        traceback.print_exc()
        try:
            conn.send({"op": "failed"})
        except OSError:
            pass
        print(json.dumps({"ok": False, "error": last_line(error), "peer_ended": isinstance(error, PeerEnded)}),
              flush=True)
        return 1
    print(json.dumps({"ok": True, **result}), flush=True)
    return 0


# ---- the driver: a configuration, its record and the table ------------------------------------------

def failure(sides: dict) -> str | None:
    """The configuration's error from what each side ended with ({"exit", "result", "stderr_tail"}), or
    None: a side's own error before one that only saw the other end; a side that printed no result
    (killed, crashed) by its exit status and the last line of its stderr."""
    own, ended = [], []
    for role, side in sides.items():
        result = side["result"]
        if result is None:
            own.append(f"{role}: exit status {side['exit']}: {side['stderr_tail']}")
        elif not result["ok"]:
            (ended if result["peer_ended"] else own).append(f"{role}: {result['error']}")
        elif side["exit"] != 0:
            own.append(f"{role}: exit status {side['exit']} after its result")
    return (own or ended or [None])[0]


def configuration_name(sender_kind: str, receiver_kind: str, segments: str, chunk: str = "") -> str:
    """A configuration as the table names it: the chunk only where a gpumem side has growable memory."""
    name = f"{sender_kind}->{receiver_kind} {segments}"
    if chunk and segments == "growable" and "gpumem" in (sender_kind, receiver_kind):
        name += f", GPUMEM_CHUNK={chunk}"
    return name


def record(sender_kind: str, receiver_kind: str, segments: str, layers: int, rounds: int, sides: dict,
           wall_s: float, chunk: str = "") -> dict:
    """One configuration's JSON object, its figures from its own processes only."""
    out = {"configuration": configuration_name(sender_kind, receiver_kind, segments, chunk), "chunk": chunk or None,
           "sender": sender_kind,
           "receiver": receiver_kind, "segments": segments,
           "sender_allocator": allocator_name(sender_kind, segments),
           "receiver_allocator": allocator_name(receiver_kind, segments),
           "params": parameter_count(layers), "tensors": len(weight_shapes(layers)),
           "bytes": 2 * parameter_count(layers), "rounds_asked": rounds, "wall_s": wall_s}
    error = failure(sides)
    if error is not None:
        return {**out, "status": "failed", "error": error}
    got = sides["receiver"]["result"]
    timed = got["rounds"]
    times = [r["round_s"] for r in timed]
    return {**out, "status": "ok", "error": None, "rounds": len(timed), "round_s": times,
            "round_s_median": statistics.median(times), "round_s_max": max(times),
            "parts_s_median": {part: statistics.median(r[part] for r in timed)
                               for part in ("request_to_received_s", "rebuild_s", "copy_s", "release_s")},
            "share_s_median": statistics.median(sides["sender"]["result"]["share_s"]),
            "values_match": got["values_match"], "memory": got["memory"]}


def skipped(sender_kind: str, receiver_kind: str, segments: str, why: str, chunk: str = "") -> dict:
    return {"configuration": configuration_name(sender_kind, receiver_kind, segments, chunk), "sender": sender_kind,
            "receiver": receiver_kind, "segments": segments, "status": "skipped", "error": why}


def run_configuration(sender_kind: str, receiver_kind: str, segments: str, args, share_s: float,
                      limit_s: float, logs: str) -> dict:
    """Both sides in fresh processes joined by a socket pair; the receiver's rounds end within
    share_s - FINISH_S seconds of now, and both processes are killed at limit_s."""
    deadline = time.time() + share_s - FINISH_S
    began = time.monotonic()
    ends = socket.socketpair()
    try:
        processes = {role: start_side(role, kind, segments, end, args, deadline, logs)
                     for role, kind, end in (("sender", sender_kind, ends[0]), ("receiver", receiver_kind, ends[1]))}
    finally:
        for end in ends:  # each side holds its own: one that ends is seen by the other at once
            end.close()
    timed_out = wait_all(processes, began + limit_s)
    sides = {role: side_outcome(role, process.returncode, logs) for role, process in processes.items()}
    for role in timed_out:
        sides[role] = {"exit": None, "result": None, "stderr_tail": f"still running at its limit of {limit_s:.0f} s"}
    return record(sender_kind, receiver_kind, segments, args.layers, args.rounds, sides, time.monotonic() - began,
                  args.chunk)


def start_side(role: str, kind: str, segments: str, end: socket.socket, args, deadline: float, logs: str):
    """One side's process, its output in files under `logs` (a pipe left unread could stall it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
    if kind == "gpumem" and args.chunk:
        env["GPUMEM_CHUNK"] = args.chunk
    command = [sys.executable, HERE, "--role", role, "--allocator", allocator_name(kind, segments),
               "--fd", str(end.fileno()), "--layers", str(args.layers), "--rounds", str(args.rounds),
               "--deadline", repr(deadline)]
    with open(os.path.join(logs, f"{role}.out"), "w") as out, open(os.path.join(logs, f"{role}.err"), "w") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=env, pass_fds=(end.fileno(),),
                                cwd=os.path.dirname(HERE))


def wait_all(processes: dict, until: float) -> list[str]:
    """Waits for every process until the monotonic time `until`, kills those still running then, and
    returns their roles."""
    timed_out = []
    for role, process in processes.items():
        try:
            process.wait(timeout=max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out.append(role)
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()
    return timed_out


def side_outcome(role: str, status: int, logs: str) -> dict:
    with open(os.path.join(logs, f"{role}.out")) as out, open(os.path.join(logs, f"{role}.err")) as err:
        lines, errors = out.read().strip().splitlines(), err.read().strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if status != 0 and errors:
        log(f"{role} (exit status {status}), the end of its stderr:\n" + "\n".join(errors[-15:]))
    return {"exit": status, "result": result, "stderr_tail": errors[-1] if errors else "no output"}


def gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def memory_cell(rec: dict, side: str) -> str:
    """allocated / reserved (NVML) GiB after the rounds -> after the release."""
    def one(when: str) -> str:
        f = rec["memory"][when].get(side)
        if not f:
            return "-"
        nvml = f" ({gib(f['nvml_used'])})" if f.get("nvml_used") is not None else ""
        return f"{gib(f['allocated'])} / {gib(f['reserved'])}{nvml}"

    return f"{one('after_rounds')} -> {one('after_release')}"


def table(records: list[dict]) -> str:
    head = ["configuration", "status", "rounds", "round median ms", "round max ms", "GB/s (median)",
            "rebuild / copy median ms", "values", "sender GiB alloc / reserved (NVML): held -> released",
            "receiver GiB alloc / reserved (NVML): held -> released"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in records:
        if rec["status"] != "ok":
            cells = [rec["configuration"], f"{rec['status']}: {rec['error']}"] + ["-"] * (len(head) - 2)
        else:
            parts = rec["parts_s_median"]
            cells = [rec["configuration"], "ok", f"{rec['rounds']} of {rec['rounds_asked']}",
                     f"{rec['round_s_median'] * 1e3:.1f}", f"{rec['round_s_max'] * 1e3:.1f}",
                     f"{rec['bytes'] / rec['round_s_median'] / 1e9:.1f}",
                     f"{parts['rebuild_s'] * 1e3:.1f} / {parts['copy_s'] * 1e3:.1f}",
                     "match" if rec["values_match"] else "DIFFER",
                     memory_cell(rec, "sender"), memory_cell(rec, "receiver")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    """benchmarks/machine.py's record, made in a process of its own (CUDA stays out of this one)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "machine.json")
        done = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "machine.py"), path],
                              capture_output=True, text=True, timeout=120, cwd=os.path.dirname(HERE))
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"bench_weight_sync: benchmarks/machine.py failed: {tail}")
        with open(path) as file:
            return json.load(file)


def names(text: str, allowed: tuple[str, ...], option: str, parser) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in chosen if name not in allowed]
    if wrong or not chosen:
        parser.error(f"{option}: a comma-separated list of {', '.join(allowed)}; not {', '.join(wrong) or 'empty'}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"sender-receiver pairs (default {','.join(PAIRS)})")
    parser.add_argument("--segments", default=",".join(SEGMENTS), help="growable, plain or both (default both)")
    parser.add_argument("--chunk", default="", help="GPUMEM_CHUNK for the gpumem sides (default: unset)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per configuration (default 20)")
    parser.add_argument("--layers", type=int, default=20, help="model layers (default 20: 1.01e9 parameters)")
    parser.add_argument("--budget-s", type=float, default=300, help="seconds for the whole run (default 300)")
    parser.add_argument("--out", default="", help="write the JSON record here too")
    parser.add_argument("--role", choices=("sender", "receiver"), help=argparse.SUPPRESS)
    parser.add_argument("--allocator", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.layers < 1:
        parser.error("--rounds and --layers: at least 1")
    if args.role:
        return peer_main(args)
    pairs = [tuple(p.split("-")) for p in names(args.pairs, PAIRS, "--pairs", parser)]
    segments = names(args.segments, SEGMENTS, "--segments", parser)
    if args.chunk:
        from gpumem.settings.chunk import chunk_bytes  # here: a side must choose its allocator before torch loads

        try:
            chunk_bytes(args.chunk)
        except ValueError as error:
            parser.error(f"--chunk: {error}")
    info = machine()
    if info["gpu"] == "no CUDA device":
        print("bench_weight_sync: no CUDA GPU here; nothing measured")
        return 0
    configurations = [(s, r, seg) for seg in segments for s, r in pairs]
    started = time.monotonic()
    records = []
    with tempfile.TemporaryDirectory() as logs:
        for index, (s, r, seg) in enumerate(configurations):
            left = args.budget_s - (time.monotonic() - started)
            share = max(left / (len(configurations) - index), MIN_SHARE_S)
            if left < MIN_SHARE_S:
                records.append(skipped(s, r, seg, f"the time budget is spent ({left:.0f} s left)", args.chunk))
                continue
            log(f"{s} -> {r}, {seg} segments: {args.rounds} rounds within {share:.0f} s")
            records.append(run_configuration(s, r, seg, args, share, min(left, share + OVERRUN_S), logs))
            log(f"  {records[-1]['status']}" + (f": {records[-1]['error']}" if records[-1]["error"] else ""))
    write_json(args.out, {"machine": info, "budget_s": args.budget_s, "chunk": args.chunk or None,
                          "seconds": time.monotonic() - started,
                          "configurations": records})
    print()
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
