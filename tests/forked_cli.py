"""``python -m clip_train ...`` for the tests, forked from a server that imported the library once.

A fresh interpreter spends about 6 s of CPU importing torch, timm and transformers before a tiny
run's first step, most of a CLI test's cost on a 2-core machine. So a test worker starts servers
(this file run as a script) that import every clip_train module and then only fork: each command
is a real process of its own (its own pid, pipes, signals, environment and working directory) that
runs ``clip_train.__main__`` as ``python -m`` does and exits as the interpreter would.

What the interpreter and the libraries read from the environment as they start (unbuffered
output, OpenMP's threads, hub settings) is the server's. So a server is started per such
environment (``READ_AT_START``), with it, and each command is forked from the server of its own.
A command with a PYTHONPATH of its own starts fresh: a ``sitecustomize`` there may read anything.
One thing differs from a fresh interpreter: the children of a server share its string-hash seed,
as they would under a fixed PYTHONHASHSEED.

The protocol: the tests' process sends each command over a SEQPACKET socket as one pickled
``(argv, env, cwd)`` with three descriptors (stdout, stderr and a reply socket). On the reply socket
the server answers the child's pid and, once it has reaped the child, its return code.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

# Variables the interpreter or the libraries read as they start (or import): a command is forked
# from a server started with the same values of these.
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
                 "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TIMM_", "LD_", "TMP", "TEMP",
                 "HOME", "XDG_")  # fmt: skip
MAX_SERVERS = 3  # per test worker; each holds about 0.85 GB. The least recently used one makes way.
ALWAYS_FRESH = "CLIP_TRAIN_TESTS_FRESH"  # set it to start every command fresh, as before this file
MESSAGE_BYTES = 1 << 20


# ---- the tests' side ----


def can_fork(command: Sequence[str], env: Mapping[str, str], popen_kwargs: Mapping[str, object]) -> bool:
    """Whether ``command`` may come from a server: ``python -m clip_train``, no ``Popen`` options
    but the working directory, and the tests' own PYTHONPATH."""
    return (
        list(command[:3]) == [sys.executable, "-m", "clip_train"]
        and not set(popen_kwargs) - {"cwd"}
        and env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
        and not env.get(ALWAYS_FRESH)
    )


class ForkedProcess:
    """The ``subprocess.Popen`` surface the tests use, for a process a server forked."""

    def __init__(self, args: Sequence[str], pid: int, reply: socket.socket) -> None:
        self.args, self.pid, self.returncode = list(args), pid, None
        self._reply = reply

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._reply], [], [], 0)[0]:
            self.returncode = _receive_number(self._reply)
            self._reply.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._reply], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    command: Sequence[str], env: Mapping[str, str], cwd: str | None, stdout: int, stderr: int
) -> ForkedProcess:
    """Fork ``command`` (see ``can_fork``) with these descriptors as its stdout and stderr."""
    message = pickle.dumps((list(command[1:]), dict(env), os.path.abspath(cwd or os.getcwd())))
    reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with _servers_lock:
        socket.send_fds(_server_for(env), [message], [stdout, stderr, theirs.fileno()])
    theirs.close()
    return ForkedProcess(command, _receive_number(reply), reply)


_servers: dict[tuple[tuple[str, str], ...], socket.socket] = {}  # by start-up environment, oldest use first
_servers_lock = threading.Lock()


def _server_for(env: Mapping[str, str]) -> socket.socket:
    key = tuple(sorted((name, value) for name, value in env.items() if name.startswith(READ_AT_START)))
    server = _servers.pop(key, None) or _start_server(env)
    _servers[key] = server
    if len(_servers) > MAX_SERVERS:
        _servers.pop(next(iter(_servers))).close()  # it ends once its running children have
    return server


def _start_server(env: Mapping[str, str]) -> socket.socket:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    command = [sys.executable, __file__, str(theirs.fileno())]
    # Its stdout is not a terminal, so the children's is block-buffered, as a fresh one's into a pipe.
    subprocess.Popen(
        command, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    theirs.close()  # the server's end: when ours closes (with this process at the latest), it ends
    return ours


def _receive_number(reply: socket.socket) -> int:
    message = reply.recv(64)
    if not message:
        raise RuntimeError("a forked_cli server ended: its error, if any, is on the test worker's stderr")
    return int(message)


# ---- the server's side ----


@dataclass
class Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdout: int
    stderr: int


def serve(control: socket.socket) -> Request | None:
    """Fork a child per request and report how each ends. Returns the request in the child, and
    None in the server once the tests' process has closed the control socket and every child ended."""
    replies: dict[int, socket.socket] = {}
    while control.fileno() >= 0 or replies:
        if control.fileno() < 0:
            time.sleep(0.05)
        elif select.select([control], [], [], 0.05)[0]:
            request = _fork(control, replies)
            if request is not None:
                return request
        _reap(replies)
    return None


def _fork(control: socket.socket, replies: dict[int, socket.socket]) -> Request | None:
    """Take one request and fork for it: the request in the child, None in the server (which closes
    the control socket when the tests' process has)."""
    message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
    if not message:
        control.close()
        return None
    argv, env, cwd = pickle.loads(message)
    stdout, stderr, reply_fd = fds
    reply = socket.socket(fileno=reply_fd)
    pid = os.fork()
    if pid == 0:
        for sock in (control, reply, *replies.values()):
            sock.close()
        return Request(argv, env, cwd, stdout, stderr)
    os.close(stdout)
    os.close(stderr)
    _send(reply, pid)
    replies[pid] = reply
    return None


def _reap(replies: dict[int, socket.socket]) -> None:
    while replies:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        reply = replies.pop(pid)
        _send(reply, os.waitstatus_to_exitcode(status))
        reply.close()


def _send(reply: socket.socket, number: int) -> None:
    with contextlib.suppress(OSError):  # the test that started it has gone
        reply.send(str(number).encode())


def become(request: Request, started_with: Mapping[str, str]) -> None:
    """Take the command's descriptors, directory, environment and arguments, as ``python -m`` would.
    Only the variables the command sets otherwise than the server's start change: what the
    libraries set as they were imported stays, as it would in a fresh interpreter."""
    os.dup2(request.stdout, 1)
    os.dup2(request.stderr, 2)
    os.close(request.stdout)
    os.close(request.stderr)
    os.chdir(request.cwd)
    for name in request.env.keys() | started_with.keys():
        if request.env.get(name) != started_with.get(name):
            if name in request.env:
                os.environ[name] = request.env[name]
            else:
                del os.environ[name]
    sys.path[0] = request.cwd
    sys.argv = [request.argv[1], *request.argv[2:]]  # ["-m", module, *args]; runpy sets argv[0]


def run_as_main(module: str) -> NoReturn:
    """Run ``module`` as ``python -m`` does and exit as the interpreter would (the exit code, the
    traceback, non-daemon threads joined, ``atexit``), but without tearing down every module: in a
    forked child that teardown writes to every page it shares with the server (seconds), and a C++
    thread object the child never ran may abort it."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as error:  # the CLI turns Ctrl-C into status 130 itself
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    """``SystemExit``'s code as the interpreter turns it into a status."""
    if code is None or isinstance(code, int):
        return (code or 0) & 0xFF
    print(code, file=sys.stderr)
    return 1


def _import_everything() -> None:
    import importlib
    import pkgutil

    import clip_train

    for module in pkgutil.walk_packages(clip_train.__path__, "clip_train."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


if __name__ == "__main__":
    started_with = dict(os.environ)
    _import_everything()
    gc.freeze()  # the server's objects stay out of the children's collections: no copy-on-write there
    request = serve(socket.socket(fileno=int(sys.argv[1])))
    if request is not None:
        become(request, started_with)
        run_as_main(request.argv[1])
