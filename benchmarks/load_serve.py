#!/usr/bin/env python3
"""``hybridrl serve`` under load: requests/s, latency, resets and lost ratings at 1, 8, 32 and 128 clients.

    python benchmarks/load_serve.py                          # 20 s per level, tiny model
    python benchmarks/load_serve.py --seconds 5 --clients 1 8 --out /tmp/load_serve.json

Starts ``hybridrl serve`` in a subprocess on 127.0.0.1 (a free port) with a tiny random Llama
(``hybridrl_testing.build_tiny_model``: character-level tokenizer, hidden 64, 2 layers), answers of
up to ``--max-tokens`` tokens, and its learner on (an update every ``--update-every`` ratings, as
in service). Each client is a thread that, until the level's time is up, asks a question
(``POST /v1/chat/completions``) and rates the answer (``POST /v1/feedback``), each request on a new
connection, as a browser or urllib does. Levels run one after another against the same server.

Per level: requests/s (both kinds), p50 and p99 latency of each kind, replies other than 200,
connections reset or refused, timeouts, and ratings acknowledged (a 200 reply to the feedback)
and lost (acknowledged but absent from ``online.sqlite`` once the server has stopped; it must be
0). Prints a table and writes JSON (``--out``, default benchmarks/results/load_serve.json).

Bounded: each level stops after ``--seconds`` (requests in flight then finish, each within
``--timeout``), and the server is stopped at the end. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import secrets
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

RESETS = (
    ConnectionResetError,
    ConnectionRefusedError,
    ConnectionAbortedError,
    BrokenPipeError,
    http.client.RemoteDisconnected,
)


def config(model: Path, run_dir: Path, args) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rollout": {"n": 1, "max_tokens": args.max_tokens},
        "rewards": [{"function": "user_rating"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "rollout_correction": "token"},
        "trainer": {"lr": 1e-3, "seed": 0, "threads": 1, "run_dir": str(run_dir), "sample_every": 0},
        "logging": {"loggers": ["jsonl"]},
        "online": {
            "update_every": args.update_every,
            "requests_per_minute": 10**9,  # every client is 127.0.0.1: the per-address limit is not measured
            "save_every": 10**6,
        },
    }


TOKEN = secrets.token_urlsafe(32)  # serve requires a token by default; the clients send it as users would


def start_server(cfg_path: Path, log: Path, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hybridrl.cli", "serve", str(cfg_path), "--host", "127.0.0.1", "--port", "0"]
    with open(log, "w") as out:
        env = {**os.environ, "HYBRIDRL_SERVE_TOKEN": TOKEN}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = re.search(r"on (http://127\.0\.0\.1:\d+) ", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"hybridrl serve did not start:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # the command's own way to stop: it closes the store
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def request(port: int, path: str, body: dict, timeout: float) -> tuple[str, float, dict | None]:
    """(outcome, seconds, reply): outcome '200', another status, 'reset' or 'timeout'."""
    data = json.dumps(body).encode()
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        return str(response.status), time.perf_counter() - start, reply
    except RESETS:
        return "reset", time.perf_counter() - start, None
    except TimeoutError:
        return "timeout", time.perf_counter() - start, None
    finally:
        conn.close()


def run_level(port: int, clients: int, seconds: float, timeout: float) -> dict:
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    latencies: dict[str, list[float]] = {"chat": [], "feedback": []}
    outcomes: dict[str, int] = {}
    acked: list[str] = []

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            question = {"messages": [{"role": "user", "content": f"Say a number {i * 1000 + n % 97}"}]}
            outcome, took, answer = request(port, "/v1/chat/completions", question, timeout)
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome == "200":
                    latencies["chat"].append(took)
            if outcome != "200":
                continue
            text = answer["choices"][0]["message"]["content"]
            rating = {"id": answer["id"], "rating": text.count("7") / max(1, len(text))}
            outcome, took, ack = request(port, "/v1/feedback", rating, timeout)
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome == "200" and ack.get("stored"):
                    latencies["feedback"].append(took)
                    acked.append(answer["id"])

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 2 * timeout + 10)
    elapsed = time.monotonic() - start
    every = latencies["chat"] + latencies["feedback"]
    total = sum(outcomes.values())

    def pct(values: list[float], q: float) -> float | None:
        if len(values) < 2:
            return round(values[0] * 1000, 1) if values else None
        return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000, 1)

    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": total,
        "requests_per_s": round(total / elapsed, 1),
        "p50_ms": pct(every, 50),
        "p99_ms": pct(every, 99),
        "chat_p50_ms": pct(latencies["chat"], 50),
        "chat_p99_ms": pct(latencies["chat"], 99),
        "feedback_p50_ms": pct(latencies["feedback"], 50),
        "feedback_p99_ms": pct(latencies["feedback"], 99),
        "not_200": {k: v for k, v in outcomes.items() if k not in ("200", "reset", "timeout")},
        "resets": outcomes.get("reset", 0),
        "timeouts": outcomes.get("timeout", 0),
        "acked_ratings": len(acked),
        "_acked": acked,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--seconds", type=float, default=20.0, help="Length of each level.")
    p.add_argument("--timeout", type=float, default=120.0, help="Seconds one request may take.")
    p.add_argument("--max-tokens", type=int, default=8, help="Longest answer, in tokens.")
    p.add_argument("--update-every", type=int, default=64, help="online.update_every of the server.")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "load_serve.json"))
    args = p.parse_args()

    from hybridrl_testing import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="load-serve-") as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        build_tiny_model(model)
        cfg_path = tmp / "serve.yaml"
        cfg_path.write_text(yaml.safe_dump(config(model, tmp / "run", args)))
        proc, url = start_server(cfg_path, tmp / "serve.log")
        port = int(url.rsplit(":", 1)[1])
        levels = []
        try:
            run_level(port, 2, 2.0, args.timeout)  # warm-up: the first answers compile and fill caches
            for clients in args.clients:
                levels.append(run_level(port, clients, args.seconds, args.timeout))
                print(f"{clients} clients: {levels[-1]['requests_per_s']} requests/s", flush=True)
        finally:
            stop_server(proc)
        with sqlite3.connect(f"file:{tmp / 'run' / 'online.sqlite'}?mode=ro", uri=True) as db:
            stored = {row[0] for row in db.execute("SELECT answer_id FROM ratings")}
        metrics = tmp / "run" / "metrics.jsonl"
        updates = len(metrics.read_text().splitlines()) if metrics.is_file() else 0  # a row per update
    for level in levels:
        level["lost_ratings"] = sum(1 for a in level.pop("_acked") if a not in stored)

    head = "clients|req/s|p50 ms|p99 ms|chat p50/p99 ms|feedback p50/p99 ms|not 200|resets|timeouts|acked|lost"
    head = head.split("|")
    rows = [
        [
            str(x["clients"]),
            f"{x['requests_per_s']:.1f}",
            str(x["p50_ms"]),
            str(x["p99_ms"]),
            f"{x['chat_p50_ms']} / {x['chat_p99_ms']}",
            f"{x['feedback_p50_ms']} / {x['feedback_p99_ms']}",
            str(sum(x["not_200"].values())),
            str(x["resets"]),
            str(x["timeouts"]),
            str(x["acked_ratings"]),
            str(x["lost_ratings"]),
        ]
        for x in levels
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"{updates} learner updates ran during the levels")
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "learner_updates": updates,
        "levels": levels,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    lost = sum(x["lost_ratings"] for x in levels)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
