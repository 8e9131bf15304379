"""Process trees that end together: a child, and every process it starts, killed and reaped as one.

A process group is not enough. A program that daemonises (it forks, its child forks again and exits,
the grandchild calls ``os.setsid()``) leaves the group, and once its parent has exited it is
re-parented to init, out of reach of anything that walks the tree down from the child. So
:func:`start` runs the child under a small supervisor (this file, run as a script; the standard
library, and psutil when the tree ends):

- on Linux the supervisor is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan
  anywhere below it is re-parented to it, not to init, so whatever sessions or groups they made,
  the processes the child started stay its descendants;
- the child runs in a process group (and session) of its own;
- the tree ends when the child exits, when the trainer asks (:func:`stop`: a byte, or end of file,
  on the supervisor's stdin), when the trainer is gone, or on SIGTERM or SIGHUP: the supervisor
  kills the child's group and every process below it with SIGKILL, again until none is left, reaps
  them all, and exits as the child did (its exit code, or the signal that ended it), so that the
  trainer reads the child's status as the supervisor's.

Elsewhere (macOS, the BSDs) there is no subreaper: the child's group and the processes still linked
to it by their parents are killed, and a daemon that left both escapes.

What it does not hold: a process that kills its supervisor first (it runs as the same user) leaves
its descendants to init. A cgroup would hold those too, but needs a cgroup delegated to the user,
which most containers and desktops do not give; none is used.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_END_LIMIT_S = 10.0  # how long the supervisor keeps killing and reaping before it gives up
_STOP_WAIT_S = 10.0  # how long stop() waits for the supervisor before it kills it


# -- the trainer's side -----------------------------------------------------------------------


def start(cmd: list[str], *, pass_fds: tuple[int, ...] = (), **popen) -> subprocess.Popen:
    """Starts ``cmd`` under a supervisor in a session of its own; end it with :func:`stop`.

    ``pass_fds`` reach the child with their numbers; ``popen`` are :class:`subprocess.Popen`'s other
    arguments (cwd, env, stdout, stderr). The returned process is the supervisor: its stdin is its
    control pipe (the child reads /dev/null) and its exit status is the child's."""
    supervisor = [sys.executable, os.path.abspath(__file__), *(f"--fd={fd}" for fd in pass_fds), "--", *cmd]
    return subprocess.Popen(supervisor, stdin=subprocess.PIPE, pass_fds=pass_fds, start_new_session=True, **popen)


def stop(proc: subprocess.Popen, wait_s: float = _STOP_WAIT_S) -> int:
    """Ends the tree under ``proc`` (from :func:`start`) and waits for it; its exit status.

    A byte on the control pipe rather than closing it alone: a process the trainer forked may hold a
    copy of the pipe, which would keep end of file from coming. Should the supervisor not end within
    ``wait_s``, its group is killed (its descendants then end with it only if they notice)."""
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.write(b"x")
            proc.stdin.flush()
        except OSError:  # it has exited already
            pass
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        return proc.wait()


# -- the supervisor's side --------------------------------------------------------------------


def become_subreaper() -> bool:
    """Makes this process the child subreaper of its descendants (Linux); whether it is."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, one, zero, zero, zero) == 0
    except (OSError, AttributeError):
        return False


def _kill_descendants() -> None:
    """Sends SIGKILL to every process below this one. psutil follows the parent links (from /proc on
    Linux) and checks that a pid was not reused by another process before it signals it."""
    import psutil

    try:
        below = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for process in below:
        try:
            process.kill()
        except psutil.Error:  # gone meanwhile
            pass


def _reap(child: int, status: int | None) -> tuple[int | None, bool]:
    """Reaps every child that has exited (the child, orphans re-parented here); the child's wait
    status once known, and whether any child is left."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, False
        if pid == 0:
            return status, True
        if pid == child:
            status = st


def _watch(child: int, wake: int, stopping: list) -> int | None:
    """Waits until the child exits (its wait status) or the tree is to end before (None): a byte or
    end of file on stdin, the trainer gone, SIGTERM or SIGHUP. Reaps orphans that exit meanwhile."""
    parent = os.getppid()
    while not stopping:
        ready, _, _ = select.select([0, wake], [], [], 1.0)
        if 0 in ready:
            return None
        if wake in ready:
            while True:
                try:
                    if not os.read(wake, 512):
                        break
                except BlockingIOError:
                    break
        status, _ = _reap(child, None)
        if status is not None:
            return status
        if os.getppid() != parent:
            return None
    return None


def _end_tree(child: int, status: int | None, subreaper: bool) -> int | None:
    """Kills the child's process group and every process below this one, again until none is left,
    and reaps them; the child's wait status (None if it could not be reaped in time)."""
    if status is None or not subreaper:  # once reaped, its group is reached through the descendants
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + _END_LIMIT_S
    while True:
        _kill_descendants()
        status, left = _reap(child, status)
        if not left or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def _exit_as(status: int | None) -> None:
    """Exits as the child did: its exit code, or killed by the same signal (no core file)."""
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        import resource

        number = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP cannot be caught anyway
            pass
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def supervise(argv: list[str]) -> None:
    """``[--fd=N ...] -- CMD...``: runs CMD with the descriptors N, and ends its tree (see the module)."""
    fds = [int(a.split("=", 1)[1]) for a in argv[: argv.index("--")] if a.startswith("--fd=")]
    cmd = argv[argv.index("--") + 1 :]
    wake, wake_w = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stopping: list = []
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, lambda *_: stopping.append(True))
    signal.signal(signal.SIGCHLD, lambda *_: None)  # so that select wakes when a child exits
    subreaper = become_subreaper()
    try:
        child = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(f"hybridrl process supervisor: cannot start {cmd[0]}: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    for fd in fds:  # the child holds them now: its end closes them
        os.close(fd)
    status = _watch(child.pid, wake, stopping)
    _exit_as(_end_tree(child.pid, status, subreaper))


if __name__ == "__main__":
    supervise(sys.argv[1:])
