"""The python tool's sandbox: escapes an attacker tried against the old in-process audit hook, and
more, each refused or bounded; ordinary code still runs; the compiled module is cached."""

import dataclasses
import json
import os
import socket
import sys
import sysconfig
import tempfile

import pytest
from hybridrl_reward_python import sandbox, sandbox_child, scratch
from hybridrl_reward_python.sandbox import Limits, SandboxUnavailable, WasmSandbox
from hybridrl_reward_python.tool import PythonTool
from hybridrl_testing import alive

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


LIMITS = Limits(timeout_s=5, cpu_s=2, memory_mb=64, file_mb=1, disk_mb=1, output_bytes=100)


def test_the_compiled_module_is_cached_and_a_broken_cache_is_replaced(tmp_path):
    limits = LIMITS
    cache = tmp_path / "cache"
    first = WasmSandbox(cache_dir=str(cache))
    assert first.run("print(1)", limits).stdout == "1\n" and first.compiles == 1
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    again = WasmSandbox(cache_dir=str(cache))  # another tool, another process: loads the cache
    assert again.run("print(2)", limits).stdout == "2\n" and again.compiles == 0
    with open(again.module_path, "wb") as f:
        f.write(b"not a module")
    assert again.run("print(3)", limits).stdout == "3\n" and again.compiles == 1
    assert oct(os.stat(again.module_path).st_mode & 0o777) == "0o600"


def test_a_compile_cache_others_can_write_is_not_loaded_and_the_error_names_it(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    box = WasmSandbox(cache_dir=str(cache))
    cache.mkdir()
    planted = cache / os.path.basename(box.module_path)
    planted.write_bytes(b"planted machine code")
    cache.chmod(0o777)
    started = []
    monkeypatch.setattr(sandbox, "_spawn", lambda *a, **k: started.append(a) or pytest.fail("a child was started"))
    refusal = rf"{cache} can be written by other users \(mode 777\).*Remove {cache}"
    with pytest.raises(SandboxUnavailable, match=refusal):
        box.run("print(1)", LIMITS)
    assert started == [] and planted.read_bytes() == b"planted machine code"  # neither loaded nor replaced


def test_the_child_refuses_an_untrusted_cache_even_when_the_trainer_checked_it_before(tmp_path, monkeypatch):
    """A folder or file swapped in after the trainer's check: the loader checks what it opens."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    module = cache / "module.cwasm"
    module.write_bytes(b"planted machine code")
    module.chmod(0o600)
    os.close(sandbox_child.open_trusted(str(module)))  # this user's, and nobody else can write it
    for path, mode in ((module, 0o666), (cache, 0o777)):
        path.chmod(mode)
        with pytest.raises(PermissionError, match=rf"{path} can be written by other users \(mode {mode:o}\)"):
            sandbox_child.open_trusted(str(module))
    # through the child itself, the trainer's check skipped: it reports the cache untrusted, loads nothing
    box = WasmSandbox(cache_dir=str(cache))
    os.replace(module, box.module_path)
    monkeypatch.setattr(sandbox_child, "untrusted", lambda path, st: None)  # in the trainer only
    with pytest.raises(SandboxUnavailable, match=rf"cannot load its compiled module .*: {cache} can be written"):
        box.run("print(1)", LIMITS)
    assert open(box.module_path, "rb").read() == b"planted machine code" and box.compiles == 0


def test_a_module_others_could_write_is_compiled_again(tmp_path, capfd, monkeypatch):
    cache = tmp_path / "cache"
    box = WasmSandbox(cache_dir=str(cache))
    cache.mkdir(mode=0o700)
    with open(box.module_path, "wb") as f:
        f.write(b"planted machine code")
    os.chmod(box.module_path, 0o666)
    calls = []
    run_once = WasmSandbox._run_once
    monkeypatch.setattr(WasmSandbox, "_run_once", lambda self, *a: calls.append(1) or run_once(self, *a))
    assert box.run("print(1)", LIMITS).stdout == "1\n"
    assert calls == [1] and box.compiles == 1  # never tried: compiled again first
    assert f"{box.module_path} can be written by other users (mode 666): not loaded" in capfd.readouterr().err
    assert oct(os.stat(box.module_path).st_mode & 0o777) == "0o600"


def test_a_cache_of_another_user_is_not_trusted(tmp_path, monkeypatch):
    st = os.stat(tmp_path)
    assert sandbox_child.untrusted(str(tmp_path), st) is None
    monkeypatch.setattr(os, "getuid", lambda: st.st_uid + 1)
    why = sandbox_child.untrusted(str(tmp_path), st)
    assert why == f"{tmp_path} belongs to user id {st.st_uid}, not to this user ({st.st_uid + 1})"


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
def test_time_is_bounded(code, error):
    """Each limit alone stops the program: the other is far (on a loaded machine a program busy for 1 s of
    CPU takes longer than 1 s of wall time)."""
    cpu = "CPU" in error
    tool = PythonTool(PythonTool.Options(timeout_s=1 if not cpu else 60, cpu_s=1 if cpu else 60, memory_mb=256), None)
    with pytest.raises((TimeoutError, RuntimeError), match=error):  # the message names the limit that stopped it
        tool({"code": code})


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


# The program starts a daemon that keeps stdout open (the child forks and exits, the grandchild leaves
# the session and writes its pid to {pidfile}), then ends, or runs into the time limit.
DAEMON = """
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        with open({pidfile!r} + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.rename({pidfile!r} + ".part", {pidfile!r})
        time.sleep(600)
        os._exit(0)
    os._exit(0)
os.wait()
while not os.path.exists({pidfile!r}):
    time.sleep(0.01)
print("started")
if {hang}:
    time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
@pytest.mark.parametrize("hang", [False, True])
def test_sandbox_none_ends_the_processes_the_program_started(tmp_path, hang):
    tool = PythonTool(PythonTool.Options(sandbox="none", timeout_s=2, cpu_s=1), None)
    code = DAEMON.format(pidfile=str(tmp_path / "daemon.pid"), hang=hang)
    if hang:
        assert "longer than 2 s" in refused(tool, code)
    else:
        assert tool({"code": code}) == "started\n"  # the call ends with the program, not with the daemon
    assert not alive(int((tmp_path / "daemon.pid").read_text()))


# -- the scratch folder ---------------------------------------------------------------------

# 1,500 folders, one in the other: past the recursion limit of a recursive removal. (Past about 2,000
# the path passes PATH_MAX: the watchdog, which sums the folder by path, then counts it as over disk_mb
# and stops the program; test_scratch.py removes 3,000.)
DEEP = """
import os
fd = os.open(".", os.O_RDONLY)
for _ in range(1500):
    os.mkdir("d", dir_fd=fd)
    inner = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = inner
print("deep")
"""


@pytest.mark.parametrize("kind", ["wasm", "none"])
def test_a_deeply_nested_scratch_folder_is_removed(kind, tmp_path, monkeypatch, capfd):
    # limits far above what it takes (the watchdog sums the folder every 0.1 s, on the child's CPU time)
    tool = PythonTool(PythonTool.Options(sandbox=kind, timeout_s=60, cpu_s=30, memory_mb=256), None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert tool({"code": DEEP}) == "deep\n"
    assert os.listdir(tmp_path) == [] and "left behind" not in capfd.readouterr().err


def test_a_scratch_folder_that_cannot_be_removed_is_reported(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tool = PythonTool(PythonTool.Options(sandbox="none"), None)

    def busy(path, *, dir_fd=None):
        raise OSError(16, "Device or resource busy", path)

    monkeypatch.setattr(os, "rmdir", busy)
    assert tool({"code": "import os; os.mkdir('x'); print(1)"}) == "1\n"
    monkeypatch.undo()
    (left,) = os.listdir(tmp_path)
    assert (
        f"warning: python tool: a call's scratch folder was left behind: could not remove {tmp_path / left}: "
        "[Errno 16] Device or resource busy: 'x' (and 1 more failures). Remove it by hand."
    ) in capfd.readouterr().err
    scratch.remove_tree(str(tmp_path / left))
