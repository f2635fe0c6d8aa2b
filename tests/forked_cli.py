"""``python -m clip_train ...`` for the tests, forked from a server that imported the library once.

A fresh interpreter spends about 6 s of CPU importing torch, timm and transformers before a tiny
run's first step, most of a CLI test's cost on a 2-core machine. So a test worker starts servers
(this file run as a script) that import every clip_train module and then only fork: each command
is a real process of its own (its own pid, pipes, signals, environment and working directory) that
runs ``clip_train.__main__`` as ``python -m`` does and exits as the interpreter would.

What the interpreter and the libraries read from the environment as they start (unbuffered
output, OpenMP's threads, hub settings) is the server's. So a server is started per such
environment (``READ_AT_START``), with it, and each command is forked from the server of its own.
A command whose PYTHONPATH puts folders before the tests' own is forked too: the child puts them on
``sys.path`` and imports the ``sitecustomize`` they hold, as a fresh interpreter would, but after the
server's imports. So a patch there must rebind what callers look up when they call (a class's method,
a module's global), as the tests' faults do (``rank_faults.py``); any other PYTHONPATH starts fresh.
One thing differs from a fresh interpreter: the children of a server share its string-hash seed,
as they would under a fixed PYTHONHASHSEED.

torchrun itself (``python -m torch.distributed.run``) is forked as such a command, and its ranks
come from the servers too. ``torchrun ... -m clip_train ...`` runs
``forked_rank.py`` as each worker instead (``with_forked_ranks``), which asks the server of its
environment for the rank and stands in for it towards torchrun: signals to it reach the rank's
process group, its death (SIGKILL) ends that group, and it ends as the rank did. The rank leads a
process group of its own, as each torchrun worker does.

The protocol: the tests' process sends each command over a SEQPACKET socket as one pickled
``(argv, env, cwd)`` with three descriptors (stdout, stderr and a reply socket). On the reply socket
the server answers the child's pid and, once it has reaped the child, its return code. A rank
connects to the server's listening socket and sends the same with two descriptors (stdout and
stderr): the connection is its reply socket, and the answer ``fresh`` (a start-up environment that
is not the server's) sends it to start as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import itertools
import os
import pickle
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

# Variables the interpreter or the libraries read as they start (or import): a command is forked
# from a server started with the same values of these.
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
                 "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TIMM_", "LD_", "TMP", "TEMP",
                 "HOME", "XDG_")  # fmt: skip
MAX_SERVERS = 3  # per test worker; each holds about 0.85 GB. The least recently used one makes way.
ALWAYS_FRESH = "CLIP_TRAIN_TESTS_FRESH"  # set it to start every command fresh, as before this file
MESSAGE_BYTES = 1 << 20
CLI = [sys.executable, "-m", "clip_train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RANK_CLIENT = str(Path(__file__).with_name("forked_rank.py"))
RANK_SERVER = "CLIP_TRAIN_TESTS_RANK_SERVER"  # the listening socket's path, for forked_rank.py
RANK_PYTHONPATH = "CLIP_TRAIN_TESTS_RANK_PYTHONPATH"  # the ranks' PYTHONPATH, for forked_rank.py
# What torchrun sets in its workers' environment that the start-up environment's prefixes cover;
# torch reads them when a run starts, not at import, so a server started without them serves ranks.
SET_BY_TORCHRUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
FRESH = b"fresh"


# ---- the tests' side ----


def can_fork(command: Sequence[str], env: Mapping[str, str], popen_kwargs: Mapping[str, object]) -> bool:
    """Whether ``command`` may come from a server: ``python -m clip_train`` or torchrun, no ``Popen``
    options but the working directory, and the tests' own PYTHONPATH (or folders before it)."""
    return list(command[:3]) in (CLI, TORCHRUN) and _may_fork(env, popen_kwargs)


def _may_fork(env: Mapping[str, str], popen_kwargs: Mapping[str, object]) -> bool:
    return (
        not set(popen_kwargs) - {"cwd"}
        and added_folders(env.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")) is not None
        and not env.get(ALWAYS_FRESH)
    )


def added_folders(path: str, own: str) -> list[str] | None:
    """The folders a PYTHONPATH ``path`` puts before ``own``, or None where it does not end with it."""
    if path == own:
        return []
    if not own:
        return path.split(os.pathsep)
    head, separator, tail = path.rpartition(os.pathsep + own)
    return head.split(os.pathsep) if separator and not tail else None


def with_forked_ranks(
    command: Sequence[str], env: Mapping[str, str], popen_kwargs: Mapping[str, object]
) -> tuple[list[str], Mapping[str, str]]:
    """``torchrun OPTIONS -m MODULE ARGS`` as ``torchrun OPTIONS forked_rank.py -m MODULE ARGS``,
    with the address of the server its ranks come from; any other command as it is."""
    if list(command[:3]) != TORCHRUN or not _may_fork(env, popen_kwargs) or "-m" not in command[3:-1]:
        return list(command), env
    module = command.index("-m", 3)  # torchrun's own flag: its script is a module
    # torchrun runs a script with -u, and sets one OpenMP thread in each of several workers
    ranks_env = {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
    with _servers_lock:
        address = _server_for(ranks_env).ranks
    # forked_rank.py starts on the tests' own PYTHONPATH (a sitecustomize there would import the
    # library into the stand-in), and hands the ranks' on to the server
    return [*command[:module], RANK_CLIENT, *command[module:]], {
        **_own_pythonpath(env),
        RANK_SERVER: address,
        **({RANK_PYTHONPATH: env["PYTHONPATH"]} if "PYTHONPATH" in env else {}),
    }


def _own_pythonpath(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the tests' own PYTHONPATH."""
    own = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return own | ({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})


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
        socket.send_fds(_server_for(env).control, [message], [stdout, stderr, theirs.fileno()])
    theirs.close()
    return ForkedProcess(command, _receive_number(reply), reply)


@dataclass
class Server:
    control: socket.socket  # the tests' process's end; when it closes, the server ends
    ranks: str  # the path of its listening socket, where ranks connect


_servers: dict[tuple[tuple[str, str], ...], Server] = {}  # by start-up environment, oldest use first
_servers_lock = threading.Lock()
_server_numbers = itertools.count()


def start_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What a server is started with (PYTHONPATH aside: each child adds its own folders)."""
    read = (name for name in env if name.startswith(READ_AT_START) and name != "PYTHONPATH")
    return tuple(sorted((name, env[name]) for name in read))


def _server_for(env: Mapping[str, str]) -> Server:
    key = start_key(env)
    server = _servers.pop(key, None) or _start_server(env)
    _servers[key] = server
    if len(_servers) > MAX_SERVERS:
        _servers.pop(next(iter(_servers))).control.close()  # it ends once its running children have
    return server


@functools.cache
def _sockets_folder() -> str:
    """Where the servers' listening sockets are: made at the first server, removed at exit."""
    folder = tempfile.mkdtemp(prefix="forked-cli-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _start_server(env: Mapping[str, str]) -> Server:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    address = os.path.join(_sockets_folder(), f"{next(_server_numbers)}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)  # ranks may connect while the server still imports: they wait in the backlog
    command = [sys.executable, __file__, str(theirs.fileno()), str(listener.fileno())]
    # Its stdout is not a terminal, so the children's is block-buffered, as a fresh one's into a pipe.
    subprocess.Popen(
        command,
        pass_fds=[theirs.fileno(), listener.fileno()],
        env=_own_pythonpath(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    theirs.close()  # the server's end: when ours closes (with this process at the latest), it ends
    listener.close()
    return Server(ours, address)


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
    stand_in: socket.socket | None = None  # a rank's: the connection of forked_rank.py, its stand-in


def serve(control: socket.socket, listener: socket.socket, started_with: Mapping[str, str]) -> Request | None:
    """Fork a child per request and report how each ends. Returns the request in the child, and
    None in the server once the tests' process has closed the control socket and every child ended."""
    replies: dict[int, socket.socket] = {}
    while control.fileno() >= 0 or replies:
        if control.fileno() < 0:
            time.sleep(0.05)
        else:
            for ready in select.select([control, listener], [], [], 0.05)[0]:
                if control.fileno() < 0:
                    break  # the tests' process has gone: no more requests
                if ready is control:
                    request = _command(control, listener, replies)
                else:
                    request = _rank(control, listener, replies, started_with)
                if request is not None:
                    return request
        _reap(replies)
    return None


def _command(
    control: socket.socket, listener: socket.socket, replies: dict[int, socket.socket]
) -> Request | None:
    """Take one command and fork for it: the request in the child, None in the server (which stops
    taking requests when the tests' process has closed the control socket)."""
    message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
    if not message:
        control.close()
        listener.close()  # ranks that connect from now on start fresh
        return None
    stdout, stderr, reply_fd = fds
    request = Request(*pickle.loads(message), stdout, stderr)
    return _fork(request, socket.socket(fileno=reply_fd), replies, [control, listener])


def _rank(
    control: socket.socket,
    listener: socket.socket,
    replies: dict[int, socket.socket],
    started_with: Mapping[str, str],
) -> Request | None:
    """Take one rank (run by torchrun with -u) and fork for it, or answer ``fresh`` where its
    start-up environment is not this server's."""
    connection, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 2)
    if not message:  # it died before asking
        connection.close()
        return None
    stdout, stderr = fds
    request = Request(*pickle.loads(message), stdout, stderr, stand_in=connection)
    if _rank_start(request.env) != _rank_start(started_with):
        os.close(stdout)
        os.close(stderr)
        with contextlib.suppress(OSError):
            connection.send(FRESH)
        connection.close()
        return None
    return _fork(request, connection, replies, [control, listener])


def _rank_start(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A rank's start-up environment, but what torchrun sets for it, and unbuffered as ``-u`` is."""
    own = {name: value for name, value in env.items() if not name.startswith(SET_BY_TORCHRUN)}
    return start_key({**own, "PYTHONUNBUFFERED": "1"})


def _fork(
    request: Request, reply: socket.socket, replies: dict[int, socket.socket], server: list[socket.socket]
) -> Request | None:
    """The request in the child, which keeps only its own descriptors; None in the server."""
    pid = os.fork()
    if pid == 0:
        for sock in (*server, *replies.values(), *([] if request.stand_in else [reply])):
            sock.close()
        return request
    if request.stand_in:  # its group exists before the stand-in learns the pid and signals it
        with contextlib.suppress(ProcessLookupError):  # it has already ended
            os.setpgid(pid, pid)
    os.close(request.stdout)
    os.close(request.stderr)
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


def end_with_stand_in(stand_in: socket.socket) -> None:
    """A rank leads a process group of its own, as each torchrun worker does, and the group (it and
    its DataLoader workers) is killed once its stand-in has died: a worker that torchrun or a test
    SIGKILLs ends with its group."""
    os.setpgid(0, 0)  # as the server does for it: whichever runs first makes the group

    def watch() -> None:
        with contextlib.suppress(OSError):
            stand_in.recv(1)  # the stand-in never sends: this returns when it has gone
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="forked-rank-stand-in", daemon=True).start()


def become(request: Request, started_with: Mapping[str, str]) -> None:
    """Take the command's descriptors, directory, environment and arguments, as ``python -m`` would.
    Only the variables the command sets otherwise than the server's start change: what the
    libraries set as they were imported stays, as it would in a fresh interpreter. torchrun imports
    none of them, and its ranks inherit its environment: it gets the command's alone."""
    os.dup2(request.stdout, 1)
    os.dup2(request.stderr, 2)
    os.close(request.stdout)
    os.close(request.stderr)
    os.chdir(request.cwd)
    if request.argv[1] == TORCHRUN[2]:
        os.environ.clear()
        os.environ.update(request.env)
    else:
        for name in request.env.keys() | started_with.keys():
            if request.env.get(name) != started_with.get(name):
                if name in request.env:
                    os.environ[name] = request.env[name]
                else:
                    del os.environ[name]
    sys.path[0] = request.cwd
    sys.argv = [request.argv[1], *request.argv[2:]]  # ["-m", module, *args]; runpy sets argv[0]
    added = added_folders(request.env.get("PYTHONPATH", ""), started_with.get("PYTHONPATH", "")) or []
    sys.path[1:1] = added  # where a fresh interpreter puts PYTHONPATH's folders
    if any(os.path.isfile(os.path.join(folder, "sitecustomize.py")) for folder in added):
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")


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
    import pkgutil

    import clip_train

    for module in pkgutil.walk_packages(clip_train.__path__, "clip_train."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


if __name__ == "__main__":
    started_with = dict(os.environ)
    _import_everything()
    gc.freeze()  # the server's objects stay out of the children's collections: no copy-on-write there
    control, listener = (socket.socket(fileno=int(fd)) for fd in sys.argv[1:3])
    request = serve(control, listener, started_with)
    if request is not None:
        if request.stand_in is not None:
            end_with_stand_in(request.stand_in)
        become(request, started_with)
        run_as_main(request.argv[1])
