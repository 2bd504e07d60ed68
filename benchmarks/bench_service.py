#!/usr/bin/env python3
"""An inference service beside a training job on one GPU (CUDA device 0), three ways:

    native   both plain PyTorch, no gpumem variable set
    split    a static split by caps: `gpumem run --limit CAP -- ... --role service` and
             `gpumem run --limit TOTAL-CAP-1.5GiB -- ... --role train` (1.5 GiB: the two CUDA contexts)
    sharing  `gpumem run --floor FLOOR -- ... --role service` and `gpumem run --share -- ... --role train`

Usage (one call of a GPU machine: about 2 minutes a configuration at the default 90 s):
    python3 benchmarks/bench_service.py [--seconds 90] [--configs native,split,sharing]
        [--floor-share 0.10] [--peak-share 0.25] [--seed 0] [--out DIR] [--png PATH]

Each configuration is two processes of this script, started by this driver the way users start
jobs (the `gpumem run` lines above, nothing in the environment for native). Both start together;
the service builds its model and reports ready, and the driver then gives both the same clock:
the service serves from then on, the trainer starts TRAINER_DELAY_S later, and both stop --seconds
after the service started. Every size comes from the device's total memory
(torch.cuda.mem_get_info() in a process of its own, so that this driver holds no CUDA context):
FLOOR = --floor-share of it, what the service usually needs; its largest request needs up to
--peak-share of it. A static split must give the service what its largest request needs, so CAP is
SPLIT_MARGIN (1.25) times that request's estimated peak; under sharing the service has the smaller
floor, and borrows above it from the trainer's cache (sizes()).

The service: a Llama-shaped causal LM of transformers, built from a config in bf16 (width 2048,
MLP 5632, 16 heads with a key/value head each, vocabulary 32000), its depth chosen so that its
weights are WEIGHT_SHARE (2 %) of the device (13 layers, 1.6 GB, on an 80 GB H100). It serves a
seeded stream of requests back to back: batch uniform in 1..B, prompt length uniform in
32..2048, new tokens uniform in 8..48, random token ids, greedy `model.generate` with its KV
cache. B (at most 32) is the largest batch whose largest request's estimated peak (weights,
the KV cache of prompt and new tokens, one layer's prefill activations: estimated_peak) fits
--peak-share of the device (on an 80 GB H100: 32, 12.6 GiB, against a floor of 7.9 GiB). A request that raises
torch.OutOfMemoryError is counted failed and the stream goes on. Under gpumem sharing, a request
"waited on an ask" when the service's `asks_made` (gpumem.sharing.status) rose during it: the
device refused it until the neighbour gave back cache.

The trainer: a 134M-parameter Llama-shaped causal LM of transformers (12 layers, width 768, fp32
weights, bf16 autocast, AdamW, sequences of 1024 random tokens). A transformers model rather than
a stack of Linear layers because its step has the memory of real LM training: logits over a
32000-word vocabulary per token, activations kept for the backward pass and freed during it,
AdamW's state appearing at the first step; the cache it holds between steps is what the service
may ask for. Its batch (BatchSchedule) starts at 2 and grows by 25 % every 4 steps that worked;
a step that raises torch.OutOfMemoryError is counted, the batch goes back to the last one that
worked (one 25 % rung down where that one failed now), holds there HOLD_S (20 s), then grows again.

Both processes sample torch.cuda.memory_reserved() every 50 ms and write their records as JSON;
each trainer step's record holds, from torch.cuda.memory_stats() after it, the bytes mapped so far
("mapped": reserved_bytes.all.allocated) and num_alloc_retries ("retries"), so that a step's
differences say how much it mapped and how often it released cache to fit.
During `sharing` the driver runs `python3 -m gpumem top` mid-run and near the end and saves what
it prints to DIR/sharing-top-mid.txt and DIR/sharing-top-end.txt.

Output: the command, the device and sizes, then a Markdown table, one row per configuration,
computed from that configuration's own records only (summarize_configuration): requests served and
failed, p50 and p99 latency of the served ones, requests that waited on an ask and their extra
latency, the trainer's samples/s (samples of the steps that worked over its first step's start to
its last step's end), final and largest batch, and the peak reserved of both. Extra latency of a
served request that waited: its latency less the median per-new-token latency of the served
requests that did not wait in its bucket, times its new tokens (decode steps dominate a request's
time, and new tokens vary 8-fold within a bucket); buckets are thirds of the batch range 1..B by
thirds of the prompt range 32..2048 (bucket: 1-11, 12-22, 23-32 by 32-704, 705-1376, 1377-2048 where
B is 32), nine in all, coarse enough that a minute and a half of requests (some tens) leaves most of
them a few requests that did not wait. DIR/summary.json holds the summary and every record;
the PNG (--png, default DIR/bench_service.png) has one panel per configuration with both
processes' reserved memory over time, the floor (sharing) and the caps (split).

Without a CUDA device it prints "skipped: no CUDA device" and exits 0. Every process has a
deadline; one that crashes or overruns is killed and reported with the end of its stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import log

HERE = os.path.abspath(__file__)
GiB = 1 << 30
MiB = 1 << 20
CONFIGURATIONS = ("native", "split", "sharing")
ROLES = ("service", "train")

# ---- sizes ----------------------------------------------------------------------------------------
CONTEXTS = 3 * GiB // 2  # two CUDA contexts and their libraries' workspaces, left out of the split
SPLIT_MARGIN = 1.25  # the split's service cap over the largest request's estimated peak: the estimate's error
WEIGHT_SHARE = 0.02  # of the device: the service's weights
VOCAB, WIDTH, MLP, HEADS = 32000, 2048, 5632, 16  # the service's model (MHA: a key/value head per head)
PROMPT = (32, 2048)
NEW_TOKENS = (8, 48)
MOST_BATCH = 32
FIXED = 512 * MiB  # the service's own besides weights and cache: cuBLAS workspace, logits, generate's tensors
KV_SLACK = 1.1  # the cache is regrown by torch.cat every token: one layer's old copy lives beside the new
TRAIN_LAYERS, TRAIN_WIDTH, TRAIN_MLP, TRAIN_HEADS, TRAIN_LENGTH = 12, 768, 2048, 12, 1024

# ---- timing ---------------------------------------------------------------------------------------
SAMPLE_S = 0.05
TRAINER_DELAY_S = 5.0
READY_TIMEOUT_S = 300  # imports, the model built, one warm-up request: well under a minute on an H100
STOP_GRACE_S = 90  # past the end: a request or step in flight ends, records are written, processes exit
TOP_TIMEOUT_S = 30
PROBE_TIMEOUT_S = 120
STDERR_TAIL = 40  # lines of a child's stderr kept in the summary


# ==== sizes from the device's memory (pure) ==========================================================

def layer_parameters() -> int:
    return 4 * WIDTH * WIDTH + 3 * WIDTH * MLP + 2 * WIDTH  # q k v o, gate up down, two norms


def service_weights(layers: int) -> int:
    """Bytes of the service's bf16 weights: the layers, the embedding and the untied output head."""
    return 2 * (layers * layer_parameters() + 2 * VOCAB * WIDTH + WIDTH)


def service_layers(total: int) -> int:
    """The depth whose weights are WEIGHT_SHARE of the device: the model grows with the device."""
    per_layer = 2 * layer_parameters()
    return max(2, int((WEIGHT_SHARE * total - service_weights(0)) // per_layer))


def estimated_peak(layers: int, batch: int, prompt: int, new_tokens: int) -> int:
    """What a request needs at its peak, weights included: the larger of the decode's end (the cache
    of every token, with KV_SLACK for the copy torch.cat makes) and the prefill's (the prompt's cache
    and one layer's activations: hidden states, q/k/v, attention out, the MLP's three tensors)."""
    kv_per_token = 2 * 2 * layers * WIDTH  # K and V, bf16, every layer
    prefill_per_token = 2 * (8 * WIDTH + 3 * MLP)
    per_sequence = max(KV_SLACK * (prompt + new_tokens) * kv_per_token,
                       prompt * (kv_per_token + prefill_per_token))
    return int(service_weights(layers) + FIXED + batch * per_sequence)


def sizes(total: int, floor_share: float, peak_share: float) -> dict:
    """Every size of a run from the device's total memory: the service's model, its largest batch (the
    largest whose biggest request's estimated peak fits peak_share of the device, 1 to MOST_BATCH),
    its floor under sharing (floor_share: what it usually needs, below that peak), and the split's
    caps: a static split must give the service what its largest request needs (SPLIT_MARGIN over the
    estimate) and the trainer the rest less the contexts."""
    floor = int(floor_share * total) // MiB * MiB
    layers = service_layers(total)
    one = estimated_peak(layers, 1, PROMPT[1], NEW_TOKENS[1]) - service_weights(layers) - FIXED
    room = int(peak_share * total) - service_weights(layers) - FIXED
    most_batch = max(1, min(MOST_BATCH, room // one))
    peak = estimated_peak(layers, most_batch, PROMPT[1], NEW_TOKENS[1])
    service_cap = -(-int(SPLIT_MARGIN * peak) // MiB) * MiB
    return {"total": total, "floor": floor, "service_cap": service_cap, "trainer_cap": total - service_cap - CONTEXTS,
            "layers": layers, "weights": service_weights(layers), "most_batch": most_batch,
            "largest_request_peak": peak}


def role_command(configuration: str, role: str, size: dict, script_args: list[str]) -> list[str]:
    """How the driver starts one process of a configuration: as a user would."""
    script = [sys.executable, HERE, "--role", role, *script_args]
    if configuration == "native":
        return script
    if configuration == "split":
        cap = size["service_cap"] if role == "service" else size["trainer_cap"]
        flags = ["--limit", str(cap)]
    else:
        flags = ["--floor", str(size["floor"])] if role == "service" else ["--share"]
    return [sys.executable, "-m", "gpumem", "run", *flags, "--", *script]


# ==== the summary (pure: plain lists and dicts from the records) ====================================

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bucket(value: int, low: int, high: int, parts: int = 3) -> int:
    """Which of `parts` equal slices of low..high (both included) `value` falls in."""
    return min(parts - 1, max(0, (value - low) * parts // (high - low + 1)))


def waited(request: dict) -> bool:
    """The service asked its neighbours for memory during the request (its asks_made rose)."""
    return request["asks_after"] > request["asks_before"]


def request_bucket(request: dict, ranges: dict) -> tuple[int, int]:
    return (bucket(request["batch"], *ranges["batch"]), bucket(request["prompt"], *ranges["prompt"]))


def extra_latencies(requests: list[dict], ranges: dict) -> dict:
    """Per served request that waited: its latency less the median per-new-token latency of the served
    requests of its bucket that did not wait, times its new tokens. Those whose bucket has no such
    request have no reference: counted, not guessed."""
    per_token: dict[tuple[int, int], list[float]] = {}
    for r in requests:
        if r["ok"] and not waited(r):
            per_token.setdefault(request_bucket(r, ranges), []).append(r["latency_s"] / r["new_tokens"])
    extra, without = [], 0
    for r in requests:
        if not (r["ok"] and waited(r)):
            continue
        reference = per_token.get(request_bucket(r, ranges))
        if not reference:
            without += 1
            continue
        extra.append(r["latency_s"] - statistics.median(reference) * r["new_tokens"])
    return {"extra_s": extra, "without_reference": without}


def throughput(steps: list[dict]) -> float | None:
    """Samples per second of the steps that worked, over the time from the first step's start to the
    last step's end: steps that ran out of memory cost time and count no sample."""
    if not steps:
        return None
    span = max(s["t1"] for s in steps) - min(s["t0"] for s in steps)
    done = sum(s["batch"] for s in steps if s["ok"])
    return done / span if span > 0 else None


def summarize_service(record: dict) -> dict:
    requests = record["requests"]
    served = [r for r in requests if r["ok"]]
    latencies_ms = [r["latency_s"] * 1e3 for r in served]
    extra = extra_latencies(requests, record["ranges"])
    extra_ms = [e * 1e3 for e in extra["extra_s"]]
    return {"served": len(served), "failed": len(requests) - len(served),
            "p50_ms": percentile(latencies_ms, 50), "p99_ms": percentile(latencies_ms, 99),
            "waited": sum(waited(r) for r in requests),
            "waited_failed": sum(waited(r) and not r["ok"] for r in requests),
            "extra_ms_median": statistics.median(extra_ms) if extra_ms else None,
            "extra_ms_max": max(extra_ms) if extra_ms else None,
            "extra_without_reference": extra["without_reference"],
            "peak_reserved": record["peak_reserved"], "peak_allocated": record["peak_allocated"],
            "sharing": sharing_figures(record.get("sharing"))}


def summarize_trainer(record: dict) -> dict:
    steps = record["steps"]
    worked = [s for s in steps if s["ok"]]
    return {"steps": len(steps), "oom_steps": len(steps) - len(worked), "samples_per_s": throughput(steps),
            "final_batch": worked[-1]["batch"] if worked else None,
            "largest_batch": max(s["batch"] for s in worked) if worked else None,
            "peak_reserved": record["peak_reserved"], "batch_changes": batch_changes(steps, record["go"]),
            "sharing": sharing_figures(record.get("sharing"))}


def batch_changes(steps: list[dict], go: dict) -> list[list[float]]:
    """[seconds after the service started, batch] at each step whose batch differs from the last's."""
    changes, last = [], None
    for s in steps:
        if s["batch"] != last:
            changes.append([round(s["t0"] - go["service_start"], 3), s["batch"]])
            last = s["batch"]
    return changes


def sharing_figures(status: dict | None) -> dict | None:
    keys = ("floor", "asks_made", "asks_served", "given_back", "asks_timed_out", "floor_short")
    return None if status is None else {k: status.get(k) for k in keys}


def summarize_configuration(name: str, sides: dict) -> dict:
    """One configuration's row from its own processes only: `sides` maps each role to {"exit",
    "record" (None where none was written), "stderr_tail"}."""
    problem = failure(sides)
    service, trainer = sides["service"]["record"], sides["train"]["record"]
    return {"configuration": name, "status": "ok" if problem is None else "failed", "error": problem,
            "service": summarize_service(service) if service else None,
            "trainer": summarize_trainer(trainer) if trainer else None}


def failure(sides: dict) -> str | None:
    """Why the configuration failed, or None: a side's own error (its record's, or an exit status of
    its own) before a side that was only killed (a negative status: the driver's kill, as the other
    side's failure or the deadline made it) or left no record."""
    own, killed = [], []
    for role, side in sides.items():
        record, status = side["record"], side["exit"]
        if record is not None and not record.get("error") and status == 0:
            continue
        tail = side["stderr_tail"][-1] if side["stderr_tail"] else "no output"
        why = (record or {}).get("error") or f"exit status {status}: {tail}"
        (killed if status is None or status < 0 else own).append(f"{role}: {why}")
    return (own or killed or [None])[0]


def cell(value, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def count_cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def extra_cell(service: dict) -> str:
    if service["extra_ms_median"] is None:
        text = "-"
    else:
        text = f"{service['extra_ms_median']:.0f} / {service['extra_ms_max']:.0f}"
    if service["extra_without_reference"]:
        text += f" ({service['extra_without_reference']} without a reference)"
    return text


TABLE_HEAD = ["configuration", "status", "requests served", "failed", "p50 ms", "p99 ms", "waited on an ask",
              "extra ms median / max", "trainer samples/s", "final batch", "largest batch",
              "trainer peak reserved GiB", "service peak reserved GiB"]


def table_row(row: dict) -> list[str]:
    status = "ok" if row["status"] == "ok" else f"failed: {row['error']}"
    s, t = row["service"], row["trainer"]
    cells = [row["configuration"], status]
    if s:
        cells += [str(s["served"]), str(s["failed"]), cell(s["p50_ms"]), cell(s["p99_ms"]), str(s["waited"]),
                  extra_cell(s)]
    else:
        cells += ["-"] * 6
    if t:
        cells += [cell(t["samples_per_s"], ".1f"), count_cell(t["final_batch"]), count_cell(t["largest_batch"]),
                  cell(t["peak_reserved"], ".2f", GiB)]
    else:
        cells += ["-"] * 4
    cells.append(cell(s["peak_reserved"], ".2f", GiB) if s else "-")
    return cells


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in table_row(row)) + " |")
    return "\n".join(lines)


# ==== the trainer's batch (pure) =====================================================================

class BatchSchedule:
    """The trainer's batch: grows by `growth` after every `every` steps that worked; a step out of
    memory sends it back to the last batch that worked, or a rung down (batch / growth) where that
    batch is the one that failed now (a neighbour took the memory); after an out-of-memory step it
    holds for `hold_s` seconds, then grows again, so that it takes back memory the service let go."""

    def __init__(self, start: int = 2, growth: float = 1.25, every: int = 4, hold_s: float = 20.0):
        self.batch, self.growth, self.every, self.hold_s = start, growth, every, hold_s
        self.last_worked: int | None = None
        self.streak = 0
        self.hold_until = -math.inf

    def step_done(self, ok: bool, now: float) -> int:
        """The batch of the next step, after a step at self.batch that worked or ran out of memory."""
        if not ok:
            self.streak = 0
            self.hold_until = now + self.hold_s
            below = self.last_worked is not None and self.last_worked < self.batch
            self.batch = self.last_worked if below else max(1, math.floor(self.batch / self.growth))
            return self.batch
        self.last_worked = self.batch
        self.streak += 1
        if self.streak >= self.every and now >= self.hold_until:
            self.batch, self.streak = max(self.batch + 1, math.ceil(self.batch * self.growth)), 0
        return self.batch


# ==== in a child process =============================================================================

class Sampler:
    """torch.cuda.memory_reserved() every SAMPLE_S seconds in a thread, with wall-clock times."""

    def __init__(self, torch):
        self.torch, self.samples = torch, []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_event.is_set():
            self.samples.append([round(time.time(), 3), self.torch.cuda.memory_reserved(0)])
            self.stop_event.wait(SAMPLE_S)

    def stop(self) -> list:
        self.stop_event.set()
        self.thread.join()
        return self.samples


def sharing_status() -> dict | None:
    """gpumem.sharing.status(0) where GPUMEM_SHARE or GPUMEM_FLOOR made the process share, else None:
    native and split runs import nothing of gpumem's sharing."""
    if os.environ.get("GPUMEM_SHARE") != "on" and not os.environ.get("GPUMEM_FLOOR"):
        return None
    import gpumem.sharing
    return gpumem.sharing.status(0)


def asks_made() -> int:
    status = sharing_status()
    return status["asks_made"] if status else 0


def gpumem_figures() -> dict:
    """The process's cap (where GPUMEM_LIMIT set one) and sharing figures, for its record."""
    limit = None
    if os.environ.get("GPUMEM_LIMIT"):
        import gpumem
        limit = gpumem.get_limit(0)
    return {"limit": limit, "sharing": sharing_status()}


def wait_for_go(signal_dir: str) -> dict:
    """The driver's clock for both processes, from DIR/go.json; bounded, so an orphan ends itself."""
    path = os.path.join(signal_dir, "go.json")
    deadline = time.time() + READY_TIMEOUT_S + 60
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"no go from the driver in {READY_TIMEOUT_S + 60} s")
        time.sleep(0.05)
    with open(path) as file:
        return json.load(file)


def say_ready(signal_dir: str, role: str) -> None:
    open(os.path.join(signal_dir, f"{role}.ready"), "w").close()


def build_service_model(torch, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)  # no end token: every request makes its tokens
    with torch.device("cuda"):  # made on the GPU in bf16: no fp32 copy left in the cache
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def serve_one(torch, model, generator, batch: int, prompt: int, new_tokens: int) -> str | None:
    """One request; None when it was served, else the out-of-memory error's first line. Its tensors are
    this function's locals: gone when it returns, so a failed request leaves nothing behind (the
    allocators give back their own free cache before raising, so no empty_cache here)."""
    try:
        ids = torch.randint(0, VOCAB, (batch, prompt), device="cuda", generator=generator)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, use_cache=True)
        torch.cuda.synchronize()
        return None
    except torch.OutOfMemoryError as error:
        return (str(error).splitlines() or ["out of memory"])[0][:300]


def service_loop(torch, model, args, go: dict, requests: list) -> None:
    rng = random.Random(args.seed)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    while time.time() < go["until"]:
        batch, prompt = rng.randint(1, args.most_batch), rng.randint(*PROMPT)
        new_tokens = rng.randint(*NEW_TOKENS)
        before, start = asks_made(), time.time()
        error = serve_one(torch, model, generator, batch, prompt, new_tokens)
        latency = time.time() - start
        requests.append({"start": round(start, 4), "latency_s": latency, "batch": batch, "prompt": prompt,
                         "new_tokens": new_tokens, "ok": error is None, "error": error,
                         "asks_before": before, "asks_after": asks_made()})


def service_main(args) -> dict:
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.cuda.init()
    sampler = Sampler(torch)
    record = {"role": "service", "layers": args.layers, "most_batch": args.most_batch, "seed": args.seed,
              "ranges": {"batch": [1, args.most_batch], "prompt": list(PROMPT), "new_tokens": list(NEW_TOKENS)},
              "requests": [], "go": None, "error": None}
    try:
        model = build_service_model(torch, args.layers)
        serve_one(torch, model, torch.Generator(device="cuda").manual_seed(0), 1, PROMPT[0], 4)  # kernels loaded
        say_ready(args.signal, "service")
        record["go"] = wait_for_go(args.signal)
        service_loop(torch, model, args, record["go"], record["requests"])
    except Exception as error:  # the record so far is kept; the driver reports the error
        record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        raise
    finally:
        finish(torch, sampler, record, args.record)
    return record


def build_trainer(torch):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=TRAIN_WIDTH, intermediate_size=TRAIN_MLP,
                         num_hidden_layers=TRAIN_LAYERS, num_attention_heads=TRAIN_HEADS,
                         num_key_value_heads=TRAIN_HEADS, max_position_embeddings=TRAIN_LENGTH)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def train_step(torch, model, optimizer, batch: int) -> bool:
    """One step at `batch`; False if it ran out of memory. Its tensors are this function's locals,
    freed when it returns, the gradients in every case."""
    try:
        tokens = torch.randint(0, VOCAB, (batch, TRAIN_LENGTH), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)


def trainer_main(args) -> dict:
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.cuda.init()
    sampler = Sampler(torch)
    record = {"role": "train", "steps": [], "go": None, "error": None}
    try:
        model, optimizer = build_trainer(torch)
        say_ready(args.signal, "train")
        record["go"] = go = wait_for_go(args.signal)
        time.sleep(max(0.0, go["trainer_start"] - time.time()))
        schedule = BatchSchedule()
        while time.time() < go["until"]:
            batch, t0 = schedule.batch, time.time()
            ok = train_step(torch, model, optimizer, batch)
            t1 = time.time()
            stats = torch.cuda.memory_stats(0)
            record["steps"].append({"t0": round(t0, 4), "t1": round(t1, 4), "batch": batch, "ok": ok,
                                    "mapped": stats.get("reserved_bytes.all.allocated", 0),
                                    "retries": stats.get("num_alloc_retries", 0)})
            schedule.step_done(ok, t1)
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        raise
    finally:
        finish(torch, sampler, record, args.record)
    return record


def finish(torch, sampler: Sampler, record: dict, path: str) -> None:
    """The process's figures and samples into its record, written at once (the driver reads it)."""
    record["samples"] = sampler.stop()
    record["peak_reserved"] = torch.cuda.max_memory_reserved(0)
    record["peak_allocated"] = torch.cuda.max_memory_allocated(0)
    try:
        record.update(gpumem_figures())
    except Exception as error:  # the record is still written: the configuration fails, naming this
        record["error"] = record["error"] or f"gpumem's figures: {type(error).__name__}: {error}"
    with open(path + ".part", "w") as file:
        json.dump(record, file)
    os.replace(path + ".part", path)


# ==== the driver ===================================================================================

PROBE = ("import json, torch\n"
         "if torch.cuda.is_available():\n"
         "    free, total = torch.cuda.mem_get_info(0)\n"
         "    print(json.dumps({'name': torch.cuda.get_device_name(0), 'free': free, 'total': total}))\n")


def child_env() -> dict:
    """The user's environment less what would put gpumem or another allocator setting in a native
    run; no network for transformers (every model is built from a config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    return env


def probe() -> dict | str:
    """The device's name and memory, asked in a process of its own (a CUDA context here would be memory
    neither job can use); a string saying why not otherwise."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=child_env())
    except subprocess.TimeoutExpired:
        return f"skipped: the CUDA probe did not answer in {PROBE_TIMEOUT_S} s"
    if done.returncode != 0:
        return "skipped: torch cannot be imported: " + (done.stderr.strip().splitlines() or ["no output"])[-1]
    if not done.stdout.strip():
        return "skipped: no CUDA device"
    return json.loads(done.stdout.strip().splitlines()[-1])


class Child:
    """One process of a configuration, its output in files (a pipe left unread could stall it)."""

    def __init__(self, configuration: str, role: str, command: list[str], scratch: str):
        self.role, self.command = role, command
        self.record_path = os.path.join(scratch, f"{configuration}-{role}.json")
        self.log_path = os.path.join(scratch, f"{configuration}-{role}.log")
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env(),
                                         cwd=os.path.dirname(HERE))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def outcome(self) -> dict:
        record = None
        if os.path.exists(self.record_path):
            with open(self.record_path) as file:
                record = json.load(file)
        with open(self.log_path, errors="replace") as file:
            tail = file.read().strip().splitlines()[-STDERR_TAIL:]
        return {"exit": self.proc.returncode, "record": record, "stderr_tail": tail, "command": self.command}


def wait_ready(children: dict, signal_dir: str) -> str | None:
    """Waits until every child said it is ready; why not, where one ended or the wait ran out."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for role, child in children.items():
            if child.proc.poll() is not None:
                return f"{role} ended before it was ready (exit status {child.proc.returncode})"
        if all(os.path.exists(os.path.join(signal_dir, f"{role}.ready")) for role in children):
            return None
        time.sleep(0.1)
    return f"not ready within {READY_TIMEOUT_S} s"


def say_go(signal_dir: str, seconds: float) -> dict:
    now = time.time()
    go = {"service_start": now, "trainer_start": now + TRAINER_DELAY_S, "until": now + seconds}
    path = os.path.join(signal_dir, "go.json")
    with open(path + ".part", "w") as file:
        json.dump(go, file)
    os.replace(path + ".part", path)
    return go


def run_top(out: str, name: str, go: dict) -> str:
    """`gpumem top` once, what it printed saved under `out`; returns the file."""
    command = [sys.executable, "-m", "gpumem", "top"]
    at = time.time() - go["service_start"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOP_TIMEOUT_S, env=child_env())
        text = f"exit status {done.returncode}\n{done.stdout}{done.stderr}"
    except subprocess.TimeoutExpired:
        text = f"no answer in {TOP_TIMEOUT_S} s\n"
    path = os.path.join(out, f"sharing-top-{name}.txt")
    with open(path, "w") as file:
        file.write(f"$ {shlex.join(command)}   # {at:.0f} s after the service started\n{text}")
    return path


def watch(children: dict, go: dict, configuration: str, out: str, seconds: float) -> list[str]:
    """Until both children ended or their grace ran out; `gpumem top` mid-run and near the end in
    `sharing`. Returns the files top's output went to."""
    tops = {"mid": go["service_start"] + seconds / 2, "end": go["until"] - min(5.0, seconds / 4)}
    if configuration != "sharing":
        tops = {}
    saved = []
    stop_at = go["until"] + STOP_GRACE_S
    while time.time() < stop_at and any(c.proc.poll() is None for c in children.values()):
        for name, at in list(tops.items()):
            if time.time() >= at:
                saved.append(run_top(out, name, go))
                del tops[name]
        time.sleep(0.2)
    return saved


def run_configuration(name: str, size: dict, args, scratch: str) -> dict:
    signal_dir = os.path.join(scratch, name)
    os.makedirs(signal_dir)
    script_args = {"service": ["--layers", str(size["layers"]), "--most-batch", str(size["most_batch"]),
                               "--seed", str(args.seed)], "train": []}
    children, tops, problem = {}, [], None
    try:
        for role in ROLES:
            own = ["--signal", signal_dir, "--record", os.path.join(scratch, f"{name}-{role}.json")]
            children[role] = Child(name, role, role_command(name, role, size, script_args[role] + own), scratch)
        problem = wait_ready(children, signal_dir)
        if problem is None:
            go = say_go(signal_dir, args.seconds)
            log(f"{name}: both ready; serving and training for {args.seconds:g} s")
            tops = watch(children, go, name, args.out, args.seconds)
    finally:
        overran = [role for role, c in children.items() if c.proc.poll() is None]
        for child in children.values():
            child.kill()
    sides = {role: child.outcome() for role, child in children.items()}
    for role in overran:
        sides[role]["stderr_tail"].append("killed by the driver: still running at its deadline")
    row = summarize_configuration(name, sides)
    if problem:  # the driver's reason first: the sides' own errors follow it
        row.update(status="failed", error=problem + (f" ({row['error']})" if row["error"] else ""))
    for role, side in sides.items():
        if side["exit"] != 0:
            log(f"{name} {role} (exit status {side['exit']}), the end of its output:\n" + "\n".join(side["stderr_tail"]))
    return {**row, "top": tops, "sides": sides}


def plot(path: str, results: list[dict], size: dict) -> None:
    """One panel per configuration: both processes' reserved memory from their own samples, the
    floor and the caps each process recorded, and the device's memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(13, 3.2 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results):
        records = {role: side["record"] for role, side in result["sides"].items() if side["record"]}
        go = next((r["go"] for r in records.values() if r.get("go")), None)
        zero = go["service_start"] if go else 0.0
        for role, colour in (("service", "tab:blue"), ("train", "tab:orange")):
            record = records.get(role)
            if not record:
                continue
            samples = record["samples"]
            ax.plot([t - zero for t, _ in samples], [b / GiB for _, b in samples], color=colour, label=role)
            if record.get("limit") is not None:
                ax.axhline(record["limit"] / GiB, color=colour, linestyle="--", label=f"{role} cap")
            if record.get("sharing") and record["sharing"].get("floor"):
                ax.axhline(record["sharing"]["floor"] / GiB, color=colour, linestyle=":", label=f"{role} floor")
        mark_requests(ax, records.get("service", {}).get("requests", []), zero, size["total"])
        ax.axhline(size["total"] / GiB, color="grey", linewidth=0.8, label="device")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{result['configuration']} ({result['status']})")
        ax.set_ylabel("reserved, GiB")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: lines fill the panel
    axes[-1, 0].set_xlabel("seconds after the service started serving")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mark_requests(ax, requests: list[dict], zero: float, total: int) -> None:
    """Failed requests at the bottom of a panel, those that waited on an ask at the top."""
    failed = [r["start"] - zero for r in requests if not r["ok"]]
    if failed:
        ax.plot(failed, [0] * len(failed), "rx", label="request failed")
    asked = [r["start"] - zero for r in requests if waited(r)]
    if asked:
        ax.plot(asked, [total / GiB] * len(asked), "v", color="tab:purple", label="request waited on an ask")


def gib_text(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def header(device: dict, size: dict, args) -> list[str]:
    g = gib_text
    return [f"device 0: {device['name']}, {g(device['total'])} ({g(device['free'])} free at the start)",
            f"sharing: service floor {g(size['floor'])} ({args.floor_share:.0%}); split caps: service "
            f"{g(size['service_cap'])} ({SPLIT_MARGIN:g} x its largest request's estimated peak), "
            f"trainer {g(size['trainer_cap'])}",
            f"service: {size['layers']} layers, {g(size['weights'])} of bf16 weights; requests: batch 1..{size['most_batch']}, "
            f"prompt {PROMPT[0]}..{PROMPT[1]}, new tokens {NEW_TOKENS[0]}..{NEW_TOKENS[1]}; the largest's estimated "
            f"peak {g(size['largest_request_peak'])}",
            f"trainer: {TRAIN_LAYERS} layers, width {TRAIN_WIDTH}, sequences of {TRAIN_LENGTH}; "
            f"{args.seconds:g} s per configuration"]


def configurations(text: str, parser) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in chosen if name not in CONFIGURATIONS]
    if wrong or not chosen:
        parser.error(f"--configs: a comma-separated list of {', '.join(CONFIGURATIONS)}; not {', '.join(wrong) or 'empty'}")
    return chosen


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90, help="per configuration (default 90)")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help="default native,split,sharing")
    parser.add_argument("--floor-share", type=float, default=0.10,
                        help="the service's floor under sharing, of the device (default 0.10)")
    parser.add_argument("--peak-share", type=float, default=0.25,
                        help="the most the service's largest request may need, of the device (default 0.25)")
    parser.add_argument("--seed", type=int, default=0, help="the request stream's seed (default 0)")
    parser.add_argument("--out", default="", help="directory for the summary and top's output "
                                                  "(default bench_service-DATE-TIME here)")
    parser.add_argument("--png", default="", help="the figure (default OUT/bench_service.png)")
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--signal", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--most-batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seconds < 10:
        parser.error("--seconds: at least 10")
    if not 0.05 <= args.floor_share <= 0.6:
        parser.error(f"--floor-share: between 0.05 and 0.6 of the device; not {args.floor_share:g}")
    if not 0.05 <= args.peak_share <= 0.6:
        parser.error(f"--peak-share: between 0.05 and 0.6 of the device; not {args.peak_share:g}")
    args.configs = configurations(args.configs, parser)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.role == "service":
        service_main(args)
        return 0
    if args.role == "train":
        trainer_main(args)
        return 0
    print("command: " + shlex.join([sys.executable, *sys.argv]), flush=True)
    device = probe()
    if isinstance(device, str):
        print(device)
        return 0
    size = sizes(device["total"], args.floor_share, args.peak_share)
    if size["trainer_cap"] < GiB:
        print(f"skipped: a {gib_text(size['total'])} device leaves the trainer under 1 GiB beside a "
              f"service cap of {gib_text(size['service_cap'])} and the contexts")
        return 0
    args.out = os.path.abspath(args.out or time.strftime("bench_service-%Y%m%d-%H%M%S"))
    os.makedirs(args.out, exist_ok=True)
    png = args.png or os.path.join(args.out, "bench_service.png")
    for line in header(device, size, args):
        print(line, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.configs:
            log(f"{name}: starting the service and the trainer")
            results.append(run_configuration(name, size, args, scratch))
            log(f"{name}: {results[-1]['status']}" + (f": {results[-1]['error']}" if results[-1]["error"] else ""))
    summary_path = os.path.join(args.out, "summary.json")
    with open(summary_path, "w") as file:
        json.dump({"command": shlex.join([sys.executable, *sys.argv]), "device": device, "sizes": size,
                   "seconds": args.seconds, "seed": args.seed, "configurations": results}, file, indent=1)
    plot(png, results, size)
    print()
    print(table(results))
    print(f"\nsummary and records: {summary_path}\nfigure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
