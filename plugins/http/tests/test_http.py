"""The service client against a real HTTP server on localhost, and what hybridrl's servers check
(Host and Origin, Content-Length, the token before the body, throttled guesses, timeouts)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hybridrl_http.client import ServiceError, get_json, post_json
from hybridrl_http.server import ALLOWED_HOSTS_ENV, FailedTokens, HostCheck, JsonHandler, JsonServer, listen, split_port
from hybridrl_testing import raw_request


class Handler(BaseHTTPRequestHandler):
    fails_left = 0
    redirect = None  # (code, location) that /moved answers

    def log_message(self, *args):
        pass

    def _moved(self) -> bool:
        if self.path != "/moved" or Handler.redirect is None:
            return False
        code, location = Handler.redirect
        self.send_response(code)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._moved():
            return
        if self.path == "/flaky" and Handler.fails_left > 0:
            Handler.fails_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        if self.path == "/bad":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"missing field 'text'")
            return
        out = json.dumps({"echo": body, "auth": self.headers.get("Authorization")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        if self._moved():
            return
        out = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_round_trip_with_token(server):
    out = post_json(f"{server}/x", {"a": [1, 2]}, component="test", token="s3cret")
    assert out == {"echo": {"a": [1, 2]}, "auth": "Bearer s3cret"}
    assert get_json(f"{server}/health", component="test") == {"ok": True}


def test_retries_server_errors(server):
    Handler.fails_left = 2
    assert post_json(f"{server}/flaky", {}, component="test", backoff=0.01)["echo"] == {}


def test_gives_up_with_a_message_naming_the_component(server):
    Handler.fails_left = 10
    with pytest.raises(ServiceError, match=r"my reward: .*/flaky failed after 2 attempts \(HTTP 503"):
        post_json(f"{server}/flaky", {}, component="my reward", retries=1, backoff=0.01)


def test_client_errors_fail_at_once_with_the_servers_message(server):
    with pytest.raises(ServiceError, match="HTTP 400: missing field 'text'"):
        post_json(f"{server}/bad", {}, component="test")


def test_nothing_listening():
    with pytest.raises(ServiceError, match="failed after 1 attempts.*Is the server running"):
        post_json("http://127.0.0.1:9/x", {}, component="test", retries=0, timeout=2)


# -- what every server checks (hybridrl_http.server.JsonHandler through listen) ----------------------


class Echo(JsonHandler):
    public = frozenset({("GET", "/open")})

    def routes(self):
        return {
            ("GET", "/health"): lambda: {"ok": True},
            ("GET", "/open"): lambda: {"open": True},
            ("POST", "/echo"): lambda body: {"echo": body},
            ("POST", "/boom"): self.boom,
        }

    def boom(self, body):
        raise RuntimeError("details only the server's log may show: /srv/secret.key")


@pytest.fixture
def echo(monkeypatch):
    """Start an Echo server on 127.0.0.1 (listen's keywords: token, allow, timeout...); its port."""
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    started = []

    def start(**options):
        srv = listen("test", "127.0.0.1", 0, Echo, **{"max_body": 1024, "timeout": 2.0} | options)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv.server_address[1]

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def call(port, method, path, body=None, headers=None):
    """(status, decoded reply, response headers) of a JSON request: ``headers`` override the
    defaults; a None value leaves one out."""
    data = None if body is None else json.dumps(body).encode()
    sent = {} if data is None else {"Content-Type": "application/json", "Content-Length": str(len(data))}
    return raw_request(f"http://127.0.0.1:{port}", method, path, data, sent | (headers or {}))


def test_content_length_is_checked_before_any_body_is_read(echo):
    port = echo()
    json_type = {"Content-Type": "application/json"}
    cases = [
        ({"Content-Length": "-1"}, 400, "Content-Length must be one number"),
        ({"Content-Length": "12abc"}, 400, "Content-Length must be one number"),
        ({"Content-Length": "+5"}, 400, "Content-Length must be one number"),
        ({"Content-Length": None}, 411, "needs a Content-Length"),
        ({"Content-Length": None, "Transfer-Encoding": "chunked"}, 411, "chunked bodies are not accepted"),
        ({"Content-Length": str(8 * 2**20)}, 413, "body of 8388608 bytes is over the limit of 1024 bytes"),
    ]
    for headers, code, message in cases:  # no body is sent: a server that tried to read it would hang
        status, reply, replied = call(port, "POST", "/echo", headers=json_type | headers)
        assert status == code and message in reply["error"], headers
        announced = headers.get("Content-Length") or headers.get("Transfer-Encoding")
        assert replied.get("Connection") == ("close" if announced else None)  # the rest is no request
    status, reply, _ = call(port, "POST", "/echo", {"a": 1}, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in reply["error"]
    assert call(port, "POST", "/echo", {"a": [1, 2]})[:2] == (200, {"echo": {"a": [1, 2]}})


def test_host_and_origin_must_name_this_machine(echo, monkeypatch):
    port = echo()
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
        assert call(port, "GET", "/health", headers={"Host": host})[0] == 200, host
    assert call(port, "POST", "/echo", {}, {"Origin": f"http://localhost:{port}"})[0] == 200
    refused = [
        ({"Host": f"attacker.example:{port}"}, f"Host 'attacker.example:{port}' is not a name of this server"),
        ({"Host": f"127.0.0.1:{port + 1}"}, "is not a name of this server"),
        ({"Host": None}, "one Host header"),
        ({"Origin": "http://attacker.example"}, "Origin 'http://attacker.example' may not call this server"),
        ({"Origin": "null"}, "Origin 'null'"),
    ]
    for headers, message in refused:
        status, reply, _ = call(port, "POST", "/echo", {"rate": 1}, headers)
        assert status == 403 and message in reply["error"] and "\n" not in reply["error"], headers
        assert "HYBRIDRL_ALLOWED_HOSTS" in reply["error"] or headers == {"Host": None}
    # other names: listen's allow, and the environment variable
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "chat.example.com, 10.1.2.3:8443")
    port = echo(allow=("https://rl.example.org",))
    for headers in (
        {"Host": "chat.example.com", "Origin": "https://chat.example.com"},
        {"Host": f"chat.example.com:{port}"},
        {"Host": "10.1.2.3:8443", "Origin": "http://10.1.2.3:8443"},
        {"Host": "rl.example.org", "Origin": "https://rl.example.org"},
    ):
        assert call(port, "GET", "/health", headers=headers)[0] == 200, headers
    assert call(port, "GET", "/health", headers={"Host": "10.1.2.3"})[0] == 403  # that name on 8443 only


def test_host_check_entries():
    check = HostCheck("0.0.0.0", 8000, ["Example.com", "[fe80::1]:9000", "https://a.example", ""])
    assert check.refusal(["example.com:8000"], ["https://example.com"]) is None
    assert check.refusal(["[fe80::1]:9000"], None) is None
    assert check.refusal(["a.example"], ["https://a.example"]) is None
    assert check.refusal(["a.example"], ["http://a.example"]) is not None
    assert check.refusal(["0.0.0.0:8000"], None) is not None  # 'every address' is no name
    assert HostCheck("10.0.0.5", 8000).refusal(["10.0.0.5:8000"], None) is None  # the bound address
    assert HostCheck("127.0.0.1", 80).refusal(["localhost"], ["http://localhost"]) is None
    assert HostCheck("127.0.0.1", 8000, ["*"]).refusal(["anything"], ["http://anywhere"]) is None
    assert split_port("[::1]:8000") == ("[::1]", 8000) and split_port("::1") == ("[::1]", None)


def test_the_token_is_checked_before_the_body_and_guesses_are_throttled(echo):
    port = echo(token="s3cret")
    # a body is announced and never sent: the wrong token is answered without waiting for it
    announced = {"Content-Type": "application/json", "Content-Length": "1000"}
    status, reply, headers = call(port, "POST", "/echo", headers=announced)
    assert status == 401 and "Bearer" in reply["error"] and headers.get("Connection") == "close"
    good = {"Authorization": "Bearer s3cret"}
    assert call(port, "POST", "/echo", {"x": 1}, good)[:2] == (200, {"echo": {"x": 1}})
    assert call(port, "GET", "/open")[0] == 200  # an endpoint the server made public
    for variant in ("bearer s3cret", "Bearer  s3cret", "Bearer s3cret ", "s3cret", "Basic czNjcmV0"):
        assert call(port, "GET", "/health", headers={"Authorization": variant})[0] == 401, variant
    for i in range(FailedTokens().limit - 6):  # 6 failures above
        assert call(port, "GET", "/health", headers={"Authorization": f"Bearer guess{i}"})[0] == 401
    status, reply, headers = call(port, "GET", "/health", headers={"Authorization": "Bearer guess"})
    assert status == 429 and "too many wrong tokens" in reply["error"]
    assert 0 < int(headers.get("Retry-After")) <= 60
    assert call(port, "GET", "/health", headers=good)[0] == 200  # the right token is never locked out
    assert call(port, "GET", "/open", headers={"Authorization": "Bearer guess"})[0] == 429  # a sent token is checked
    other = echo(token="s3cret")  # another server, its own count
    assert call(other, "GET", "/health", headers=good)[0] == 200


def test_failed_tokens_window():
    failures = FailedTokens(limit=2, window=0.2, addresses=2)
    failures.failed("a")
    assert failures.wait("a") == 0
    failures.failed("a")
    assert 0 < failures.wait("a") <= 0.2 and failures.wait("b") == 0
    failures.failed("b")
    failures.failed("b")
    failures.failed("c")  # three addresses: the oldest is forgotten
    assert list(failures.times) == ["b", "c"] and failures.wait("a") == 0 and failures.wait("b") > 0
    deadline = time.monotonic() + 5
    while failures.wait("b") and time.monotonic() < deadline:
        time.sleep(0.05)
    failures.failed("b")
    assert failures.wait("b") == 0  # the old failures left the window: one of two now


def test_internal_errors_are_logged_with_an_id_and_not_sent(echo, capfd):
    port = echo()
    status, reply, _ = call(port, "POST", "/boom", {})
    assert status == 500 and "secret" not in json.dumps(reply) and "RuntimeError" not in json.dumps(reply)
    err = capfd.readouterr().err
    assert f"error id {reply['error_id']}" in err and "/srv/secret.key" in err
    status, reply, _ = call(port, "GET", "/nothing")
    assert status == 404 and "use GET /health, GET /open" in reply["error"]


def test_slow_and_silent_connections_are_closed(echo):
    port = echo(timeout=0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
        assert silent.recv(100) == b""  # closed by the server, with nothing sent
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(100):  # a header line every 0.1 s: within the per-read timeout, never done
            try:
                slow.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        if not closed:
            slow.settimeout(0.1)
            try:
                closed = slow.recv(100) == b""
            except TimeoutError:
                pass
    assert closed
    with socket.create_connection(("127.0.0.1", port), timeout=10) as partial:  # a body that stops short
        head = f"POST /echo HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        partial.sendall(head.encode() + b'Content-Length: 10\r\n\r\n{"a')
        assert partial.recv(4096).startswith(b"HTTP/1.1 408 ")


def test_many_simultaneous_connections_are_all_answered(echo):
    assert JsonServer.request_queue_size >= 128
    port = echo()
    start, results = threading.Barrier(200), []

    def one():
        start.wait()
        try:
            results.append(call(port, "GET", "/health")[0])
        except OSError as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=one) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 200


# -- the client follows no redirect ------------------------------------------------------------


def test_redirects_are_not_followed_with_the_token(server):
    seen = []

    class Elsewhere(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{other.server_address[1]}/steal"
    try:
        for code in (301, 302, 307, 308):
            Handler.redirect = (code, target)
            with pytest.raises(ServiceError, match=rf"answered HTTP {code}, a redirect to {target}.*not followed"):
                post_json(f"{server}/moved", {"a": 1}, component="test", token="s3cret", backoff=0.01)
            with pytest.raises(ServiceError, match="redirect"):
                get_json(f"{server}/moved", component="test", token="s3cret")
        assert seen == []
    finally:
        Handler.redirect = None
        other.shutdown()


def test_answers_over_the_size_limit_fail(server):
    with pytest.raises(ServiceError, match="answered more than 5 bytes"):
        get_json(f"{server}/health", component="test", max_bytes=5)
