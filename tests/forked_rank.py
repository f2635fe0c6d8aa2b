"""torchrun's worker in the tests (``forked_cli.with_forked_ranks``): it asks the ``forked_cli``
server at ``$CLIP_TRAIN_TESTS_RANK_SERVER`` for ``python -u -m MODULE ...`` as a forked rank and
stands in for it towards torchrun, which signals and waits on this process: the signals that
torchrun and the tests send here reach the rank's process group, and this process ends as the rank
did (its status, or the signal that killed it). Where no server answers, or the server's start-up
environment is not this one, this process becomes the fresh interpreter torchrun would have run."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys

from forked_cli import FRESH, RANK_PYTHONPATH, RANK_SERVER

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def rank_environment() -> dict[str, str]:
    """The rank's environment: this one, on the PYTHONPATH that ``with_forked_ranks`` kept aside."""
    env = dict(os.environ)
    if RANK_PYTHONPATH in env:
        env["PYTHONPATH"] = env.pop(RANK_PYTHONPATH)
    return env


def forked_rank() -> tuple[int, socket.socket] | None:
    """The rank's pid and the connection on which its status will come, or None: start fresh."""
    address = os.environ.get(RANK_SERVER)
    if not address or sys.orig_argv[1:2] != ["-u"]:  # the server's children write unbuffered
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(address)
    except OSError:  # the server has ended
        return None
    message = pickle.dumps((sys.argv[1:], rank_environment(), os.getcwd()))
    socket.send_fds(connection, [message], [sys.stdout.fileno(), sys.stderr.fileno()])
    answer = connection.recv(64)
    return None if answer in (FRESH, b"") else (int(answer), connection)


def end_as(status: int) -> None:
    """Exit with the rank's status, or die of the signal that killed it."""
    if status >= 0:
        os._exit(status)
    if -status != signal.SIGKILL:
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    os._exit(128 - status)  # a signal whose default is not to end the process


def main() -> None:
    rank = forked_rank()
    if rank is None:
        os.execve(sys.executable, [sys.executable, "-u", *sys.argv[1:]], rank_environment())
    pid, connection = rank

    def forward(received: int, _frame: object) -> None:  # to its group, as torchrun signals a worker's
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            os.killpg(pid, received)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = connection.recv(64)  # resumed after each forwarded signal
    if not status:
        sys.exit(f"forked_rank: the forked_cli server ended before rank {pid} did")
    end_as(int(status))


if __name__ == "__main__":
    main()
