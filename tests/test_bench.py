"""The benchmark's arithmetic: the figures in BENCHMARKS.md come from these functions."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import scaling_model  # noqa: E402
import train_throughput  # noqa: E402


def test_steady_rate_leaves_out_warm_up_and_the_time_between_epochs():
    steps = []
    for epoch, start in ((0, 0.0), (1, 100.0)):  # 100 s of validation and checkpoint between epochs
        times = [start, start + 5.0, start + 6.0] + [start + 6.0 + 0.5 * k for k in range(1, 5)]
        steps += [{"epoch": epoch, "time": t, "images": 64} for t in times]
    # Per epoch: intervals 5.0 and 1.0 are warm-up; then four of 0.5 s, 64 images each.
    assert train_throughput.steady_rate(steps) == 64 / 0.5


def test_targets_compare_ratios_within_one_run():
    def row(rate, first=5.0, wall=50.0, rss=None):
        stat = lambda v: {"median": v, "min": v, "max": v}  # noqa: E731
        return {"images_per_s": stat(rate), "first_step_s": stat(first), "wall_s": stat(wall),
                "peak_rss_mb": {"worker": stat(rss)} if rss else {}}

    results = {"raw": row(200), "ray-1": row(170, first=12, rss=1600), "ray-2": row(150), "ingest": row(5000)}
    checks = {what: met for what, met, _ in train_throughput.targets(results)}
    assert checks["1 worker >= 90% of raw"] is False  # 0.85
    assert checks["2 workers >= 70% of raw"] is True  # 0.75
    assert checks["ingest >= 10x one worker's consumption"] is True
    assert checks["ray-1: first step <= 10 s"] is False
    assert checks["peak RSS per training worker <= 1.5 GB"] is False


def test_records_every_n_steps_count_the_images_of_the_steps_between_them():
    records = [{"kind": "start", "local_batch_sizes": [4, 4]}] + [
        {"kind": "step", "epoch": 0, "step": s, "time": float(s)} for s in (10, 20, 30, 35)]
    assert [s["images"] for s in train_throughput._steps(records)] == [8, 80, 80, 40]


def test_the_ray_backends_cost_is_taken_repeat_by_repeat():
    local = [{"images_per_s": 800.0, "batch": 8, "cpu_ms_per_step": 10.0},
             {"images_per_s": 400.0, "batch": 8, "cpu_ms_per_step": 12.0}]
    ray = [{"images_per_s": 790.0, "batch": 8, "cpu_ms_per_step": 10.5},
           {"images_per_s": 400.0, "batch": 8, "cpu_ms_per_step": 12.0}]
    cost = train_throughput.ray_cost(local, ray)
    assert cost["ratio"]["values"] == [790 / 800, 1.0]  # each pair ran one after the other
    assert round(cost["step_us"]["values"][0], 3) == round(8e6 * (1 / 790 - 1 / 800), 3) and cost["step_us"]["min"] == 0
    assert cost["cpu_ratio"]["values"] == [10.0 / 10.5, 1.0]


def test_cpu_per_step_interpolates_the_training_process_samples_over_the_steady_steps():
    # 100 steps a second from t=0; the process uses 0.5 CPU s per second; samples every 0.5 s
    steps = [{"epoch": 0, "step": 10 * k, "time": 0.1 * k} for k in range(1, 31)]
    cpu = {7: ("worker", [(0.5 * i, 0.25 * i) for i in range(8)]), 3: ("main", [(0.0, 0.0), (4.0, 40.0)]),
           9: ("worker", [(0.0, 1.0), (4.0, 1.5)])}  # another run's worker, nearly idle
    # steady: from the third record (t=0.3, step 30) to the last (t=3.0, step 300)
    assert abs(train_throughput.cpu_per_step(steps, cpu, "worker") - 5.0) < 1e-9  # ms
    assert train_throughput.cpu_per_step(steps, {}, "worker") != train_throughput.cpu_per_step(steps, {}, "worker")  # nan


def test_scaling_model_ring_allreduce_and_efficiency():
    # 2 devices: each sends and receives half the gradients twice over: S / bus bandwidth.
    assert scaling_model.allreduce_s(2, bus_gb_s=44.70148, latency_us=0) == 1e-3
    [(n1, *_), (n2, worst, best, eff_worst, eff_best, comm_ms, b_star)] = scaling_model.rows(
        per_image_us=1000, fixed_ms=0, batch=3, links={1: (1, 0), 2: (44.70148, 0)})
    assert (n1, n2) == (1, 2) and comm_ms == 1.0
    assert worst == 2 * 3 / (3e-3 + 1e-3) and best == 2 * 3 / 3e-3  # 1 ms all-reduce hidden in 2 ms of backward
    assert eff_best == 1.0 and b_star == 1.0
