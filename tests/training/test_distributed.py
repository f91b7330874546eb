"""Data-parallel training: `llamagym run --num-processes 2` end to end (two CPU processes
talking over gloo, started through accelerate's launcher), the agreement between
processes on a real two-process group, and the clear errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llamagym import distributed
from llamagym.algorithms.batching import minibatches
from llamagym.errors import ConfigError
from llamagym.testing import free_port
from llamagym.training.records.run_files import read_metrics

FAST = [
    *("--quiet", "--num-envs", "8", "--episodes", "64", "--eval-episodes", "40"),
    *("--checkpoint-every", "1", "--set", "algorithm.episodes_per_update=16"),
    *("--set", "algorithm.minibatch_size=16", "--set", "algorithm.epochs=2"),
    *("--set", "output.rank_records=true"),
]


def llamagym(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llamagym.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def rank_records(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / ".ranks" / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """64 Blackjack episodes, 16 per update in each of two processes: 2 updates."""
    from llamagym.models.tiny import build_tiny_model

    build_tiny_model()  # once, before two processes both look for it
    run_dir = tmp_path_factory.mktemp("distributed") / "run"
    completed = llamagym("run", "blackjack", "--num-processes", "2", *FAST, "-o", run_dir)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return run_dir, completed


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
def test_each_process_plays_its_own_episodes(two_process_run) -> None:
    run_dir, _ = two_process_run
    first, second = rank_records(run_dir, 0), rank_records(run_dir, 1)
    assert [r["update"] for r in first] == [r["update"] for r in second] == [1, 2]
    for mine, theirs in zip(first, second, strict=True):
        assert mine["episodes"] == theirs["episodes"] == 16
        assert set(mine["seeds"]).isdisjoint(theirs["seeds"])


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
def test_weights_are_identical_across_processes_after_every_update(two_process_run) -> None:
    run_dir, _ = two_process_run
    digests = [[r["parameters_sha256"] for r in rank_records(run_dir, rank)] for rank in (0, 1)]
    assert digests[0] == digests[1]
    assert len(set(digests[0])) == 2  # and the weights moved between the updates


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
def test_rank_zero_alone_writes_logs_and_evaluates(two_process_run) -> None:
    run_dir, completed = two_process_run
    records = read_metrics(run_dir / "metrics.jsonl")
    updates = [r for r in records if r["kind"] == "update"]
    # One line per update (a second writer would double them), counting both processes.
    assert [r["update"] for r in updates] == [1, 2]
    assert [r["total_episodes"] for r in updates] == [32, 64]
    assert [r["episodes"] for r in updates] == [32.0, 32.0]
    assert [r["kind"] for r in records].count("evaluation") == 1
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["update-000001", "update-000002"]  # no staging dirs left behind
    assert completed.stdout.count("trained 64 episodes") == 1
    assert "8 envs in each of 2 processes" in completed.stdout
    assert completed.stdout.count("trained agent") == 1  # one evaluation table


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
def test_a_two_process_run_resumes_on_every_process(two_process_run) -> None:
    run_dir, _ = two_process_run
    completed = llamagym(
        "run",
        "blackjack",
        "--num-processes",
        "2",
        "--resume",
        run_dir,
        "--episodes",
        "96",
        "--eval-episodes",
        "0",
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["update"] for r in updates] == [1, 2, 3]
    assert updates[-1]["total_episodes"] == 96
    first, second = rank_records(run_dir, 0), rank_records(run_dir, 1)
    assert first[-1]["update"] == second[-1]["update"] == 3
    assert first[-1]["parameters_sha256"] == second[-1]["parameters_sha256"]
    seen_by_second = {seed for record in second[:-1] for seed in record["seeds"]}
    assert set(second[-1]["seeds"]).isdisjoint(first[-1]["seeds"])
    assert set(second[-1]["seeds"]).isdisjoint(seen_by_second)  # not a replay of its start


# -- agreement between processes, on a real two-process gloo group ----------------------
AGREEMENT = textwrap.dedent(
    """
    import json, math
    import torch
    import torch.distributed as dist
    from llamagym import distributed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parameter = torch.nn.Parameter(torch.zeros(3))
    parameter.grad = torch.full((3,), float(rank + 1))
    unused = torch.nn.Parameter(torch.zeros(2))
    averaged = distributed.average_gradients([parameter, unused], finite=True)
    skipped = not distributed.average_gradients([parameter, unused], finite=rank == 0)
    weights = torch.nn.Parameter(torch.full((2,), float(rank)))
    distributed.broadcast_parameters([weights])
    group = distributed.process_group()
    answer = {
        "group": [type(group).__name__, group.world_size, group.rank],
        "group_agrees": [
            group.all_min([5, 3][rank]),
            group.all_max([0.5, 2.0][rank]),
            list(group.all_mean([1.0, 4.0][rank], [3, 1][rank])),
            group.all_gather(rank * 10),
        ],
        "count": distributed.agreed_min([5, 3][rank]),
        "max": distributed.agreed_max([0.5, 2.0][rank]),
        "max_nan": math.isnan(distributed.agreed_max([0.5, float("nan")][rank])),
        "mean": distributed.weighted_mean([1.0, 4.0][rank], [3, 1][rank]),
        "gathered": distributed.all_gather(rank * 10),
        "averaged": averaged,
        "grad": parameter.grad.tolist(),
        "unused_grad": unused.grad,
        "skipped": skipped,
        "broadcast": weights.tolist(),
    }
    print(json.dumps(answer))
    dist.destroy_process_group()
    """
)


def test_processes_agree_on_counts_stops_and_gradients() -> None:
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", AGREEMENT],
            env={**base, "RANK": str(rank), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    answers = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err[-2000:]
        answers.append(json.loads(out.strip().splitlines()[-1]))
    for rank, answer in enumerate(answers):
        assert answer["group"] == ["ProcessGroup", 2, rank]
        assert answer["group_agrees"] == [3, 2.0, [(1.0 * 3 + 4.0 * 1) / 4, 4.0], [0, 10]]
        assert answer["count"] == 3  # the fewest minibatches
        assert answer["max"] == 2.0  # the largest KL decides the target-KL stop
        assert answer["max_nan"] is True
        assert answer["mean"] == [(1.0 * 3 + 4.0 * 1) / 4, 4.0]  # turn-weighted, all turns
        assert answer["gathered"] == [0, 10]
        assert answer["averaged"] is True
        assert answer["unused_grad"] is None  # a parameter without a gradient keeps none
        assert answer["skipped"] is True  # a non-finite loss anywhere skips everywhere
        assert answer["broadcast"] == [0.0, 0.0]  # rank 0's weights
    # (1 + 2) / 2 after the first averaging; the skipped second one left it alone.
    assert answers[0]["grad"] == answers[1]["grad"] == [1.5, 1.5, 1.5]


# -- leaving a run: the heartbeat ends before the interpreter ----------------------------
LEAVING = textwrap.dedent(
    """
    import datetime, sys, time
    import torch.distributed as dist
    from llamagym import distributed

    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, False,
                          timeout=datetime.timedelta(seconds=1))
    distributed.start_heartbeat(store, 0)
    time.sleep(0.3)
    print(sys.argv[2], flush=True)
    sys.stdin.readline()  # the store's server is stopped now: the next beat waits for it
    time.sleep(1.5)
    distributed.finish()

    class SlowShutdown:  # a shutdown as long as a big process's: the beat returns in it
        def __del__(self, clock=time.monotonic):
            start = clock()
            while clock() - start < 3.0:
                pass

    keep = SlowShutdown()
    """
)
STORE_SERVER = (
    "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, 1, True); "
    "print('up', flush=True); time.sleep(120)"
)


def test_a_process_leaving_the_run_ends_its_heartbeat_before_python_ends() -> None:
    """A heartbeat caught in a store call when the interpreter shuts down aborted a run
    that had gone well (SIGABRT, "terminate called without an active exception")."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER.format(port=port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "up"
        leaving = subprocess.Popen(
            [sys.executable, "-c", LEAVING, str(port), "beating"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert leaving.stdout.readline().strip() == "beating"
        server.send_signal(signal.SIGSTOP)
        leaving.stdin.write("go\n")
        leaving.stdin.flush()
        time.sleep(2.5)  # the beat comes back while the process is still shutting down
        server.send_signal(signal.SIGCONT)
        _, err = leaving.communicate(timeout=60)
        assert leaving.returncode == 0, err[-2000:]
        assert "terminate called" not in err
    finally:
        server.kill()
        server.wait()


def test_one_process_needs_no_process_group() -> None:
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.agreed_min(7) == 7
    assert distributed.all_gather("x") == ["x"]
    assert distributed.weighted_mean(0.25, 3) == (0.25, 3)
    group = distributed.process_group()
    assert isinstance(group, distributed.SingleProcess)
    assert (group.world_size, group.rank) == (1, 0)
    assert group.all_min(7) == 7 and group.all_max(0.5) == 0.5
    assert group.all_mean(0.25, 3) == (0.25, 3) and group.all_gather("x") == ["x"]
    assert group.average_gradients([], finite=False) is False
    assert distributed.process_seed(5, 0) == 5
    assert distributed.process_seed(5, 1) == 1005
    assert distributed.process_seed(5, 1, update=2) != distributed.process_seed(5, 1)


def test_minibatches_take_the_agreed_count() -> None:
    order = list(range(10))
    assert minibatches(order, 4, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert minibatches(order, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # fewer on another rank
    assert minibatches(order, 4, 0) == []


# -- bad input -------------------------------------------------------------------------
def test_zero_processes_is_a_one_line_error(cli) -> None:
    code, _, err = cli("run", "blackjack", "--num-processes", "0")
    assert code == 2
    assert err.strip() == "error: --num-processes must be at least 1, got 0"


def test_several_processes_without_accelerate_say_how_to_install_it(
    cli, monkeypatch, tmp_path
) -> None:
    monkeypatch.setitem(sys.modules, "accelerate.commands.launch", None)  # import fails
    code, _, err = cli("run", "blackjack", "--num-processes", "2", "-o", tmp_path / "r")
    assert code == 2
    assert "needs the package 'accelerate': pip install accelerate" in err
    assert len(err.strip().splitlines()) == 1


def test_the_launched_processes_get_the_same_command(cli, monkeypatch, tmp_path) -> None:
    from llamagym.cli import run_commands

    launched = []
    monkeypatch.setattr(
        run_commands, "launch_processes", lambda count, words: launched.append((count, words))
    )
    output = str(tmp_path / "r")
    code, _, _ = cli(
        *("run", "blackjack", "--num-envs", "4", "--num-processes", "3", "--quiet"),
        *("--set", "algorithm.lr=0.01", "--minutes", "0.5", "-o", output),
        *("--set", "algorithm.epochs=1"),
    )
    assert code == 0
    # Parameters in their declared order; the --set assignments in the order given.
    assert launched == [
        (
            3,
            [
                *("blackjack", "--minutes", "0.5", "--num-envs", "4", "--output", output),
                *("--set", "algorithm.lr=0.01", "--set", "algorithm.epochs=1", "--quiet"),
            ],
        )
    ]


def test_accelerates_single_cpu_process_launch_is_refused(monkeypatch) -> None:
    # What `accelerate launch --cpu --num_processes 2` leaves: one process, no WORLD_SIZE.
    for name in distributed.WORLD_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="--multi_gpu --num_processes N"):
        distributed.start("auto")
    monkeypatch.delenv("MASTER_ADDR")
    assert distributed.start("auto") == "auto"  # a plain one-process launch is fine


def test_deepspeed_and_fsdp_launches_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="DeepSpeed runs with --backend trl"):
        distributed.start("auto")


@pytest.mark.parametrize(
    ("variable", "named"),
    [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")],
)
def test_a_sharded_launch_on_cpus_says_it_trains_data_parallel(
    monkeypatch, caplog, variable, named
) -> None:
    monkeypatch.setenv(variable, "true")
    with caplog.at_level("WARNING", logger="llamagym.distributed"):
        distributed.warn_if_not_sharded("DistributedType.MULTI_GPU")  # accelerate shards
        assert caplog.records == []
        distributed.warn_if_not_sharded("DistributedType.MULTI_CPU")
    assert [r.getMessage() for r in caplog.records] == [
        f"accelerate was launched with {named}, which it runs only on GPUs: on the CPU it "
        "trains data-parallel (DDP), each process holding the whole model"
    ]
