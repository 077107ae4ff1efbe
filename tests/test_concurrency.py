"""How many runs go at once (pipelines.run.concurrency), without Ray: the count that fits free resources,
each run's ingest share, and the bounded pool that runs them."""

import threading
import time

import pytest

from mdc.config import ConfigError, derive, load_config
from pipelines.run import concurrency


def config(**items):
    return derive(load_config(None), items)


def test_default_config_fits_once_on_two_cores():
    """2 workers × 0.5 CPU + one reader's CPU = 2 CPUs a run."""
    assert concurrency.run_resources(config()) == {"CPU": 2.0, "GPU": 0.0}
    assert concurrency.fitting_runs([config()] * 4, {"CPU": 2.0}) == 1
    assert concurrency.fitting_runs([config()] * 4, {"CPU": 1.0}) == 1  # never 0: one run waits for its turn


def test_runs_fit_by_cpus_and_ingest_capped_by_how_many_there_are():
    small = config(**{"workers.count": 1, "workers.cpus": 0.5, "data.ingest_cpus": 0.5})
    assert concurrency.fitting_runs([small] * 4, {"CPU": 2.0}) == 2
    assert concurrency.fitting_runs([small] * 4, {"CPU": 1.99}) == 1
    assert concurrency.fitting_runs([small] * 3, {"CPU": 64.0}) == 3
    assert concurrency.fitting_runs([], {"CPU": 64.0}) == 1


def test_gpu_runs_fit_by_gpus():
    """A 64-GPU cluster holds 8 runs of 8 GPU workers, unless their CPUs run out first."""
    gpu = config(**{"workers.count": 8, "workers.use_gpu": True, "workers.cpus": 4, "data.ingest_cpus": 16})
    assert concurrency.run_resources(gpu) == {"CPU": 48.0, "GPU": 8.0}
    assert concurrency.fitting_runs([gpu] * 30, {"CPU": 8 * 96.0, "GPU": 64.0}) == 8
    assert concurrency.fitting_runs([gpu] * 30, {"CPU": 100.0, "GPU": 64.0}) == 2
    assert concurrency.fitting_runs([gpu] * 30, {"CPU": 1000.0}) == 1  # no GPU free: one at a time, Ray waits


def test_a_run_counts_its_online_evaluation_bundle():
    """eval.cpus / eval.gpus are held by the run's evaluation bundle for as long as it trains."""
    online = {"eval.probe_every": 10, "eval.probes": [{"dataset": "shapes", "root": "held-out"}], "eval.cpus": 0.5}
    gpu = config(**{"workers.count": 8, "workers.use_gpu": True, "workers.cpus": 4, "data.ingest_cpus": 16})
    assert concurrency.run_resources(derive(gpu, {**online, "eval.gpus": 1})) == {"CPU": 48.5, "GPU": 9.0}
    assert concurrency.fitting_runs([derive(gpu, {**online, "eval.gpus": 1})] * 30, {"CPU": 8 * 96.0, "GPU": 64.0}) == 7
    assert concurrency.run_resources(derive(gpu, {"eval.gpus": 1})) == {"CPU": 48.0, "GPU": 8.0}  # no online evaluation
    small = config(**{"workers.count": 1, "workers.cpus": 0.5, **online})
    assert (
        concurrency.share_ingest(small, 2, cluster_cpus=4.0) == 1.0
    )  # 2 a run, less 0.5 of worker and 0.5 of evaluation
    with pytest.raises(
        ConfigError, match=r"beside 1 × 0.5 CPUs of workers and 0.5 for online evaluation \(eval.cpus\)"
    ):
        concurrency.share_ingest(small, 2, cluster_cpus=2.0)


def test_requested_concurrency_is_bounded_by_the_runs_and_must_be_positive():
    runs = [config()] * 3
    assert concurrency.resolve_max_concurrent(2, runs) == 2
    assert concurrency.resolve_max_concurrent(10, runs) == 3
    with pytest.raises(ConfigError, match="--max-concurrent must be >= 1, got 0"):
        concurrency.resolve_max_concurrent(0, runs)


def test_each_concurrent_run_gets_its_share_of_ingest():
    small = config(**{"workers.count": 1, "workers.cpus": 0.5})
    assert concurrency.share_ingest(small, 1, cluster_cpus=2.0) is None  # alone: what the workers leave
    assert concurrency.share_ingest(small, 2, cluster_cpus=2.0) == 0.5
    assert concurrency.share_ingest(small, 3, cluster_cpus=2.0) == 0.16
    assert concurrency.share_ingest(derive(small, {"data.ingest_cpus": 0.3}), 2, cluster_cpus=2.0) == 0.3
    with pytest.raises(ConfigError, match=r"--max-concurrent 4: 2 CPUs shared by 4 runs leave no CPU"):
        concurrency.share_ingest(small, 4, cluster_cpus=2.0)


def test_pool_runs_at_most_n_at_once_and_keeps_the_order_given():
    running, most, lock = [0], [0], threading.Lock()

    def call(i):
        def run():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05 * (5 - i))  # the first given finishes last
            with lock:
                running[0] -= 1
            return i * i

        return run

    results = concurrency.run_all({f"run{i}": call(i) for i in range(5)}, 2)
    assert list(results.items()) == [(f"run{i}", i * i) for i in range(5)]
    assert most[0] == 2


def test_pool_raises_the_first_error_and_starts_nothing_after_it():
    started = []

    def run(i):
        def go():
            started.append(i)
            if i == 0:
                raise RuntimeError("run 0 failed")
            time.sleep(0.3)
            return i

        return go

    with pytest.raises(RuntimeError, match="run 0 failed"):
        concurrency.run_all({i: run(i) for i in range(6)}, 2)
    assert {0, 1} <= set(started) <= {0, 1, 2}  # 1 was running; 2 may have taken 0's place before it was seen


def test_one_at_a_time_runs_in_a_driver_thread_too():
    """Not in the main thread, which Ctrl-C reaches (tests/test_interrupt.py)."""
    [thread] = concurrency.run_all({"a": threading.current_thread}, 1).values()
    assert thread is not threading.main_thread()
    assert concurrency.interruptible(threading.current_thread) is not threading.main_thread()
    assert concurrency.run_all({i: (lambda i=i: i * i) for i in range(3)}, 1) == {0: 0, 1: 1, 2: 4}


@pytest.mark.parametrize("command", ["study", "compare", "scaling", "tune"])
def test_every_multi_run_command_takes_max_concurrent_and_refuses_zero(command, ray_forbidden):
    from typer.testing import CliRunner

    from pipelines.cli import app

    result = CliRunner().invoke(app, [command, "--max-concurrent", "0"])
    assert result.exit_code == 2 and "--max-concurrent" in result.output, result.output
    assert "Invalid value for '--max-concurrent'" in " ".join(result.output.split()), result.output


def test_a_sweep_counts_its_trials_so_its_default_concurrency_is_not_capped_at_one():
    from pathlib import Path

    from pipelines.commands.search_space import load_space
    from pipelines.commands.tune import trial_count

    spaces = Path(__file__).resolve().parents[1] / "tune_spaces"
    base = load_config(None)
    assert trial_count(load_space(spaces / "noise_schedule.yaml", base)) == 4
    assert trial_count(load_space(spaces / "noise_schedule_random.yaml", base)) == 8
    assert trial_count(load_space(spaces / "noise_schedule_random.yaml", base), num_samples=3) == 3
    small = config(**{"workers.count": 1, "workers.cpus": 0.5, "data.ingest_cpus": 0.5})
    assert concurrency.fitting_runs([small] * 4, {"CPU": 4.0}) == 4
