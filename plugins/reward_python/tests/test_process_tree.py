"""A supervised child and every process it starts end together, whether it exits, is stopped, or the
process that started it is gone; the child's exit status reads as the supervisor's."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hybridrl_reward_python import process_tree
from hybridrl_testing import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")

# starts a daemon (the child forks and exits, the grandchild leaves the session), prints its pid, then waits
DAEMON = textwrap.dedent(
    """
    import os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            os.write(w, str(os.getpid()).encode())
            time.sleep(600)
            os._exit(0)
        os._exit(0)
    os.wait()
    print(os.read(r, 20).decode(), flush=True)
    if sys.argv[1:] == ["wait"]:
        time.sleep(600)
    """
)


@pytest.mark.parametrize(
    "code, status",
    [("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -signal.SIGSEGV)],
)
def test_the_childs_exit_status_is_the_supervisors(code, status):
    proc = process_tree.start([sys.executable, "-c", code])
    assert proc.wait() == status
    process_tree.stop(proc)


def test_a_command_that_cannot_start_exits_127():
    proc = process_tree.start(["/nonexistent/program"], stderr=subprocess.PIPE)
    assert proc.wait() == 127 and b"cannot start /nonexistent/program" in proc.stderr.read()
    proc.stderr.close()
    process_tree.stop(proc)


@pytest.mark.parametrize("wait", [False, True])
def test_a_daemon_ends_when_the_child_exits_or_is_stopped(wait):
    proc = process_tree.start([sys.executable, "-c", DAEMON, *(["wait"] if wait else [])], stdout=subprocess.PIPE)
    pid = int(proc.stdout.readline())
    if wait:
        assert alive(pid) and proc.poll() is None
        assert process_tree.stop(proc) == -signal.SIGKILL
    else:
        assert proc.wait() == 0
        process_tree.stop(proc)
    proc.stdout.close()
    assert not alive(pid)


def test_the_tree_ends_when_the_process_that_started_it_is_gone():
    trainer = textwrap.dedent(
        f"""
        import sys
        from hybridrl_reward_python import process_tree
        proc = process_tree.start([sys.executable, "-c", {DAEMON!r}, "wait"])
        sys.stdin.read()
        """
    )
    # the trainer's stdout reaches the daemon, which prints its pid there
    with subprocess.Popen([sys.executable, "-c", trainer], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        pid = int(proc.stdout.readline())
        assert alive(pid)
        proc.kill()
        proc.wait()
        for _ in range(600):  # the supervisor notices within a second or so
            if not alive(pid):
                break
            time.sleep(0.05)
        assert not alive(pid)
        proc.stdin.close()
