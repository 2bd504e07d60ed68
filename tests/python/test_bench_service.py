"""benchmarks/bench_service.py without a GPU: its percentiles, buckets, extra latency, throughput and
table from small hand-made records, each configuration's row from its own records only, the
trainer's batch rule, the sizes it takes from the device's memory, how it starts each process, and
that without a CUDA device it says so and exits 0."""
import os
import subprocess
import sys

import pytest

from conftest import BENCHMARKS as BENCH, load_benchmark

bench = load_benchmark("bench_service")

GiB = 1 << 30
RANGES = {"batch": [1, 32], "prompt": [32, 2048], "new_tokens": [16, 128]}
GO = {"service_start": 100.0, "trainer_start": 105.0, "until": 190.0}


def request(latency_s, batch=4, prompt=100, new_tokens=50, ok=True, asks=(0, 0), start=101.0) -> dict:
    return {"start": start, "latency_s": latency_s, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
            "ok": ok, "error": None if ok else "out of memory", "asks_before": asks[0], "asks_after": asks[1]}


def service_record(requests, peak_reserved=20 * GiB) -> dict:
    return {"role": "service", "ranges": RANGES, "requests": requests, "go": GO, "error": None,
            "samples": [[100.0, 4 * GiB], [101.0, 8 * GiB]], "peak_reserved": peak_reserved,
            "peak_allocated": peak_reserved - GiB, "limit": None, "sharing": None}


def step(t0, t1, batch, ok=True) -> dict:
    return {"t0": t0, "t1": t1, "batch": batch, "ok": ok}


def trainer_record(steps, peak_reserved=50 * GiB) -> dict:
    return {"role": "train", "steps": steps, "go": GO, "error": None, "samples": [[105.0, 2 * GiB]],
            "peak_reserved": peak_reserved, "peak_allocated": peak_reserved, "limit": None, "sharing": None}


def side(record, exit_status=0, tail=("done",)) -> dict:
    return {"exit": exit_status, "record": record, "stderr_tail": list(tail), "command": []}


def row_cells(table: str, configuration: str) -> dict:
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    [line] = [line for line in lines if line.startswith(f"| {configuration} |")]
    return dict(zip(head, [c.strip() for c in line.strip("|").split("|")]))


def test_percentiles_are_linear_between_the_closest_ranks_of_the_sorted_values():
    values = [50.0, 10.0, 40.0, 20.0, 30.0]
    assert bench.percentile(values, 50) == 30.0
    assert bench.percentile(values, 99) == pytest.approx(49.6)  # 40 + 0.96 of the way to 50
    assert bench.percentile(values, 0) == 10.0 and bench.percentile(values, 100) == 50.0
    assert bench.percentile([7.0], 99) == 7.0
    assert bench.percentile([], 50) is None


def test_buckets_are_thirds_of_each_range_both_ends_included():
    assert [bench.bucket(b, 1, 32) for b in (1, 11, 12, 22, 23, 32)] == [0, 0, 1, 1, 2, 2]
    assert [bench.bucket(p, 32, 2048) for p in (32, 704, 705, 1376, 1377, 2048)] == [0, 0, 1, 1, 2, 2]


def test_extra_latency_is_over_the_median_per_token_latency_of_its_bucket_that_did_not_wait():
    requests = [
        # bucket (0, 0): 10, 10 and 12 ms a token without waiting, so 10 ms is the reference
        request(0.5, new_tokens=50), request(1.0, new_tokens=100), request(0.6, new_tokens=50),
        request(9.0, new_tokens=50, ok=False),  # failed: no reference, however slow
        request(1.1, new_tokens=80, asks=(3, 4)),  # waited: 1.1 s less 80 x 10 ms
        request(0.9, new_tokens=40, asks=(4, 6)),  # waited: 0.9 s less 40 x 10 ms
        request(0.2, new_tokens=20, ok=False, asks=(6, 7)),  # waited and failed: no extra latency
        request(2.0, batch=30, prompt=2000, asks=(7, 8)),  # waited, alone in bucket (2, 2)
    ]
    extra = bench.extra_latencies(requests, RANGES)
    assert extra["extra_s"] == pytest.approx([0.3, 0.5])
    assert extra["without_reference"] == 1


def test_the_service_summary_counts_served_failed_and_waited_and_takes_latencies_of_served_requests_only():
    requests = [request(0.1 * i) for i in range(1, 11)] + [request(60.0, ok=False)]
    requests += [request(1.5, new_tokens=50, asks=(0, 1))]  # reference 0.1..1.0 s / 50 tokens: median 11 ms
    s = bench.summarize_service(service_record(requests))
    assert (s["served"], s["failed"], s["waited"], s["waited_failed"]) == (11, 1, 1, 0)
    assert s["p50_ms"] == pytest.approx(600.0)  # the sixth of 100, 200, ..., 1000, 1500 ms
    assert s["p99_ms"] == pytest.approx(1450.0)  # 0.9 of the way from 1000 to 1500
    assert s["extra_ms_median"] == s["extra_ms_max"] == pytest.approx(1500.0 - 50 * 11.0)
    assert s["peak_reserved"] == 20 * GiB


def test_throughput_is_the_samples_of_steps_that_worked_over_the_whole_span_of_steps():
    steps = [step(10.0, 11.0, 4), step(11.0, 12.0, 5), step(12.0, 12.5, 7, ok=False), step(12.5, 14.0, 5)]
    assert bench.throughput(steps) == pytest.approx((4 + 5 + 5) / 4.0)
    assert bench.throughput([]) is None
    t = bench.summarize_trainer(trainer_record(steps))
    assert (t["steps"], t["oom_steps"], t["final_batch"], t["largest_batch"]) == (4, 1, 5, 5)
    assert t["batch_changes"] == [[-90.0, 4], [-89.0, 5], [-88.0, 7], [-87.5, 5]]


def test_each_configurations_row_comes_from_its_own_records_only():
    native = bench.summarize_configuration("native", {
        "service": side(service_record([request(0.2), request(0.4), request(5.0, ok=False)], 30 * GiB)),
        "train": side(trainer_record([step(0.0, 1.0, 8), step(1.0, 2.0, 10)], 60 * GiB))})
    sharing = bench.summarize_configuration("sharing", {
        "service": side(service_record([request(0.3), request(0.9, asks=(0, 2))], 22 * GiB)),
        "train": side(trainer_record([step(0.0, 2.0, 6), step(2.0, 3.0, 9, ok=False), step(3.0, 4.0, 6)],
                                     50 * GiB))})
    text = bench.table([native, sharing])
    n, s = row_cells(text, "native"), row_cells(text, "sharing")
    assert (n["requests served"], n["failed"], n["p50 ms"], n["waited on an ask"]) == ("2", "1", "300", "0")
    assert n["extra ms median / max"] == "-"
    assert (n["trainer samples/s"], n["final batch"], n["largest batch"]) == ("9.0", "10", "10")
    assert (n["trainer peak reserved GiB"], n["service peak reserved GiB"]) == ("60.00", "30.00")
    assert (s["requests served"], s["failed"], s["p50 ms"], s["waited on an ask"]) == ("2", "0", "600", "1")
    assert s["extra ms median / max"] == "600 / 600"  # 0.9 s less 50 tokens at 0.3 s / 50
    assert (s["trainer samples/s"], s["final batch"], s["largest batch"]) == ("3.0", "6", "6")
    assert (s["trainer peak reserved GiB"], s["service peak reserved GiB"]) == ("50.00", "22.00")


def test_a_waited_request_alone_in_its_bucket_has_no_extra_latency_but_is_counted():
    s = bench.summarize_service(service_record([request(0.3), request(0.9, batch=30, asks=(0, 2))]))
    assert s["waited"] == 1 and s["extra_ms_median"] is None and s["extra_without_reference"] == 1


def test_a_failed_configuration_names_the_side_that_failed_before_the_one_the_driver_killed():
    killed = side(None, exit_status=-9, tail=["killed by the driver: still running at its deadline"])
    crashed = side({**trainer_record([]), "error": "RuntimeError: CUDA error"}, exit_status=1,
                   tail=["Traceback ...", "RuntimeError: CUDA error"])
    row = bench.summarize_configuration("split", {"service": killed, "train": crashed})
    assert row["status"] == "failed"
    assert row["error"] == "train: RuntimeError: CUDA error"
    cells = row_cells(bench.table([row]), "split")
    assert cells["status"] == "failed: train: RuntimeError: CUDA error"
    assert cells["requests served"] == "-" and cells["final batch"] == "-"
    alone = bench.summarize_configuration("split", {"service": killed, "train": side(trainer_record([]))})
    assert alone["error"] == "service: exit status -9: killed by the driver: still running at its deadline"


def test_the_trainers_batch_grows_a_quarter_every_four_good_steps_and_falls_back_on_out_of_memory():
    schedule = bench.BatchSchedule(start=4, growth=1.25, every=4, hold_s=20.0)
    batches = [schedule.step_done(True, now=float(i)) for i in range(12)]
    assert batches == [4, 4, 4, 5, 5, 5, 5, 7, 7, 7, 7, 9]
    assert schedule.step_done(False, now=12.0) == 7  # 9 failed: back to the last that worked
    assert [schedule.step_done(True, now=13.0 + i) for i in range(8)] == [7] * 8  # held for 20 s
    assert schedule.step_done(True, now=32.0) == 9  # the hold is over: it grows again
    assert schedule.step_done(False, now=33.0) == 7  # 9 fails again
    assert schedule.step_done(False, now=34.0) == 5  # 7 worked before but fails now: a rung down
    one = bench.BatchSchedule(start=1)
    assert one.step_done(False, now=0.0) == 1  # never below one sample


@pytest.mark.parametrize("total_gib", [79.2, 139.8])
def test_sizes_follow_the_devices_memory(total_gib):
    total = int(total_gib * GiB)
    size = bench.sizes(total, 0.10, 0.25)
    assert size["floor"] == int(0.10 * total) // (1 << 20) * (1 << 20)
    assert 0.01 * total <= size["weights"] <= 0.03 * total
    assert 1 <= size["most_batch"] <= 32
    assert size["floor"] < size["largest_request_peak"] <= 0.25 * total
    # The split gives the service its largest request and a margin, the trainer the rest.
    assert size["service_cap"] >= 1.25 * size["largest_request_peak"] and size["service_cap"] % (1 << 20) == 0
    assert size["service_cap"] < 1.25 * size["largest_request_peak"] + (1 << 20)
    assert size["trainer_cap"] == total - size["service_cap"] - 3 * GiB // 2
    bigger = bench.sizes(2 * total, 0.10, 0.25)
    assert bigger["layers"] > size["layers"]
    smaller_peak = bench.sizes(total, 0.10, 0.08)
    assert smaller_peak["most_batch"] < size["most_batch"]
    assert smaller_peak["largest_request_peak"] <= 0.08 * total


def test_each_configuration_starts_its_processes_as_users_do():
    size = bench.sizes(80 * GiB, 0.10, 0.25)
    native = bench.role_command("native", "service", size, ["--seed", "0"])
    assert native[1:] == [bench.HERE, "--role", "service", "--seed", "0"]
    split = bench.role_command("split", "train", size, [])
    assert split[1:6] == ["-m", "gpumem", "run", "--limit", str(size["trainer_cap"])] and split[6] == "--"
    assert bench.role_command("split", "service", size, [])[5] == str(size["service_cap"])
    service = bench.role_command("sharing", "service", size, [])
    assert service[1:7] == ["-m", "gpumem", "run", "--floor", str(size["floor"]), "--"]
    assert bench.role_command("sharing", "train", size, [])[1:6] == ["-m", "gpumem", "run", "--share", "--"]


def test_the_figure_draws_each_configuration_from_its_records(tmp_path):
    limited = {**service_record([request(0.2), request(1.0, ok=False)]), "limit": 24 * GiB}
    floored = {**service_record([request(0.2, asks=(0, 1))]), "sharing": {"floor": 24 * GiB, "asks_made": 1}}
    results = [{"configuration": "split", "status": "ok", "sides": {"service": side(limited),
                                                                     "train": side(trainer_record([]))}},
               {"configuration": "sharing", "status": "failed", "sides": {"service": side(floored),
                                                                          "train": side(None, exit_status=1)}}]
    png = tmp_path / "service.png"
    bench.plot(str(png), results, bench.sizes(80 * GiB, 0.10, 0.25))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_cuda_device_it_says_so_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, str(BENCH / "bench_service.py"), "--seconds", "10", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env, cwd=BENCH)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("command: ") and "bench_service.py --seconds 10" in lines[0]
    assert lines[-1] == "skipped: no CUDA device"
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written
