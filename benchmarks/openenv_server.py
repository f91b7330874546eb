"""OpenEnv server: env steps per second through ``llamagym serve`` against in process
(Blackjack and TextWorld, 8 and 64 sessions), the server's memory over many episodes,
and a run that outlives its server being killed every minute.

    python benchmarks/openenv_server.py [--agents blackjack textworld] [--seconds 10]
        [--episodes 10000] [--soak-minutes 10] [--quick]

In process, N envs from the agent's ``make_env`` are stepped in turn with each step's
text made as a run makes it (``format_observation`` and the legal actions): what the
server does per step, without the socket. Through the server, N sessions
(``OpenEnvEnv``, OpenEnv's sync client each) are stepped two ways: in turn from one
thread (``lockstep``: how a run's engine steps its envs) and from N threads at once
(``concurrent``: how N trainers or an async trainer would). Random legal actions,
seeded resets. Then ``--episodes`` Blackjack episodes are played through 8 sessions
while the server's resident set size is sampled (``/proc``): its peak, and its growth
from the first tenth of the episodes to the end. Last, the soak: a tiny-model run of
agent ``openenv`` for ``--soak-minutes`` on a served Blackjack whose server is SIGKILLed
and started again on the same port every minute: its exit code, whether it hung, its
updates (numbered without a gap) and env failures. Each server is ``llamagym serve``
in its own process (loopback). Prints the JSON and writes
``benchmarks/results/openenv-server.json`` (``-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable,
    # and keep this folder off the path (its textworld.py would shadow the package)
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from benchmarks.common import stop_process, write_script_result  # noqa: E402

SESSIONS = (8, 64)


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def llamagym() -> str:
    return shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"


def start_server(agent: str, max_sessions: int, port: int = 0) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [llamagym(), "serve", agent, "--port", str(port), "--max-sessions", str(max_sessions)],
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


def in_process_rate(agent_name: str, count: int, seconds: float) -> dict[str, Any]:
    from llamagym.cli.run_commands import resolve_run_config

    agent_class, resolved = resolve_run_config(agent_name, None, [], {})
    agent = agent_class(config=resolved)
    envs = [agent.make_env() for _ in range(count)]
    rng = random.Random(0)
    seed, steps, episodes = 0, 0, 0
    legal: list[list[str]] = []

    def begin(env: Any) -> list[str]:
        nonlocal seed
        observation, info = env.reset(seed=seed)
        seed += 1
        agent.plugins.format_observation(agent, observation, info)
        return list(agent.named_actions(observation, info))

    legal = [begin(env) for env in envs]
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for position, env in enumerate(envs):
            names = legal[position]
            action = agent.env_action(rng.randrange(len(names)), names)
            observation, _, terminated, truncated, info = env.step(action)
            steps += 1
            if terminated or truncated:
                episodes += 1
                legal[position] = begin(env)
            else:  # the text a run makes of the step, and its legal actions
                agent.plugins.format_observation(agent, observation, info)
                legal[position] = list(agent.named_actions(observation, info))
    elapsed = time.perf_counter() - start
    for env in envs:
        env.close()
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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def soak(minutes: float, kill_every: float) -> dict[str, Any]:
    """A tiny-model run of agent ``openenv`` on a served Blackjack for ``minutes``, the
    server SIGKILLed and started again on the same port every ``kill_every`` seconds:
    the run's exit code, its updates (numbered without a gap), its env failures, and
    whether it ended within its budget and a minute."""
    port = free_port()
    process, url = start_server("blackjack", 16, port)
    output = Path(tempfile.mkdtemp(prefix="llamagym-openenv-soak-")) / "run"
    run = subprocess.Popen(
        [llamagym(), "run", "openenv", "--model", "tiny", "--minutes", str(minutes),
         "--set", f"agent.url={url}", "--eval-episodes", "0", "--threads", "1", "--quiet",
         "--seed", "0", "--set", "algorithm.episodes_per_update=16",
         "--set", "output.report=false", "--output", str(output)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    kills, start = [], time.monotonic()
    try:
        while run.poll() is None and time.monotonic() - start < minutes * 60 + 300:
            time.sleep(1)
            if run.poll() is None and time.monotonic() - start >= kill_every * (len(kills) + 1):
                process.kill()
                process.wait(timeout=30)
                process, _ = start_server("blackjack", 16, port)
                kills.append(round(time.monotonic() - start, 1))
        hung = run.poll() is None
        if hung:
            run.kill()
        stderr = run.communicate(timeout=60)[1]
    finally:
        process.kill()
    wall = time.monotonic() - start
    records = []
    metrics = output / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    updates = [r["update"] for r in records if r.get("kind") == "update"]
    # env_failures in metrics.jsonl counts the run's failures so far
    failures = [r.get("env_failures", 0) for r in records if r.get("kind") == "update"]
    shutil.rmtree(output.parent, ignore_errors=True)
    return {
        "minutes": minutes, "kill_every_seconds": kill_every, "server_kills": len(kills),
        "kills_at_seconds": kills, "exit_code": run.returncode, "hung": hung,
        "wall_seconds": round(wall, 1), "updates": len(updates),
        "updates_numbered_without_gap": updates == list(range(1, len(updates) + 1)),
        "env_failures": max(failures, default=0), "stderr_tail": stderr[-600:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", nargs="+", default=["blackjack", "textworld"])
    parser.add_argument("--seconds", type=float, default=10.0, help="Per measurement.")
    parser.add_argument("--episodes", type=int, default=10_000, help="For the memory part.")
    parser.add_argument("--soak-minutes", type=float, default=10.0,
                        help="The run with its server killed every minute (0: none).")
    parser.add_argument("--quick", action="store_true",
                        help="1 s each, 400 episodes, a 1-minute soak killed every 20 s.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    args = parser.parse_args()
    seconds, episodes = (1.0, 400) if args.quick else (args.seconds, args.episodes)
    soak_minutes, kill_every = (1.0, 20.0) if args.quick else (args.soak_minutes, 60.0)
    rows = []
    memory = None
    for agent in args.agents:
        process, url = start_server(agent, max(SESSIONS))
        try:
            for count in SESSIONS:
                rows.append({"agent": agent, "sessions": count, "side": "in process",
                             **in_process_rate(agent, count, seconds)})
                for concurrent in (False, True):
                    side = "server, " + ("concurrent" if concurrent else "lockstep")
                    rows.append({"agent": agent, "sessions": count, "side": side,
                                 **served_rate(url, count, seconds, concurrent)})
                print(json.dumps(rows[-3:]), flush=True)
            if agent == "blackjack":
                memory = memory_over_episodes(process, url, episodes)
                print(json.dumps(memory), flush=True)
        finally:
            stop_process(process)
    soaked = soak(soak_minutes, kill_every) if soak_minutes > 0 else None
    data = {"agents": args.agents, "rows": rows, "server_memory": memory, "soak": soaked,
            "settings": {"seconds": seconds, "episodes": episodes,
                         "soak_minutes": soak_minutes, "kill_every_seconds": kill_every}}
    path = write_script_result("openenv-server", args.quick, args.output, data)
    print(json.dumps(data, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
