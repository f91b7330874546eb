"""OpenEnv server: Blackjack's env steps per second through ``llamagym serve`` against
in process, at 8 and 64 sessions, and the server's memory over many episodes.

    python benchmarks/openenv_server.py [--seconds 10] [--episodes 10000] [--quick]

In process, N envs from the agent's ``make_env`` are stepped in turn with each step's
text made as a run makes it (``format_observation`` and the legal actions): what the
server does per step, without the socket. Through the server, N sessions
(``OpenEnvEnv``, OpenEnv's sync client each) are stepped two ways: in turn from one
thread (``lockstep``: how a run's engine steps its envs) and from N threads at once
(``concurrent``: how N trainers or an async trainer would). Random legal actions,
seeded resets. Then ``--episodes`` episodes are played through 8 sessions while the
server's resident set size is sampled (``/proc``): its peak, and its growth from the
first tenth of the episodes to the end. The server is ``llamagym serve blackjack`` in
its own process (loopback, port 0). Prints the JSON and writes
``benchmarks/results/openenv-server.json`` (``-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_script_result  # noqa: E402

SESSIONS = (8, 64)


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_server(max_sessions: int) -> tuple[subprocess.Popen, str]:
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    process = subprocess.Popen(
        [executable, "serve", "blackjack", "--port", "0", "--max-sessions", str(max_sessions)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(process.stdout.readline, "")],
                     daemon=True).start()
    try:
        line = lines.get(timeout=120)
    except queue.Empty:
        process.kill()
        raise RuntimeError("llamagym serve printed nothing in 120 s") from None
    if "OpenEnv server on " not in line:
        process.kill()
        raise RuntimeError(f"llamagym serve: {line}")
    return process, line.split("OpenEnv server on ", 1)[1].split(" ", 1)[0]


def in_process_rate(count: int, seconds: float) -> dict[str, Any]:
    from llamagym.cli.run_commands import resolve_run_config

    agent_class, resolved = resolve_run_config("blackjack", None, [], {})
    agent = agent_class(config=resolved)
    envs = [agent.make_env() for _ in range(count)]
    rng = random.Random(0)
    legal = [list(agent.action_names)] * count
    seed, steps, episodes = 0, 0, 0
    for env in envs:
        observation, info = env.reset(seed=seed)
        agent.plugins.format_observation(agent, observation, info)
        seed += 1
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for position, env in enumerate(envs):
            index = rng.randrange(len(legal[position]))
            observation, _, terminated, truncated, info = env.step(index)
            agent.plugins.format_observation(agent, observation, info)
            steps += 1
            if terminated or truncated:
                episodes += 1
                observation, info = env.reset(seed=seed)
                agent.plugins.format_observation(agent, observation, info)
                seed += 1
    elapsed = time.perf_counter() - start
    return {"steps": steps, "episodes": episodes, "seconds": round(elapsed, 2),
            "env_steps_per_second": round(steps / elapsed, 1)}


def _play(envs: list[Any], seconds: float, seed0: int, counts: list[int]) -> None:
    """Step ``envs`` in turn for ``seconds`` (random legal actions, seeded resets)."""
    from llamagym_openenv.client import LEGAL

    rng = random.Random(seed0)
    seed = seed0 * 1_000_000
    legal = []
    for env in envs:
        legal.append(env.reset(seed=seed)[1][LEGAL])
        seed += 1
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for position, env in enumerate(envs):
            _, _, terminated, truncated, info = env.step(rng.choice(legal[position]))
            counts[0] += 1
            if terminated or truncated:
                counts[1] += 1
                legal[position] = env.reset(seed=seed)[1][LEGAL]
                seed += 1
            else:
                legal[position] = info[LEGAL]


def served_rate(url: str, count: int, seconds: float, concurrent: bool) -> dict[str, Any]:
    from llamagym_openenv.client import OpenEnvEnv

    envs = [OpenEnvEnv(url) for _ in range(count)]
    try:
        start = time.perf_counter()
        if concurrent:
            tallies = [[0, 0] for _ in envs]
            threads = [threading.Thread(target=_play, args=([env], seconds, i, tallies[i]))
                       for i, env in enumerate(envs)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            steps, episodes = sum(t[0] for t in tallies), sum(t[1] for t in tallies)
        else:
            tally = [0, 0]
            _play(envs, seconds, 0, tally)
            steps, episodes = tally
        elapsed = time.perf_counter() - start
    finally:
        for env in envs:
            env.close()
    return {"steps": steps, "episodes": episodes, "seconds": round(elapsed, 2),
            "env_steps_per_second": round(steps / elapsed, 1)}


def memory_over_episodes(process: subprocess.Popen, url: str, episodes: int) -> dict[str, Any]:
    from llamagym_openenv.client import LEGAL, OpenEnvEnv

    envs = [OpenEnvEnv(url) for _ in range(8)]
    rng = random.Random(1)
    samples: list[tuple[int, float | None]] = []
    done, seed = 0, 0
    start = time.perf_counter()
    try:
        while done < episodes:
            for env in envs:
                _, info = env.reset(seed=seed)
                seed += 1
                finished = False
                while not finished:
                    _, _, terminated, truncated, info2 = env.step(rng.choice(info[LEGAL]))
                    finished, info = terminated or truncated, info2
                done += 1
                if done % max(1, episodes // 20) == 0:
                    samples.append((done, rss_mb(process.pid)))
    finally:
        for env in envs:
            env.close()
    tenth = next((mb for n, mb in samples if n >= episodes // 10 and mb), None)
    last = samples[-1][1] if samples else None
    return {
        "episodes": done, "seconds": round(time.perf_counter() - start, 1),
        "rss_mb_samples": [[n, round(mb, 1) if mb else None] for n, mb in samples],
        "rss_mb_after_first_tenth": round(tenth, 1) if tenth else None,
        "rss_mb_at_end": round(last, 1) if last else None,
        "growth_after_first_tenth_percent":
            round(100 * (last - tenth) / tenth, 1) if tenth and last else None,
        "peak_rss_mb": rss_mb(process.pid, "VmHWM"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="Per measurement.")
    parser.add_argument("--episodes", type=int, default=10_000, help="For the memory part.")
    parser.add_argument("--quick", action="store_true", help="1 s each, 400 episodes.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    args = parser.parse_args()
    seconds, episodes = (1.0, 400) if args.quick else (args.seconds, args.episodes)
    process, url = start_server(max(SESSIONS))
    rows = []
    try:
        for count in SESSIONS:
            rows.append({"sessions": count, "side": "in process",
                         **in_process_rate(count, seconds)})
            for concurrent in (False, True):
                rows.append({"sessions": count,
                             "side": "server, " + ("concurrent" if concurrent else "lockstep"),
                             **served_rate(url, count, seconds, concurrent)})
            print(json.dumps(rows[-3:]), flush=True)
        memory = memory_over_episodes(process, url, episodes)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    data = {"agent": "blackjack", "rows": rows, "server_memory": memory,
            "settings": {"seconds": seconds, "episodes": episodes}}
    path = write_script_result("openenv-server", args.quick, args.output, data)
    print(json.dumps(data, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
