"""Several processes on one GPU (issue 29): each case once under gpumem sharing and once natively
(or with today's static split), one process per job, on one GPU (CUDA device 0).

Usage (each case is one call; on an H200 each takes well under 9 minutes):
    python benchmarks/bench_sharing.py hoarding   # A: 100 GiB then freed; B asks for 60 GiB
    python benchmarks/bench_sharing.py floor      # S: 20 GiB floor, uses 2; T grows; S takes 17 more
    python benchmarks/bench_sharing.py swinging   # two jobs swing 90/10 GiB for 20 cycles
    python benchmarks/bench_sharing.py cost       # the request-and-retry wait, the asked one's step time
    python benchmarks/bench_sharing.py at_once    # two full jobs ask each other at the same instant
    python benchmarks/bench_sharing.py handover   # B's 60 % of the device while A caches 60 %, 5 cycles
    python benchmarks/bench_sharing.py all        # the six in turn
Options: --gib-scale F multiplies every size (for a smaller GPU: 0.5 on an 80 GB card).

Every line of results starts with the case and the mode. "caps" lines check that no process ever
reserved above its hard cap and that what the gpumem processes reserved never summed above the
device, from each job's own figures sampled after every step. Without a CUDA device it prints
"skipped: ..." and exits 0. Jobs talk to this driver by JSON lines on their stdin and stdout.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30
HERE = os.path.abspath(__file__)


# ---- a job: one process, commands on stdin ----------------------------------------------------

def job_main() -> None:
    # Started as the docs say: GPUMEM_SHARE, GPUMEM_FLOOR or GPUMEM_LIMIT in the environment install
    # gpumem at torch's import; the job never calls gpumem itself but to read its figures.
    gpumem_on = os.environ.get("BENCH_SHARING_MODE") == "gpumem"
    import torch
    if gpumem_on:
        import gpumem
    fraction = os.environ.get("BENCH_SHARING_FRACTION")
    if fraction:
        torch.cuda.set_per_process_memory_fraction(float(fraction), 0)
    torch.cuda.init()
    tensors: dict[str, torch.Tensor] = {}
    stepper = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict = {"ok": True}
        try:
            if op == "alloc":
                start = time.perf_counter()
                t = torch.empty(int(cmd["gib"] * GiB), dtype=torch.uint8, device="cuda")
                t.fill_(cmd.get("value", 1))
                torch.cuda.synchronize()
                reply["seconds"] = time.perf_counter() - start
                tensors[cmd["name"]] = t
            elif op == "alloc_at":  # at a wall-clock instant the driver gave both jobs
                time.sleep(max(0.0, cmd["at"] - time.time()))
                start = time.perf_counter()
                try:
                    t = torch.empty(int(cmd["bytes"]), dtype=torch.uint8, device="cuda")
                    reply["got"] = True
                except torch.OutOfMemoryError as error:
                    reply["got"], reply["error"] = False, str(error).splitlines()[0][:200]
                reply["seconds"] = time.perf_counter() - start
                t = None
            elif op == "take":  # only the allocation timed: no fill
                torch.cuda.synchronize()
                before = gpumem.device_mem_info(0)[0] if gpumem_on else torch.cuda.mem_get_info(0)[0]
                start = time.perf_counter()
                t = torch.empty(int(cmd["bytes"]), dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                reply["seconds"] = time.perf_counter() - start
                reply["device_free_before"] = before
                tensors[cmd["name"]] = t
            elif op == "empty_cache":
                torch.cuda.synchronize()
                start = time.perf_counter()
                torch.cuda.empty_cache()
                reply["seconds"] = time.perf_counter() - start
            elif op == "free":
                tensors.pop(cmd["name"], None)
            elif op == "check":
                t = tensors[cmd["name"]]
                # Reductions, not a comparison: a bool copy would need memory a full device lacks.
                reply["intact"] = int(t.min()) == cmd["value"] == int(t.max())
            elif op == "steps_start":
                stepper = Stepper(torch, cmd["steps"])
                stepper.start()
            elif op == "steps_join":
                stepper.join()
                reply["times"] = stepper.times
            elif op == "figures":
                pass
            elif op == "quit":
                break
        except torch.OutOfMemoryError as error:
            text = str(error)
            at = text.find("Sharing the GPU")
            reply = {"ok": False, "error": text.splitlines()[0][:400], "sharing_note": text[at:at + 600] if at >= 0 else ""}
        t = None  # the loop's own reference: a tensor lives only in `tensors`, so "free" frees it
        reply.update(figures(torch, gpumem_on))
        print(json.dumps(reply), flush=True)


class Stepper:
    """Steps of a small matmul on a side stream, each timed: the job's own work while it is asked."""

    def __init__(self, torch, steps: int):
        import threading
        self.torch, self.steps, self.times = torch, steps, []
        self.thread = threading.Thread(target=self.run)

    def start(self):
        self.thread.start()

    def join(self):
        self.thread.join()

    def run(self):
        torch = self.torch
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        for _ in range(self.steps):
            start = time.perf_counter()
            b = a @ a
            c = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # an allocation per step, as training has
            del b, c
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - start)


def figures(torch, gpumem_on: bool) -> dict:
    out = {"reserved": torch.cuda.memory_reserved(0), "allocated": torch.cuda.memory_allocated(0)}
    if gpumem_on:
        import gpumem
        out["limit"] = gpumem.get_limit(0)
        out["sharing"] = gpumem.sharing.status(0)
    return out


# ---- the driver ----------------------------------------------------------------------------------

class Job:
    live: list = []  # every job running now, sampled together after each step

    def __init__(self, name: str, mode: str, env: dict):
        full = dict(os.environ, BENCH_SHARING_MODE="gpumem" if mode.startswith("gpumem") else "native",
                    CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"), **env)
        self.name, self.mode = name, mode
        self.proc = subprocess.Popen([sys.executable, "-u", HERE, "--job"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=full)
        Job.live.append(self)

    def ask(self, **cmd) -> dict:
        """One step; then every job's figures, read one after another once the step is done, so that
        their sum is of memory held at once."""
        reply = self._ask(cmd)
        if cmd["op"] not in ("figures", "steps_start"):
            Caps.sample([reply if job is self else job._ask({"op": "figures"}) for job in Job.live])
        return reply

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"job {self.name} ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def quit(self):
        if self in Job.live:
            Job.live.remove(self)
        try:
            self._ask({"op": "quit"})
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        self.proc.wait()


class Caps:
    """The most any job reserved above its hard cap, and the most the gpumem jobs reserved together."""
    over_cap = 0
    most_summed = 0

    @classmethod
    def reset(cls):
        cls.over_cap, cls.most_summed = 0, 0

    @classmethod
    def sample(cls, replies: list[dict]):
        gpumem_jobs = [r for r in replies if "limit" in r]
        for r in gpumem_jobs:
            cls.over_cap = max(cls.over_cap, r["reserved"] - r["limit"])
        cls.most_summed = max(cls.most_summed, sum(r["reserved"] for r in gpumem_jobs))

    @classmethod
    def line(cls, case: str, mode: str, total: int) -> str:
        if not mode.startswith("gpumem"):
            return f"{case} {mode}: caps: not gpumem"
        verdict = "ok" if cls.over_cap <= 0 and cls.most_summed <= total else "BROKEN"
        return (f"{case} {mode}: caps {verdict}: most over any hard cap {max(cls.over_cap, 0)} bytes; "
                f"most reserved by the gpumem jobs together {cls.most_summed / GiB:.2f} GiB of {total / GiB:.2f} GiB")


def run_case(case, mode: str, scale: float, total: int):
    Caps.reset()
    Job.live = []
    jobs = []
    try:
        lines = case(mode, scale, jobs)
    finally:
        for job in jobs:
            job.quit()
    for line in lines:
        print(f"{case.__name__} {mode}: {line}", flush=True)
    print(Caps.line(case.__name__, mode, total), flush=True)


def outcome(reply: dict) -> str:
    if reply["ok"]:
        return f"succeeded in {reply.get('seconds', 0):.3f} s"
    return f"FAILED ({reply['error'][:160]})"


def share_env(mode: str, **extra) -> dict:
    return {"GPUMEM_SHARE": "on", **extra} if mode == "gpumem" else dict(extra)


def hoarding(mode: str, s: float, jobs: list) -> list[str]:
    a = Job("A", mode, share_env(mode))
    jobs.append(a)
    a.ask(op="alloc", name="keep", gib=1 * s, value=7)
    a.ask(op="alloc", name="big", gib=100 * s)
    a.ask(op="free", name="big")
    b = Job("B", mode, share_env(mode))
    jobs.append(b)
    b.ask(op="figures")
    got = b.ask(op="alloc", name="x", gib=60 * s)
    intact = a.ask(op="check", name="keep", value=7)["intact"]
    more = a.ask(op="alloc", name="more", gib=5 * s)
    lines = [f"B's {60 * s:g} GiB while A caches {100 * s:g} GiB: {outcome(got)}",
             f"A's live tensor intact: {intact}; A allocates {5 * s:g} GiB afterwards: {outcome(more)}"]
    if mode == "gpumem":
        st = a.ask(op="figures")["sharing"]
        lines.append(f"A gave back {st['given_back'] / GiB:.2f} GiB on {st['asks_served']} request(s)")
        lines.append("verdict: " + ("PASS" if got["ok"] and got["seconds"] <= 0.5 and intact and more["ok"] else "FAIL")
                     + " (B within 0.5 s, A intact and growing)")
    else:
        lines.append("verdict: " + ("as expected, B fails" if not got["ok"] else "B succeeded natively"))
    return lines


def floor(mode: str, s: float, jobs: list) -> list[str]:
    srv = Job("S", mode, share_env(mode, GPUMEM_FLOOR=f"{int(20 * s * 1024)}MiB"))
    jobs.append(srv)
    srv.ask(op="alloc", name="base", gib=2 * s, value=3)
    t = Job("T", mode, share_env(mode))
    jobs.append(t)
    grown, last = 0, None
    while True:
        last = t.ask(op="alloc", name=f"t{grown}", gib=1 * s)
        if not last["ok"]:
            break
        grown += 1
    got = srv.ask(op="alloc", name="more", gib=17 * s)
    intact = srv.ask(op="check", name="base", value=3)["intact"]
    lines = [f"T grew {grown * s:g} GiB, then was refused: {last['error'][:160]}",
             f"T's message on sharing: {last.get('sharing_note') or '(none)'}",
             f"S allocates {17 * s:g} GiB more ({19 * s:g} GiB in all, under its floor): {outcome(got)}; "
             f"its tensor intact: {intact}"]
    if mode == "gpumem":
        lines.append("verdict: " + ("PASS" if got["ok"] and intact else "FAIL") + " (T stopped short of S's floor)")
    else:
        lines.append("verdict: " + ("as expected, S fails" if not got["ok"] else "S succeeded natively"))
    return lines


def swinging(mode: str, s: float, jobs: list) -> list[str]:
    env = {"gpumem": share_env("gpumem"), "gpumem-static": {"GPUMEM_LIMIT": f"{int(70 * s * 1024)}MiB"},
           "native": {}, "native-fraction": {"BENCH_SHARING_FRACTION": "0.5"}}[mode]
    x, y = Job("X", mode, env), Job("Y", mode, env)
    jobs += [x, y]
    for job in (x, y):
        job.ask(op="alloc", name="base", gib=10 * s)
    ooms, waits = 0, []
    for cycle in range(20):
        up, down = (x, y) if cycle % 2 == 0 else (y, x)
        down.ask(op="free", name="peak")
        got = up.ask(op="alloc", name="peak", gib=80 * s)
        if got["ok"]:
            waits.append(got["seconds"])
        else:
            ooms += 1
    lines = [f"{20 - ooms} of 20 cycles reached {90 * s:g} GiB, {ooms} out-of-memory"]
    if waits:
        lines.append(f"peak allocation: median {statistics.median(waits):.3f} s, max {max(waits):.3f} s")
    expected = "no OOM" if mode == "gpumem" else "OOMs"
    lines.append(f"verdict: expected {expected}: " + ("PASS" if (ooms == 0) == (mode == "gpumem") else "FAIL"))
    return lines


STEPS = 1000  # about a second of A's steps: B's request lands among them


def cost(mode: str, s: float, jobs: list) -> list[str]:
    if mode != "gpumem":
        return ["(the cost row is gpumem's only)"]
    # B's wait: a request the device refuses until A gives back, against the same request on room.
    a, b = Job("A", mode, share_env(mode)), Job("B", mode, share_env(mode))
    jobs += [a, b]
    on_room = b.ask(op="alloc", name="x", gib=60 * s)
    b.ask(op="free", name="x")
    b.quit()
    jobs.remove(b)
    b = Job("B", mode, share_env(mode))
    jobs.append(b)
    b.ask(op="figures")
    waits, asked = [], []
    a.ask(op="steps_start", steps=STEPS)
    quiet = a.ask(op="steps_join")["times"]
    for _ in range(5):
        a.ask(op="alloc", name="big", gib=100 * s)
        a.ask(op="free", name="big")
        a.ask(op="steps_start", steps=STEPS)
        got = b.ask(op="alloc", name="x", gib=60 * s)
        asked += a.ask(op="steps_join")["times"]
        if got["ok"]:
            waits.append(got["seconds"])
        b.quit()  # so that A's next 100 GiB fits
        jobs.remove(b)
        b = Job("B", mode, share_env(mode))
        jobs.append(b)
        b.ask(op="figures")
    ms = lambda times, pick: pick(times) * 1e3  # noqa: E731
    lines = [f"B's {60 * s:g} GiB with room on the device: {outcome(on_room)}"]
    if waits:
        lines.append(f"B's {60 * s:g} GiB by request-and-retry (A caches {100 * s:g} GiB): median "
                     f"{statistics.median(waits):.3f} s, max {max(waits):.3f} s over {len(waits)} runs")
    lines.append(f"A's step time unasked: median {ms(quiet, statistics.median):.2f} ms, slowest {ms(quiet, max):.2f} ms; "
                 f"while asked: median {ms(asked, statistics.median):.2f} ms, slowest {ms(asked, max):.2f} ms")
    return lines


def at_once(mode: str, s: float, jobs: list) -> list[str]:
    """Two jobs on a full device ask each other for memory at the same instant: each request must end
    with the memory or an out-of-memory error, neither waiting out the ask's bound for the other.
    Twice: B caching 5 % of the device (given back on the way: the release is in the times), and
    caching nothing (the asking and answering alone)."""
    return at_once_with(mode, jobs, 0.05) + at_once_with(mode, jobs, 0.0)


def at_once_with(mode: str, jobs: list, cache_share: float) -> list[str]:
    a, b = Job("A", mode, share_env(mode)), Job("B", mode, share_env(mode))
    jobs += [a, b]
    gib = lambda share: share * TOTAL / GiB  # noqa: E731 - sizes from the device's memory
    a.ask(op="alloc", name="live", gib=gib(0.6))
    b.ask(op="alloc", name="live", gib=gib(0.3))
    times = {"A": [], "B": []}
    results = {"A": [], "B": []}
    for _ in range(8):
        if cache_share:
            b.ask(op="alloc", name="cache", gib=gib(cache_share))
            b.ask(op="free", name="cache")  # B caches it: the device is about full
        at = time.time() + 0.2
        cmd = json.dumps({"op": "alloc_at", "at": at, "bytes": int(0.15 * TOTAL)}) + "\n"
        for job in (a, b):
            job.proc.stdin.write(cmd)
            job.proc.stdin.flush()
        for job in (a, b):
            reply = json.loads(job.proc.stdout.readline())
            times[job.name].append(reply["seconds"])
            results[job.name].append("memory" if reply["got"] else "out of memory")
    lines = []
    for name, job in (("A", a), ("B", b)):
        st = job._ask({"op": "figures"}).get("sharing") or {}
        lines.append(f"{name}: 15 % of the device at the same instant as the other, B caching "
                     f"{cache_share:.0%}, 8 rounds: median "
                     f"{statistics.median(times[name]) * 1e3:.1f} ms, max {max(times[name]) * 1e3:.1f} ms; "
                     f"{results[name].count('memory')} got memory, {results[name].count('out of memory')} out of memory; "
                     f"asks made {st.get('asks_made')}, answered {st.get('asks_served')}, timed out {st.get('asks_timed_out')}")
    worst = max(max(times["A"]), max(times["B"]))
    lines.append("verdict: " + ("PASS" if worst <= 0.1 else "FAIL") + f" (both end within 100 ms: slowest {worst * 1e3:.1f} ms)")
    for job in (a, b):
        job.quit()
        jobs.remove(job)
    return lines


def handover(mode: str, s: float, jobs: list) -> list[str]:
    """B asks for 60 % of the device while A caches 60 % (freed, kept): the device lacks part of it,
    which A gives back while B maps (docs/design.md, "Handing memory over"). Three figures, each a
    median of 5: B's request by asking, the same request of B on a free device, and A's release
    alone of what it gave back (A's own empty_cache of that many bytes, nobody asking); and, to
    tell the driver's part, B's request on memory A gave back just before, nobody asking."""
    if mode != "gpumem":
        return ["(the handover row is gpumem's only)"]
    need = int(0.6 * TOTAL * s)
    a, b = Job("A", mode, share_env(mode)), Job("B", mode, share_env(mode))
    jobs += [a, b]
    a.ask(op="figures")

    def b_free_device() -> float:
        got = b.ask(op="take", name="x", bytes=need)
        b.ask(op="free", name="x")
        b.ask(op="empty_cache")
        return got["seconds"] if got["ok"] else float("nan")

    b_free_device()  # B's first growth reserves its address range: not what is compared
    free_device = [b_free_device() for _ in range(5)]
    after_a = []  # the same request on memory A gave back just before (nobody asked)
    for _ in range(5):
        a.ask(op="take", name="big", bytes=need)
        a.ask(op="free", name="big")
        a.ask(op="empty_cache")
        after_a.append(b_free_device())
    by_request, given, lacked = [], [], []
    for _ in range(5):
        a.ask(op="take", name="big", bytes=need)
        a.ask(op="free", name="big")
        before = a.ask(op="figures")["sharing"]["given_back"]
        got = b.ask(op="take", name="x", bytes=need)
        after = a.ask(op="figures")["sharing"]["given_back"]
        if not got["ok"]:
            return [f"B's request FAILED: {got['error'][:200]}", "verdict: FAIL"]
        by_request.append(got["seconds"])
        given.append(after - before)
        lacked.append(max(0, got["reserved"] - got["device_free_before"]))
        b.ask(op="free", name="x")
        b.ask(op="empty_cache")
        a.ask(op="empty_cache")
    release = []
    for bytes_given in given:  # A's release of the same bytes, alone
        a.ask(op="take", name="big", bytes=bytes_given)
        a.ask(op="free", name="big")
        release.append(a.ask(op="empty_cache")["seconds"])
        a.ask(op="figures")
    med = statistics.median
    target = max(1.25 * med(free_device), med(release) + 0.050)
    over = max(g - l for g, l in zip(given, lacked))
    lines = [f"B's {need / GiB:.1f} GiB ({need / TOTAL:.0%} of the device), A caching as much: by request median "
             f"{med(by_request):.3f} s (max {max(by_request):.3f}); on a free device {med(free_device):.3f} s "
             f"(max {max(free_device):.3f}); A's release alone of what it gave back {med(release):.3f} s "
             f"(max {max(release):.3f}); 5 runs each",
             f"B's same request on memory A had just given back, nobody asked: median {med(after_a):.3f} s "
             f"(max {max(after_a):.3f})",
             f"A gave back median {med(given) / GiB:.2f} GiB where the device lacked {med(lacked) / GiB:.2f} GiB for B; "
             f"most given beyond the lack {over / 2**20:.0f} MiB",
             "verdict: " + ("PASS" if med(by_request) <= target and over <= 256 << 20 else "FAIL")
             + f" (by request within max(1.25 x free device, release + 50 ms) = {target:.3f} s, "
               "and no more than a 256 MiB chunk beyond the lack)"]
    return lines


TOTAL = 0  # the device's memory in bytes, set by main


CASES = {"hoarding": (hoarding, ("gpumem", "native")), "floor": (floor, ("gpumem", "native")),
         "swinging": (swinging, ("gpumem", "gpumem-static", "native-fraction", "native")),
         "cost": (cost, ("gpumem",)), "at_once": (at_once, ("gpumem",)), "handover": (handover, ("gpumem",))}


PROBE = ("import torch\n"
         "if torch.cuda.is_available():\n"
         "    p = torch.cuda.get_device_properties(0); print(p.total_memory, p.name)\n")


def main(argv: list[str]) -> int:
    if "--job" in argv:
        job_main()
        return 0
    scale = 1.0
    if "--gib-scale" in argv:
        scale = float(argv[argv.index("--gib-scale") + 1])
    names = [a for a in argv if a in CASES or a == "all"]
    if not names:
        print(__doc__)
        return 2
    # Asked in a process of its own: a CUDA context here would be memory no job can use.
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip():
        print("skipped: torch cannot be imported" if probe.returncode else "skipped: no CUDA device")
        return 0
    total_text, name = probe.stdout.strip().split(" ", 1)
    total = int(total_text)
    global TOTAL
    TOTAL = total
    print(f"device 0: {name}, {total / GiB:.1f} GiB; sizes x{scale:g}", flush=True)
    for name in (list(CASES) if "all" in names else names):
        case, modes = CASES[name]
        for mode in modes:
            run_case(case, mode, scale, total)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
