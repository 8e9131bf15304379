"""The python tool's sandbox: escapes an attacker tried against the old in-process audit hook, and
more, each refused or bounded; ordinary code still runs; the compiled module is cached."""

import dataclasses
import json
import os
import signal
import socket
import sysconfig
import time

import pytest
from hybridrl_reward_python import sandbox
from hybridrl_reward_python.sandbox import Limits, SandboxUnavailable, WasmSandbox
from hybridrl_reward_python.tool import PythonTool

TRAINER = os.getpid()


@pytest.fixture(scope="module")
def tool():
    return PythonTool(PythonTool.Options(timeout_s=5, cpu_s=2, memory_mb=256, file_mb=4, disk_mb=16), None)


@pytest.fixture(scope="module")
def quick():
    """Short limits, for the tests that run into them."""
    return PythonTool(PythonTool.Options(timeout_s=1, cpu_s=1, memory_mb=256), None)


def refused(tool, code: str) -> str:
    """The error the model sees for ``code``."""
    with pytest.raises((RuntimeError, TimeoutError)) as info:
        tool({"code": code})
    return str(info.value)


# -- what ordinary code needs -------------------------------------------------------------


def test_ordinary_code_runs(tool):
    assert tool({"code": "print(6 * 7)"}) == "42\n"
    code = (
        "import math, json, re, collections, fractions\nprint(json.dumps([math.gcd(12, 18), re.sub('a', 'b', 'aa')]))"
    )
    assert tool({"code": code}) == '[6, "bb"]\n'
    assert tool({"code": "x = 1"}) == "(no output)"
    code = (
        "import os, tempfile\nos.makedirs('d/e')\nopen('d/e/a.txt', 'w').write('hi')\n"
        "print(open('d/e/a.txt').read(), os.listdir('d/e'), os.getcwd(), tempfile.gettempdir())"
    )
    assert tool({"code": code}) == "hi ['a.txt'] /scratch /scratch\n"
    code = (
        "import sqlite3\nc = sqlite3.connect('db')\nc.execute('create table t(x)')\n"
        "c.execute('insert into t values (7)')\nprint(c.execute('select x from t').fetchone())"
    )
    assert tool({"code": code}) == "(7,)\n"


def test_errors_come_back_as_the_last_line_of_the_traceback(tool):
    assert refused(tool, "1 / 0") == "ZeroDivisionError: division by zero"
    assert refused(tool, "import sys; sys.exit(3)") == "exit status 3"


def test_each_call_starts_in_a_fresh_empty_folder(tool):
    tool({"code": "open('left.txt', 'w').write('x')"})
    assert tool({"code": "import os; print(os.listdir('.'))"}) == "[]\n"


def test_the_compiled_module_is_cached_and_a_broken_cache_is_replaced(tmp_path):
    limits = Limits(timeout_s=5, cpu_s=2, memory_mb=64, file_mb=1, disk_mb=1, output_bytes=100)
    cache = tmp_path / "cache"
    first = WasmSandbox(cache_dir=str(cache))
    assert first.run("print(1)", limits).stdout == "1\n" and first.compiles == 1
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    again = WasmSandbox(cache_dir=str(cache))  # another tool, another process: loads the cache
    assert again.run("print(2)", limits).stdout == "2\n" and again.compiles == 0
    with open(again.module_path, "wb") as f:
        f.write(b"not a module")
    assert again.run("print(3)", limits).stdout == "3\n" and again.compiles == 1


# -- escapes reported against the audit hook, and more ----------------------------------------

ESCAPES = {
    "read /etc/passwd": ("print(open('/etc/passwd').read())", "Capabilities insufficient"),
    "list /": ("import os; print(os.listdir('/'))", "Capabilities insufficient"),
    "the trainer's environment": (f"print(open('/proc/{TRAINER}/environ').read())", "Capabilities insufficient"),
    "the trainer's memory": (f"open('/proc/{TRAINER}/mem', 'r+b')", "Capabilities insufficient"),
    "own environ": ("print(open('/proc/self/environ').read())", "Capabilities insufficient"),
    "socket": ("import socket; socket.socket()", "Not supported"),
    "os.system": ("import os; os.system('id')", "no attribute 'system'"),
    "fork": ("import os\nwhile True: os.fork()", "no attribute 'fork'"),
    "exec": ("import os; os.execv('/bin/sh', ['sh'])", "no attribute 'execv'"),
    "subprocess": ("import subprocess; subprocess.run(['id'])", "wasi does not support processes"),
    "subprocess, audit stubbed": (
        "import subprocess, sys\nsubprocess.sys.audit = lambda *a: None\nsubprocess.run(['id'])",
        "wasi does not support processes",
    ),
    "ctypes": ("import ctypes", "No module named 'ctypes'"),
    "kill the parent": ("import os; os.kill(1, 9)", "no attribute 'kill'"),
    "pidfd_send_signal": (
        "import os, signal; signal.pidfd_send_signal(os.pidfd_open(1), 9)",
        "no attribute 'pidfd_send_signal'",
    ),
    "mkfifo": ("import os; os.mkfifo('f')", "no attribute 'mkfifo'"),
    "setxattr": ("import os; os.setxattr('.', 'user.x', b'1')", "no attribute 'setxattr'"),
    "threads": ("import threading; threading.Thread(target=print).start()", "can't start new thread"),
    "os.open with dir_fd, ..": (
        "import os\nfd = os.open('.', os.O_RDONLY)\nos.open('../x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "Operation not permitted",
    ),
    "symlink out, then read": ("import os; os.symlink('/etc', 'e'); print(os.listdir('e'))", "not permitted"),
    "relative symlink out": ("import os; os.symlink('../../../../etc', 'e'); print(os.listdir('e'))", "not permitted"),
    "write the standard library": ("open('/usr/local/lib/python311.zip', 'ab')", "not permitted"),
    "__main__ emptied first": (
        "import __main__\n__main__.__dict__.clear()\nprint(open('/etc/passwd').read())",
        "Capabilities insufficient",
    ),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escape_is_refused(tool, name):
    code, error = ESCAPES[name]
    assert error in refused(tool, code)


# Each writes to a host path given as {target}, which must not exist afterwards.
WRITES = {
    "open": "open({target!r}, 'w').write('x')",
    "os.open with dir_fd": "import os\nos.open({target!r}, os.O_WRONLY | os.O_CREAT, dir_fd=os.open('.', os.O_RDONLY))",
    "rename": "import os\nopen('a', 'w').close()\nos.rename('a', {target!r})",
    "hard link": "import os\nopen('a', 'w').close()\nos.link('a', {target!r})",
    "symlink, then write": "import os\nos.symlink({target!r}, 'a')\nopen('a', 'w').write('x')",
    "sqlite3": "import sqlite3; sqlite3.connect({target!r}).execute('create table t(x)')",
    "shutil.copy": "import shutil\nopen('a', 'w').close()\nshutil.copy('a', {target!r})",
}


@pytest.mark.parametrize("name", list(WRITES))
def test_writes_outside_the_folder_are_refused(tool, tmp_path, name):
    target = str(tmp_path / "escaped")
    refused(tool, WRITES[name].format(target=target))
    assert not os.path.lexists(target)


def test_a_pth_file_cannot_be_planted_in_the_environment(tool):
    target = os.path.join(sysconfig.get_paths()["purelib"], "hybridrl-sandbox-test.pth")
    refused(tool, f"open({target!r}, 'w').write('import os')")  # the error depends on where the venv lies
    assert not os.path.exists(target)


def test_the_trainers_files_cannot_be_read(tool, tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_text("weights")
    assert "Capabilities insufficient" in refused(tool, f"print(open({str(checkpoint)!r}).read())")
    # and this very test file
    assert "Error" in refused(tool, f"print(open({__file__!r}).read())")


def test_the_trainers_environment_is_not_passed(tool, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_TOKEN", "hf_secret")
    env = json.loads(tool({"code": "import os, json; print(json.dumps(dict(os.environ)))"}))
    assert "HYBRIDRL_TEST_TOKEN" not in env and "hf_secret" not in json.dumps(env)
    assert set(env) <= {"PYTHONHOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "HOME", "TMPDIR"}


def test_loopback_tcp_is_unreachable(tool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        assert "Not supported" in refused(tool, f"import socket; socket.socket().connect(('127.0.0.1', {port}))")
        with pytest.raises(TimeoutError):
            server.accept()


# -- limits -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, error",
    [
        ("while True: pass", "more than 1 s of CPU"),
        (
            "import sys\nsys.setrecursionlimit(10**7)\ndef f(n): return f(n + 1)\nf(0)",
            "more than 1 s of CPU|MemoryError",
        ),
        ("import time; time.sleep(30)", "longer than 1 s"),  # blocked in a host call: no interrupt reaches it
        ("import time\nwhile True: time.sleep(0.01)", "longer than 1 s"),
    ],
)
def test_time_is_bounded(quick, code, error):
    start = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError), match=error):
        quick({"code": code})
    assert time.monotonic() - start < 10  # the limit plus the grace, on a slow machine


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(2**30)",
        "x = []\nwhile True: x.append(bytearray(2**20))",
        "print('x' * 2**40)",
    ],
)
def test_memory_is_bounded(tool, code):
    assert refused(tool, code).startswith(("MemoryError", "OverflowError"))


def test_file_size_and_the_folders_total_are_bounded(tool):
    assert "File too large" in refused(tool, "open('big', 'wb').write(b'x' * (5 << 20))")
    code = "for i in range(1000): open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    assert refused(tool, code) == "the program wrote more than 16 MiB of files and was stopped"
    assert "more than 16 MiB" in refused(tool, "import os\nfor i in range(10**6): os.mkdir(f'd{i}')")


def _peak_rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc")
def test_huge_output_is_read_with_a_cap(tool):
    before = _peak_rss_mb()
    out = tool({"code": "import sys\nline = 'y' * (1 << 20)\nfor _ in range(256): sys.stdout.write(line)"})
    assert out == "y" * 2000 + "\n(output cut at 2000 characters)"
    assert _peak_rss_mb() - before < 64  # 256 MiB printed; the trainer keeps 8 KiB of it


def test_a_long_traceback_keeps_its_last_line(tool):
    code = "import sys\nsys.stderr.write('noise\\n' * 10**6)\nraise KeyError('the end')"
    assert refused(tool, code) == "KeyError: 'the end'"


# -- without the sandbox --------------------------------------------------------------------


def test_without_wasmtime_the_tool_refuses_to_start_and_names_the_fix(monkeypatch):
    real = sandbox.importlib.util.find_spec
    monkeypatch.setattr(sandbox.importlib.util, "find_spec", lambda name: None if name == "wasmtime" else real(name))
    sandbox._runtime.cache_clear()
    try:
        with pytest.raises(
            SandboxUnavailable, match=r"wasmtime is not installed.*pip install 'hybridrl-reward-python\[sandbox\]'"
        ):
            PythonTool(PythonTool.Options(), None)
    finally:
        sandbox._runtime.cache_clear()


def test_a_sandbox_that_cannot_run_code_stops_the_tool_at_start(monkeypatch):
    monkeypatch.setattr(sandbox, "_CHECK_LIMITS", dataclasses.replace(sandbox._CHECK_LIMITS, memory_mb=1))
    with pytest.raises(SandboxUnavailable, match="the sandbox cannot run Python: .*memory"):
        PythonTool(PythonTool.Options(), None)


def test_sandbox_none_warns_and_still_bounds_time_and_output(capfd):
    tool = PythonTool(PythonTool.Options(sandbox="none", timeout_s=2, cpu_s=1), None)
    assert "without a sandbox" in capfd.readouterr().err
    assert tool({"code": "print(6 * 7)"}) == "42\n"
    assert "more than 1 s of CPU" in refused(tool, "while True: pass")
    # a child in a session of its own keeps stdout open: the call still ends when the program does
    code = "import subprocess\np = subprocess.Popen(['sleep', '20'], start_new_session=True)\nprint(p.pid)"
    start = time.monotonic()
    pid = int(tool({"code": code}))
    try:
        assert time.monotonic() - start < 10  # it used to wait for the child: 20 s
    finally:
        os.kill(pid, signal.SIGKILL)
