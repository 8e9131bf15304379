"""The remote reward's limits, against a scripted service on 127.0.0.1."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hybridrl_http.client import ServiceError


class Answers(BaseHTTPRequestHandler):
    """Answers every POST with ``Answers.body`` (bytes) and every GET with a health answer."""

    body = b""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(json.dumps({"status": "ok"}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(Answers.body)

    def _reply(self, data: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # a client that refused the answer unread
            pass


@pytest.fixture
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_reads_at_most_max_answer_mb_of_an_answer(service, make_reward, make_batch):
    """An answer past the limit (16 MiB by default) is refused unread, naming the URL, the limit and the
    option that raises it: a batch's scores take a few KiB, so more is a wrong URL or a faulty service."""
    batch = make_batch(["q", "q"], ["a", "b"])
    Answers.body = json.dumps({"scores": [0.5, 1.0], "padding": "x" * 16 * 2**20}).encode()
    reward = make_reward("remote", url=service, retries=0)
    with pytest.raises(
        ServiceError,
        match=rf"reward function 'remote' \({service}\): {service}/score answered more than 16777216 bytes "
        r"\(16 MiB\), the most read; raise max_answer_mb if its answers are that large\.",
    ):
        reward.score(batch)
    assert make_reward("remote", url=service, retries=0, max_answer_mb=17).score(batch) == [0.5, 1.0]
    Answers.body = json.dumps({"scores": [0.5, 1.0], "padding": "x" * 2048}).encode()
    with pytest.raises(ServiceError, match=r"answered more than 1024 bytes \(0.0009765\d* MiB\)"):
        make_reward("remote", url=service, retries=0, max_answer_mb=1 / 1024).score(batch)


def test_remote_refuses_answers_json_cannot_hold(service, make_reward, make_batch):
    """Nesting deeper than Python decodes and integers past int()'s 4300 digits are a ServiceError
    naming the URL, not a RecursionError or ValueError from the JSON decoder."""
    batch = make_batch(["q", "q"], ["a", "b"])
    reward = make_reward("remote", url=service, retries=0)
    for body in ("[" * 100_000 + "]" * 100_000, '{"scores": [' + "7" * 5000 + ", 1]}", "not json"):
        Answers.body = body.encode()
        with pytest.raises(ServiceError, match=rf"reward function 'remote' \({service}\): {service}/score did not"):
            reward.score(batch)
