"""``hybridrl dashboard``: the JSONL tail reader, the real server's endpoints, and the page itself
in headless Chromium (Debian's package, driven by Playwright) on the directory of a real run."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml
from hybridrl_dashboard.server import JsonlTail
from hybridrl_http.server import ALLOWED_HOSTS_ENV, HostCheck
from hybridrl_testing import metrics_rows

from hybridrl.config import ConfigError, load_config
from hybridrl.config_files import dump_config, is_secret

STEPS, PROMPTS, N = 3, 2, 4


def write_jsonl(path: Path, rows, mode="a"):
    with open(path, mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


# --- reading files that a run appends to -----------------------------------------------------


def test_tail_reads_appended_rows_once_complete_and_restarts_on_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.refresh() is False and tail.rows == []  # no file yet
    write_jsonl(path, [{"step": 1, "x": 1.0}])
    with open(path, "a") as f:
        f.write('{"step": 2, "x"')  # the run is writing this line right now
    tail.refresh()
    assert [r["step"] for r in tail.rows] == [1]
    with open(path, "a") as f:
        f.write(': 2.0}\nnot json\n{"no_step": 1}\n')
    tail.refresh()
    assert [r["step"] for r in tail.rows] == [1, 2] and tail.bad_lines == 2
    version = tail.version
    write_jsonl(path, [{"step": 1, "x": 9.0}], mode="w")  # rewritten (a resumed run trims it)
    assert tail.refresh() is True
    assert tail.rows == [{"step": 1, "x": 9.0}] and tail.version == version + 1
    # a new run in the same directory rewrites the file in place, longer than before
    write_jsonl(path, [{"step": s, "x": -1.0} for s in (1, 2, 3)], mode="w")
    assert tail.refresh() is True
    assert [r["x"] for r in tail.rows] == [-1.0] * 3 and tail.version == version + 2
    assert tail.refresh() is False and len(tail.rows) == 3


# --- the server ------------------------------------------------------------------------------


TOKENS: dict[str, str] = {}  # the token each dashboard started here printed, by its URL


def start_dashboard(run_dir: Path, *args: str, env: dict | None = None):
    """``hybridrl dashboard RUN_DIR --port 0``: the process and the URL it prints (without its
    ``?token=``, which goes to :data:`TOKENS`, where :func:`get` and :func:`send` find it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridrl.cli", "dashboard", str(run_dir), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=60)
            match = re.search(r"(http://127\.0\.0\.1:\d+/)(?:\?token=(\S+))?", line)
            if match:
                TOKENS.pop(match.group(1), None)  # an earlier dashboard's, on the same port
                if match.group(2):
                    TOKENS[match.group(1)] = unquote(match.group(2))
                    assert f"'Authorization: Bearer {TOKENS[match.group(1)]}'" in lines.get(timeout=10)
                return proc, match.group(1)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"the dashboard printed no URL: {proc.stderr.read() if proc.poll() else ''}") from None


def token_of(url: str) -> dict:
    """The Authorization header of the dashboard at ``url`` (none when it was started without a token)."""
    base = re.match(r"http://[^/]+/", url + "/").group(0)
    return {"Authorization": f"Bearer {TOKENS[base]}"} if base in TOKENS else {}


@pytest.fixture
def dashboard():
    procs = []

    def start(run_dir, *args, env=None):
        proc, url = start_dashboard(run_dir, *args, env=env)
        procs.append(proc)
        return url

    start.procs = procs
    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(url: str, headers: dict | None = None):
    """The reply to a GET with the dashboard's token (``headers`` add to or replace it)."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=token_of(url) | (headers or {})), timeout=10) as r:
        body = r.read()
        return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def test_endpoints_follow_the_files(tmp_path, dashboard):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  steps: 7\n")
    write_jsonl(run / "metrics.jsonl", [{"step": s, "time": 1.0, "reward/mean": s / 10} for s in (1, 2)])
    samples = [
        {"step": 2, "index": i, "prompt": "p", "response": f"r{i}", "score": float(i), "reward/f": None, "advantage": 0}
        for i in range(3)
    ]
    write_jsonl(run / "samples.jsonl", samples)
    url = dashboard(run)

    info = get(url + "api/run")
    assert (info["name"], info["total_steps"]) == ("run", 7) and "steps: 7" in info["config"]
    first = get(url + "api/metrics")
    assert first["reset"] is True and [r["reward/mean"] for r in first["rows"]] == [0.1, 0.2]
    v = first["version"]
    assert get(url + f"api/metrics?version={v}&after=2")["rows"] == []
    write_jsonl(run / "metrics.jsonl", [{"step": 3, "time": 2.0, "reward/mean": None}])
    assert get(url + f"api/metrics?version={v}&after=2")["rows"] == [{"step": 3, "time": 2.0, "reward/mean": None}]
    # the row cursor: an evaluation's row of step 3, written after the page read step 3's row, still comes
    assert get(url + f"api/metrics?version={v}&from=0")["next"] == 3
    write_jsonl(run / "metrics.jsonl", [{"step": 3, "eval/held/score": 0.5}])
    assert get(url + f"api/metrics?version={v}&from=3") | {"bad_lines": 0} == {
        "version": v,
        "reset": False,
        "rows": [{"step": 3, "eval/held/score": 0.5}],
        "next": 4,
        "bad_lines": 0,
    }
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}], mode="w")  # a rewritten file
    again = get(url + f"api/metrics?version={v}&after=3")
    assert again["reset"] is True and again["version"] != v and again["rows"] == [{"step": 1, "reward/mean": 0.5}]

    dist = get(url + "api/distribution")
    assert dist["steps"] == [
        {"step": 2, "n": 3, "values": {"score": [0.0, 1.0, 2.0], "reward/f": [None] * 3, "advantage": [0] * 3}}
    ]
    assert get(url + "api/samples?step=2")["rows"] == samples
    assert get(url + "api/samples?step=5")["rows"] == []
    with pytest.raises(urllib.error.HTTPError, match="400"):
        get(url + "api/samples")


def test_the_page_loads_nothing_from_the_internet(tmp_path, dashboard):
    url = dashboard(tmp_path)
    html = get(url).decode()
    js = get(url + "static/app.js").decode()
    srcs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert "/vendor/plotly.min.js" in srcs and all(s.startswith(("/", "data:")) for s in srcs), srcs
    assert not re.search(r"https?://", js)
    plotly = get(url + "vendor/plotly.min.js")
    assert len(plotly) > 1_000_000 and b"plotly.js" in plotly[:500]


def test_cli_errors_name_the_problem(tmp_path):
    cmd = [sys.executable, "-m", "hybridrl.cli", "dashboard"]
    out = subprocess.run([*cmd, str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "RUN_DIR" in out.stderr and "is not a directory" in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([*cmd, str(tmp_path), "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port 0" in out.stderr


def send(url: str, path: str, headers: dict | None = None, full: bool = False):
    """(status, reply) of a GET with exactly these headers beside Host and the dashboard's token (a None
    value: left out); ``full``: (status, reply, response headers)."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    for key, value in ({"Host": f"{host}:{port}"} | token_of(url) | (headers or {})).items():
        if value is not None:
            conn.putheader(key, value)
    conn.endheaders()
    response = conn.getresponse()
    body = response.read()
    conn.close()
    reply = json.loads(body) if response.getheader("Content-Type") == "application/json" else body
    return (response.status, reply, response.headers) if full else (response.status, reply)


def test_every_request_needs_the_token_which_the_printed_url_sets_as_a_cookie(tmp_path, dashboard):
    """Any user of this machine reaches 127.0.0.1: without the token the run's samples, config and
    even the page get 401; the URL printed carries it, and a page loaded with it gets an HttpOnly,
    SameSite=Strict cookie that its own requests then carry."""
    write_jsonl(tmp_path / "samples.jsonl", [{"step": 1, "prompt": "private", "response": "r"}])
    url = dashboard(tmp_path)
    token, port = TOKENS[url], url.rstrip("/").rsplit(":", 1)[1]
    assert len(token) >= 40
    none = {"Authorization": None}
    for path in ("/", "/api/run", "/api/samples?step=1", "/static/app.js", "/vendor/plotly.min.js"):
        status, reply = send(url, path, none)
        assert status == 401 and "?token=" in reply["error"] and "Bearer" in reply["error"], path
    for wrong in ({"Authorization": "Bearer nope"}, {"Authorization": None, "Cookie": f"hybridrl_dashboard_{port}=x"}):
        assert send(url, "/api/samples?step=1", wrong)[0] == 401
    assert send(url, "/api/samples?step=1")[1]["rows"][0]["prompt"] == "private"  # Authorization: Bearer
    status, page, headers = send(url, f"/?token={token}", none, full=True)
    assert status == 200 and b"<html" in page
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"hybridrl_dashboard_{port}={token};") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie and "Path=/" in cookie
    kept = {"Authorization": None, "Cookie": cookie.split(";")[0]}
    assert send(url, "/api/samples?step=1", kept)[0] == send(url, "/static/app.js", kept)[0] == 200
    # wrong tokens from one address are throttled; the right one is still answered
    codes = [send(url, "/api/run", {"Authorization": f"Bearer guess{i}"})[0] for i in range(12)]
    assert 429 in codes and codes[0] == 401
    assert send(url, "/api/run")[0] == send(url, "/api/run", kept)[0] == 200


def test_the_token_can_be_given_or_turned_off(tmp_path, dashboard):
    url = dashboard(tmp_path, env=dict(os.environ, HYBRIDRL_DASHBOARD_TOKEN="chosen token/with: odd chars"))
    assert TOKENS[url] == "chosen token/with: odd chars"  # printed quoted in the URL, the same token
    assert send(url, "/api/run")[0] == 200 and send(url, "/api/run", {"Authorization": None})[0] == 401
    url = dashboard(tmp_path, "--no-token")
    assert url not in TOKENS and send(url, "/api/run")[0] == 200
    proc = dashboard.procs[-1]
    proc.terminate()
    proc.wait(timeout=30)
    assert "--no-token: every user of this machine can read the run's samples" in proc.stderr.read()
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "dashboard", str(tmp_path), "--host", "0.0.0.0", "--no-token"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "accepts connections from other machines, and no token is set" in out.stderr


def test_only_this_machines_names_are_answered(tmp_path, dashboard, monkeypatch):
    """A page elsewhere, or one that reached 127.0.0.1 by DNS rebinding, cannot read the run."""
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    url = dashboard(tmp_path)
    port = url.rstrip("/").rsplit(":", 1)[1]
    assert send(url, "/api/run")[0] == 200
    assert send(url, "/api/run", {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"})[0] == 200
    for headers, message in [
        ({"Host": f"attacker.example:{port}"}, f"Host 'attacker.example:{port}' is not a name of this server"),
        ({"Origin": "http://attacker.example"}, "Origin 'http://attacker.example' may not call this server"),
    ]:
        status, reply = send(url, "/api/run", headers)
        assert status == 403 and message in reply["error"], headers
    url = dashboard(tmp_path, "--allow-host", "runs.example.com")
    assert send(url, "/api/run", {"Host": "runs.example.com", "Origin": "https://runs.example.com"})[0] == 200


def test_secrets_are_redacted_in_config_yaml_and_on_the_page(tmp_path, dashboard, monkeypatch):
    monkeypatch.setenv("MY_VLLM_KEY", "sk-from-the-environment")
    data = {
        "model": {"path": "m"},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rollout": {"engine": "vllm", "base_url": "http://127.0.0.1:9", "api_key": "${env:MY_VLLM_KEY}"},
        "rewards": [
            {"function": "remote", "url": "http://127.0.0.1:9", "token": "plain-secret", "check_health": False}
        ],
    }
    cfg = load_config(data=data)
    assert cfg.rollout.options.api_key.get_secret_value() == "sk-from-the-environment"
    dumped = yaml.safe_load(dump_config(cfg))
    assert dumped["rollout"]["api_key"] == "${env:MY_VLLM_KEY}" and dumped["rewards"][0]["token"] == "<redacted>"
    assert dumped["rollout"]["max_tokens"] == cfg.rollout.max_tokens  # numbers named *tokens stay
    with pytest.raises(ConfigError, match=r"rewards\.0\.token is '<redacted>'.*'\$\{env:VAR\}'"):
        load_config(data=dumped)
    dumped["rewards"][0]["token"] = "given again"
    assert load_config(data=dumped).rollout.options.api_key.get_secret_value() == "sk-from-the-environment"  # again
    with pytest.raises(ConfigError, match="rollout.api_key is '.*', but the environment variable NOPE is not set"):
        load_config(data=data | {"rollout": data["rollout"] | {"api_key": "${env:NOPE}"}})
    secrets = ["api_key", "hf_token", "clientSecret", "db-password"]
    assert [k for k in secrets if is_secret(k)] == secrets
    assert not any(is_secret(k) for k in ("max_tokens", "token_env", "tokenizer", "stop_token_ids", "keys"))
    # a run written before redaction existed: the page shows no secret either
    run = tmp_path / "run"
    run.mkdir()
    old = {"rollout": {"api_key": "sk-old", "engine_kwargs": {"hf_token": "hf_old"}}, "trainer": {"steps": 3}}
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    info = get(dashboard(run) + "api/run")
    assert "sk-old" not in info["config"] and "hf_old" not in info["config"] and info["total_steps"] == 3
    assert yaml.safe_load(info["config"])["rollout"]["api_key"] == "<redacted>"


def test_a_connection_that_sends_no_whole_request_is_closed(tmp_path, monkeypatch):
    import uvicorn
    from hybridrl_dashboard import server as dash

    monkeypatch.setattr(dash, "REQUEST_TIMEOUT", 0.5)
    sock = dash.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = dash.create_app(tmp_path, hosts=HostCheck("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, http=dash.timed_protocol(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            assert silent.recv(100) == b""  # closed, nothing sent
        closed = False
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(100):  # a header line every 0.1 s, never the end of the headers
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
        assert closed
        assert send(f"http://127.0.0.1:{port}", "/api/run")[0] == 200  # whole requests are answered
    finally:
        server.should_exit = True
        thread.join(30)


# --- the page in a browser, on a real run ----------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium and the playwright package; absent: a skip here, a failure in CI.

    Module-scoped and named first, so that it is checked before the run is made."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    missing = []
    if chromium is None:
        missing.append("chromium (run scripts/install_browser.sh)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install playwright; no 'playwright install' needed)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ": CI must install it")
        pytest.skip(reason)
    return chromium


@pytest.fixture(scope="module")
def real_run_dir(tiny_model, tmp_path_factory):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("dash") / "run"
    cfg = load_config(
        data={
            "model": {"path": tiny_model},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
            "rollout": {"engine": "hf", "n": N, "max_tokens": 8},
            "rewards": [{"function": "format", "pattern": "7"}, {"function": "answer_match", "weight": 0.5}],
            "algorithm": {"name": "grpo", "kl_coef": 0.01},
            "trainer": {
                "steps": STEPS,
                "prompts_per_step": PROMPTS,
                "lr": 1e-2,
                "run_dir": str(run_dir),
                "sample_every": 1,
            },
            "logging": {"loggers": ["jsonl"]},
        }
    )
    Trainer(build_run(cfg)).train()
    return run_dir


def chart(page, chart_id: str, trace_name: str, axis: str = "x"):
    return page.evaluate(
        "([id, name, axis]) => { const t = document.getElementById(id).data.find(t => t.name === name);"
        " return t ? Array.from(t[axis]) : null; }",
        [chart_id, trace_name, axis],
    )


def test_dashboard_in_a_browser_shows_a_real_run_and_follows_it(chromium, real_run_dir, dashboard, tmp_path):
    from playwright.sync_api import sync_playwright

    metrics = metrics_rows(real_run_dir)
    samples = [json.loads(line) for line in (real_run_dir / "samples.jsonl").read_text().splitlines()]
    url = dashboard(real_run_dir, "--poll", "0.5")
    requested = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda r: requested.append(r.url))
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}?token={TOKENS[url]}")  # the URL the command printed
            page.wait_for_function(
                f"document.querySelectorAll('#samples tbody tr').length === {PROMPTS * N}", timeout=30_000
            )
            assert page.url == url  # the token went into the cookie, out of the address bar

            # the curves hold one point per step, with the logged values
            assert chart(page, "chart-reward", "mean") == [1, 2, 3]
            assert chart(page, "chart-reward", "mean", "y") == pytest.approx([m["reward/mean"] for m in metrics])
            assert chart(page, "chart-kl", "actor/kl", "y") == pytest.approx([m["actor/kl"] for m in metrics])
            assert chart(page, "chart-length", "mean", "y") == pytest.approx(
                [m["response_length/mean"] for m in metrics]
            )
            # the distribution: every sample's score, at its step
            assert sorted(zip(chart(page, "chart-dist", "score"), chart(page, "chart-dist", "score", "y"))) == sorted(
                (s["step"], s["score"]) for s in samples
            )
            # the sample browser follows the latest step and shows its responses
            assert page.input_value("#sample-step") == "3"
            cells = page.eval_on_selector_all(
                "#samples tbody tr",
                "rows => rows.map(r => r.children[[...r.parentNode.parentNode.tHead.rows[0].children]"
                ".findIndex(th => th.textContent.startsWith('response'))].textContent)",
            )
            assert cells == [s["response"] for s in samples if s["step"] == 3]
            assert "step 3/3" in page.text_content("#status")

            # the run goes on: a new step appears without reloading the page
            new = dict(metrics[-1], step=4, **{"reward/mean": 0.875})
            write_jsonl(real_run_dir / "metrics.jsonl", [new])
            write_jsonl(
                real_run_dir / "samples.jsonl",
                [dict(s, step=4, response=f"appended {i}") for i, s in enumerate(x for x in samples if x["step"] == 3)],
            )
            page.wait_for_function(
                "document.getElementById('chart-reward').data.find(t => t.name === 'mean').x.length === 4",
                timeout=30_000,
            )
            assert chart(page, "chart-reward", "mean", "y")[-1] == pytest.approx(0.875)
            # an evaluation's row, after its step's: merged into the step, drawn beside the reward
            assert page.is_visible("#no-eval")
            evaluated = {"step": 4, "time": new["time"], "eval/held/score": 0.5, "eval/held/mean@1": 0.25}
            write_jsonl(real_run_dir / "metrics.jsonl", [evaluated])
            page.wait_for_function(
                "document.getElementById('chart-eval').data.some(t => t.name === 'held mean@1')", timeout=30_000
            )
            assert (chart(page, "chart-eval", "held mean@1"), chart(page, "chart-eval", "held mean@1", "y")) == (
                [4],
                [0.25],
            )
            assert chart(page, "chart-reward", "eval held", "y") == [0.5] and not page.is_visible("#no-eval")
            assert chart(page, "chart-reward", "mean", "y")[-1] == pytest.approx(0.875)  # the step's own row stays
            page.wait_for_function("document.querySelector('#sample-step').value === '4'", timeout=30_000)
            page.wait_for_function(
                "document.querySelector('#samples tbody').textContent.includes('appended 0')", timeout=30_000
            )
            page.reload()  # the cookie alone: the page and its requests still carry the token
            page.wait_for_function("document.querySelector('#samples tbody').textContent.includes('appended 0')")
            assert errors == []
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("HYBRIDRL_ARTIFACTS"):
        artifacts = Path(os.environ["HYBRIDRL_ARTIFACTS"])
        artifacts.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, artifacts / "dashboard.png")
    assert requested and all(u.startswith((url, "data:")) for u in requested), requested
