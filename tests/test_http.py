"""The service client against a real HTTP server on localhost."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridrl.http import ServiceError, get_json, post_json


class Handler(BaseHTTPRequestHandler):
    fails_left = 0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
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
