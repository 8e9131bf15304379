"""Simulated users of ``hybridrl serve``: they ask questions over HTTP, rate the answers by a rule
the server does not know, and send the ratings back.

    python plugins/serve/tests/online_user.py --url http://127.0.0.1:8000 --ratings 480 --rule sum
    python plugins/serve/tests/online_user.py --serve examples/online_smollm2_sums.yaml --ratings 480 --rule sum
    python plugins/serve/tests/online_user.py --serve CONFIG --set online.update_every=16 --set trainer.lr=2e-5

Rules: ``sum`` asks "What is a + b?" for one-digit a and b and rates 1 when the answer's last
number is a + b, else 0; ``sevens`` asks for digits and rates the fraction of the answer's
characters that are '7' (what a tiny random test model can learn). Each question is asked
``--repeat`` times in a row, as several users asking the same thing, which gives the learner
answers to compare (its leave-one-out baseline). Prints the mean rating of every ``--every``
ratings and the policy version that gave the last of them; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

SYSTEM = "Solve the problem. Reply with the final answer only, as a number."


def post(url: str, path: str, body: dict, token: str | None = None, timeout: float = 600) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str, path: str, token: str | None = None, timeout: float = 30) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def question(rule: str, rng: random.Random) -> tuple[list[dict], object]:
    if rule == "sum":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}], a + b
    return [{"role": "user", "content": f"Say a number {rng.randint(0, 99)}"}], None


def rate(rule: str, text: str, truth) -> float:
    if rule == "sum":
        numbers = re.findall(r"-?\d+", text)
        return 1.0 if numbers and int(numbers[-1]) == truth else 0.0
    return text.count("7") / max(1, len(text))


def simulate(url: str, ratings: int, rule: str = "sum", repeat: int = 4, every: int = 48, seed: int = 0, token=None):
    """Rate ``ratings`` answers; returns [(ratings so far, mean rating of the last ``every``, version)]."""
    rng = random.Random(seed)
    curve, window = [], []
    messages, truth = question(rule, rng)
    for i in range(ratings):
        if i % repeat == 0:
            messages, truth = question(rule, rng)
        code, answer = post(url, "/v1/chat/completions", {"messages": messages}, token)
        if code != 200:
            raise RuntimeError(f"chat completion {i}: HTTP {code}: {answer}")
        rating = rate(rule, answer["choices"][0]["message"]["content"], truth)
        code, ack = post(url, "/v1/feedback", {"id": answer["id"], "rating": rating}, token)
        if code != 200:
            raise RuntimeError(f"feedback {i}: HTTP {code}: {ack}")
        window.append(rating)
        if len(window) == every:
            curve.append((i + 1, sum(window) / every, answer["policy_version"]))
            print(f"ratings {i + 1}: mean {curve[-1][1]:.3f} (policy version {curve[-1][2]})", flush=True)
            window = []
    return curve


def start_server(config: str, *overrides: str, log: Path | None = None, timeout: float = 300):
    """``hybridrl serve CONFIG --port 0`` in a subprocess, its output to ``log``; its process, URL and
    token (the random one it printed) once it listens."""
    log = Path(log or Path(tempfile.gettempdir()) / f"hybridrl-serve-{Path(config).stem}.log")
    cmd = [sys.executable, "-m", "hybridrl.cli", "serve", config, *overrides, "--port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log.read_text()
        found = re.search(r"on (http://\S+) ", text)
        token = re.search(r"'Authorization: Bearer (\S+)'", text)
        if found and token:
            return proc, found.group(1), token.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"hybridrl serve did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server")
    p.add_argument("--serve", help="start 'hybridrl serve' with this config instead")
    p.add_argument("--ratings", type=int, default=480)
    p.add_argument("--rule", choices=("sum", "sevens"), default="sum")
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--every", type=int, default=48)
    p.add_argument("--token", default=None)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--set", action="append", default=[], help="with --serve: a dotted override (online.update_every=16)"
    )
    args = p.parse_args()
    proc = None
    if args.serve:
        # one simulated client asks far more often than online.requests_per_minute allows a person
        proc, args.url, args.token = start_server(args.serve, "online.requests_per_minute=100000", *args.set)
        print(f"started hybridrl serve {args.serve} on {args.url}", flush=True)
    try:
        start = time.time()
        curve = simulate(args.url, args.ratings, args.rule, args.repeat, args.every, token=args.token)
        status = get(args.url, "/v1/status", args.token)
        print(f"{args.ratings} ratings in {time.time() - start:.0f} s; status {status}")
        if args.out:
            Path(args.out).write_text(json.dumps({"curve": curve, "status": status, "args": vars(args)}, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
