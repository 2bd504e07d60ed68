"""CUDA tensors passed between processes on a GPU (CUDA IPC), as torch.multiprocessing passes them:
the results of reduce_tensor pickled through a Pipe, and a torch.multiprocessing Queue. Every
direction between a native process and a gpumem process, with growable and plain segments.

Each process is started as users start it (ipc_peer.environment): a gpumem process with GPUMEM_LIMIT
and GPUMEM_SEGMENTS, a native one with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for
"growable" and PyTorch's default for "plain". Each side runs ipc_peer.py; a failure shows what both
printed on stderr. Every exchange ends within TIMEOUT seconds, and together they hold under 3 GiB.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ipc_peer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HELPER = str(Path(__file__).with_name("ipc_peer.py"))
TIMEOUT = 240  # seconds for one exchange: both processes' start, CUDA's, and the work, under any load
KINDS = ("native", "gpumem")
PAIRS = [(sender, receiver, segments) for segments in ("growable", "plain") for sender in KINDS for receiver in KINDS]
PAIR_IDS = [f"{sender}-to-{receiver}-{segments}" for sender, receiver, segments in PAIRS]
NOBODY = ("--reuid", "65534", "--regid", "65534", "--clear-groups")  # setpriv's arguments: user and group nobody


class Peer:
    """A process running one role of ipc_peer.py, its output in files (a pipe left unread could stall it)."""

    def __init__(self, name: str, logs: Path, kind: str, segments: str, *args: str, end: socket.socket | None = None,
                 prefix: tuple[str, ...] = (), env: dict | None = None):
        self.name, self.logs = name, logs
        fds = () if end is None else (end.fileno(),)
        role_args = [*args, *(str(fd) for fd in fds)]
        if prefix:  # another user may not read this tree: the helper's text goes on the command line
            command = [*prefix, sys.executable, "-c", Path(HELPER).read_text(), *role_args]
            cwd = "/"
        else:
            command = [sys.executable, HELPER, *role_args]
            cwd = str(Path(HELPER).parent)
        environ = ipc_peer.environment(kind, segments, os.environ)
        environ.update(env or {})
        with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env=environ, cwd=cwd, pass_fds=fds)

    def stderr(self) -> str:
        return f"--- {self.name} (exit status {self.process.returncode}) stderr:\n" + \
            (self.logs / f"{self.name}.err").read_text()[-6000:]

    def result(self) -> dict | None:
        lines = (self.logs / f"{self.name}.out").read_text().strip().splitlines()
        return json.loads(lines[-1]) if lines else None


def finish(*peers: Peer) -> list[dict]:
    """Each peer's last JSON line, once all have ended (within TIMEOUT together); a peer that
    failed, hung or printed nothing fails the test with every peer's stderr."""
    deadline = time.monotonic() + TIMEOUT
    hung = []
    for peer in peers:
        try:
            peer.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(peer.name)
    for peer in peers:
        if peer.process.poll() is None:
            peer.process.kill()
            peer.process.wait()
    results = [peer.result() for peer in peers]
    if hung or any(p.process.returncode != 0 for p in peers) or None in results:
        why = f"{', '.join(hung)} still running after {TIMEOUT} s" if hung else "a process failed"
        pytest.fail(why + "\n" + "\n".join(peer.stderr() for peer in peers), pytrace=False)
    return results


def exchange(role: str, sender: str, receiver: str, segments: str, logs: Path, prefix: tuple[str, ...] = (),
             receiver_env: dict | None = None, sender_env: dict | None = None) -> dict:
    """ipc_peer.py's `role`-send and `role`-receive in two processes joined by a socket pair."""
    ends = socket.socketpair()
    try:
        peers = (Peer("sender", logs, sender, segments, f"{role}-send", end=ends[0], env=sender_env),
                 Peer("receiver", logs, receiver, segments, f"{role}-receive", end=ends[1], prefix=prefix,
                      env=receiver_env))
    finally:
        for end in ends:  # the children hold their ends: one that ends is seen by the other at once
            end.close()
    sent, received = finish(*peers)
    return {"sender": sent, "receiver": received}


def expected_allocator(kind: str, segments: str) -> dict:
    return {"gpumem": kind == "gpumem", "segments": segments}


# ---- weight sync: reduce_tensor's results through a Pipe ---------------------------------------------

@pytest.fixture(scope="module", params=PAIRS, ids=PAIR_IDS)
def weight_sync(request, tmp_path_factory):
    sender, receiver, segments = request.param
    result = exchange("weights", sender, receiver, segments, tmp_path_factory.mktemp("weights"))
    return {"pair": (sender, receiver, segments), **result}


def rounds(weight_sync: dict) -> list[tuple[dict, dict]]:
    """The sender's and the receiver's figures of each round ("kept", then "dropped")."""
    pairs = list(zip(weight_sync["sender"]["rounds"], weight_sync["receiver"]["rounds"]))
    assert [s["round"] for s, _ in pairs] == [r["round"] for _, r in pairs] == ["kept", "dropped"]
    return pairs


def test_each_process_runs_the_allocator_it_was_started_with(weight_sync):
    sender, receiver, segments = weight_sync["pair"]
    assert weight_sync["sender"]["allocator"] == expected_allocator(sender, segments)
    assert weight_sync["receiver"]["allocator"] == expected_allocator(receiver, segments)


def test_the_receiver_rebuilds_every_tensor_with_the_senders_shape_strides_offset_and_dtype(weight_sync):
    for _, received in rounds(weight_sync):
        assert received["tensors"] >= 30
        assert received["layout_differs"] == []


def test_the_receiver_reads_the_senders_values(weight_sync):
    (_, kept), _ = rounds(weight_sync)
    assert kept["values_differ"] == []


@pytest.mark.parametrize("receiver", KINDS)
def test_a_sender_with_16_mb_chunks_sends_what_every_receiver_reads(receiver, tmp_path):
    result = exchange("weights", "gpumem", receiver, "growable", tmp_path, sender_env={"GPUMEM_CHUNK": "16MB"})
    for _, received in zip(result["sender"]["rounds"], result["receiver"]["rounds"]):
        assert received["values_differ"] == [] and received["layout_differs"] == []


def test_the_receiver_reads_the_senders_values_after_the_sender_dropped_them_and_allocated_over(weight_sync):
    _, (_, dropped) = rounds(weight_sync)
    assert dropped["values_differ"] == []


def test_tensors_the_sender_dropped_stay_allocated_while_the_receiver_holds_them(weight_sync):
    _, (sent, _) = rounds(weight_sync)
    assert sent["allocated_after_drop"] >= sent["sent_bytes"]


# torch keeps a little state of its own after the first send (1,536 bytes natively on an H100 with
# torch 2.11, every pair alike): the first round may leave that much, and the second returns to
# where the first ended.
TORCH_STATE = 4096


def test_the_senders_allocated_memory_returns_once_the_receiver_lets_go_and_ipc_collect_runs(weight_sync):
    if weight_sync["pair"][0] == "native":
        pytest.skip("a native sender's figures are PyTorch's own (on an H100, one native sender to a gpumem "
                    "receiver kept more than the first round's state after the second)")
    (first, _), (second, _) = rounds(weight_sync)
    assert 0 <= first["allocated_after_collect"] <= TORCH_STATE, first
    assert second["allocated_after_collect"] == first["allocated_after_collect"], (first, second)


def test_the_receivers_allocated_memory_returns_to_its_start_when_it_drops_the_tensors(weight_sync):
    for _, received in rounds(weight_sync):
        assert received["allocated_after_drop"] == 0, received


# ---- a torch.multiprocessing Queue, the receiver writing in place -------------------------------------

@pytest.mark.parametrize("sender, receiver, segments", PAIRS, ids=PAIR_IDS)
def test_a_receiver_writing_in_place_through_a_queue_is_seen_by_the_sender(sender, receiver, segments, tmp_path):
    peer = Peer("sender", tmp_path, sender, segments, "queue-send", receiver, segments)
    [result] = finish(peer)
    assert result["allocator"] == expected_allocator(sender, segments)
    got = result["receiver"]
    assert got["error"] is None, f"the receiver failed: {got['error']}\n{peer.stderr()}"
    assert got["allocator"] == expected_allocator(receiver, segments)
    assert got["tensors"] == 6
    assert result["seen"] == dict.fromkeys(result["seen"], True), result["seen"]
    assert result["receiver_exit"] == 0, peer.stderr()


# ---- whose figures hold received memory -------------------------------------------------------------

@pytest.mark.parametrize("segments", ["growable", "plain"])
def test_received_memory_counts_for_the_sender_in_top_and_nowhere_in_the_receiver(segments, tmp_path):
    """docs/usage.md, "Whose memory": the receiver maps the sender's memory; its statistics, its cap
    under a limit on the whole process (GPUMEM_SCOPE=process, which counts what the driver lists for
    it) and its row in `gpumem top` leave it out; the sender's row holds it, in the driver's figure too."""
    run_dir = {"GPUMEM_RUN_DIR": str(tmp_path / "run")}
    result = exchange("figures", "gpumem", "gpumem", segments, tmp_path, sender_env=run_dir,
                      receiver_env={**run_dir, "GPUMEM_SCOPE": "process"})
    got = result["receiver"]
    assert got["values"] and result["sender"]["intact"] and got["scope"] == "process"
    before, after = got["before"], got["after"]
    me, sender = got["receiver"], got["sender"]
    sent = ipc_peer.FIGURES_SENT
    assert got["allocated"] == 0 and after[me]["allocated_bytes"] == before[me]["allocated_bytes"] == 0
    assert after[me]["reserved_bytes"] == before[me]["reserved_bytes"]
    # The driver's figure for the receiver does not take the mapping in, so neither does its counted.
    assert after[me]["used"] - before[me]["used"] < sent // 4, (before, after)
    assert after[me]["counted_bytes"] - before[me]["counted_bytes"] < sent // 4, (before, after)
    assert after[sender]["allocated_bytes"] >= sent and after[sender]["used"] >= sent, after


# ---- a receiver the platform forbids to import: another user, pidfd_getfd refused -------------------

# Growable memory goes as file descriptors the receiver takes with pidfd_getfd, which the kernel
# refuses a process of another user. Native to native is PyTorch's own path and not gpumem's.
REFUSED = [("gpumem", "native"), ("gpumem", "gpumem"), ("native", "gpumem")]


@pytest.fixture(scope="module")
def as_nobody():
    """setpriv's command to run as user 65534, once it is known that user can run this Python with
    torch, gpumem and the GPU."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv, to run the receiver as another user")
    prefix = (setpriv, *NOBODY)
    probe = subprocess.run([*prefix, sys.executable, "-c", "import torch, gpumem; assert torch.cuda.is_available()"],
                           capture_output=True, text=True, timeout=TIMEOUT, cwd="/",
                           env={**ipc_peer.environment("native", "plain", os.environ), "HOME": "/tmp"})
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"user 65534 cannot run {sys.executable} with torch, gpumem and CUDA: {last}")
    return prefix


@pytest.fixture(scope="module", params=REFUSED, ids=[f"{s}-to-{r}-growable" for s, r in REFUSED])
def refused(request, as_nobody, tmp_path_factory):
    sender, receiver = request.param
    logs = tmp_path_factory.mktemp("refused")
    return exchange("refused", sender, receiver, "growable", logs, prefix=as_nobody, receiver_env={"HOME": "/tmp"})


# torch opens the sender's interprocess event before it asks the allocator for the memory, and
# CUDA refuses that event to another user ("mapping of buffer object failed", natively too); where
# the event opens, gpumem's own error names pidfd_getfd.
@pytest.mark.known_limitation
def test_a_receiver_of_another_user_gets_an_exception_naming_the_cause(refused):
    error = refused["receiver"]["error"]
    assert error is not None, "the tensor was imported across users"
    assert re.search(r"pidfd_getfd|permission|not permitted|mapping of buffer object failed", error, re.IGNORECASE), error
    assert refused["receiver"]["works_after"]


@pytest.mark.known_limitation
def test_the_sender_goes_on_working_after_a_receiver_failed_to_import(refused):
    sent = refused["sender"]
    assert sent["heard"] is not None and sent["heard"]["error"] is not None
    assert sent["intact"] and sent["works_after"]
