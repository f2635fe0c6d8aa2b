"""A benchmark's measurements (``in_fresh_process``), each in a process of its own forked from the fork
server: its result, output and failure come back as from a new interpreter, a timeout or SIGTERM ends
it with its children, and a machine with a CUDA device or a changed environment gets a new interpreter.

The benchmark is a Python process of its own (``DRIVER``), as ``clip-train bench`` is: the test
worker's environment changes from test to test, which sends its measurements to new interpreters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from processes import Watched, ended, run_to_end

from clip_train.bench.runner import PRELOADED, ProcessFailed, in_fresh_process

TESTS = Path(__file__).resolve().parent
DRIVER = "import sys, test_runner; test_runner.%s(*sys.argv[1:])"


def driver_env() -> dict[str, str]:
    """This folder on every interpreter's path, the new ones the measurements may start included."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }


def seen(spec: dict) -> dict:
    """What the measurement's process is, after it said something on each stream."""
    print("on stdout", spec["n"])
    print("on stderr", spec["n"], file=sys.stderr)
    return {
        "n": spec["n"],
        "pid": os.getpid(),
        "parent": os.getppid(),
        "own_group": os.getpgid(0) == os.getpid(),
        "preloaded": all(module in sys.modules for module in PRELOADED),
        "mark": os.environ.get("RUNNER_MARK"),
    }


def fails(spec: dict) -> None:
    raise ValueError(f"no batch {spec['n']}")


def dies(spec: dict) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hangs_with_a_child(pids: str) -> None:
    """Writes its own pid and its child's to ``pids``, then waits past any test's timeout."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pids).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(300)


def measures(pids: str) -> None:
    """The benchmark: each kind of measurement once, what came back printed as JSON on the last line."""
    first, second = (in_fresh_process(seen, {"n": n}) for n in (1, 2))
    try:
        in_fresh_process(fails, {"n": 3})
    except ProcessFailed as err:
        failed = {"killed": err.killed, "last_line": err.last_line}
    try:
        in_fresh_process(dies, {})
    except ProcessFailed as err:
        died = {"killed": err.killed}
    try:
        in_fresh_process(hangs_with_a_child, pids, timeout_s=5)
    except subprocess.TimeoutExpired as err:
        timed_out = err.timeout
    with mock.patch("torch.cuda.is_available", return_value=True):  # a GPU box
        on_a_gpu_box = in_fresh_process(seen, {"n": 4})
    os.environ["RUNNER_MARK"] = "changed"
    changed = in_fresh_process(seen, {"n": 5})
    print(json.dumps({"measured": [first, second, on_a_gpu_box, changed], "failed": failed, "died": died,
                      "timed_out": timed_out, "me": os.getpid()}))  # fmt: skip


def measures_until_stopped(pids: str) -> None:
    in_fresh_process(hangs_with_a_child, pids)


def test_measurements_fork_from_one_server_and_come_back_as_from_a_new_interpreter(tmp_path):
    pids = tmp_path / "pids"
    result = run_to_end([sys.executable, "-c", DRIVER % "measures", str(pids)], env=driver_env())
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    first, second, on_a_gpu_box, changed = report["measured"]
    # Forked from one server that had imported what is measured; each in a group of its own.
    assert first["parent"] == second["parent"] != report["me"] and first["pid"] != second["pid"]
    assert first["preloaded"] and second["preloaded"] and first["own_group"] and second["own_group"]
    # What each said, replayed in order; a result per call.
    assert [first["n"], second["n"]] == [1, 2]
    assert result.stdout.splitlines()[:2] == ["on stdout 1", "on stdout 2"]
    assert "on stderr 1\non stderr 2\n" in result.stderr
    # A failure carries the measurement's own error; a signal is told apart from an error.
    assert report["failed"] == {"killed": False, "last_line": "ValueError: no batch 3"}
    assert report["died"] == {"killed": True}
    # Past its timeout the measurement is killed with its child, and the benchmark goes on.
    assert report["timed_out"] == 5
    assert ended([int(pid) for pid in pids.read_text().split()]), "the hung measurement outlived its timeout"
    # CUDA would not survive the fork, and the server's children would have its environment: where
    # there is a CUDA device, and once the environment changed, a measurement is a new interpreter.
    assert on_a_gpu_box["parent"] == report["me"] and not on_a_gpu_box["preloaded"]
    assert changed["mark"] == "changed" and changed["parent"] == report["me"] and not changed["preloaded"]


def test_sigterm_to_the_benchmark_ends_its_forked_measurement_with_its_child(tmp_path):
    """``timeout 600 clip-train bench ...``: the measurement is the fork server's child, not the
    benchmark's, so the benchmark must end it (and what it started) on its way out."""
    pids = tmp_path / "pids"
    bench = Watched.start(
        [sys.executable, "-c", DRIVER % "measures_until_stopped", str(pids)], env=driver_env()
    )
    bench.wait_for(lambda: pids.is_file() and len(pids.read_text().split()) == 2, "the measurement's child")
    bench.process.send_signal(signal.SIGTERM)
    assert bench.wait().returncode == 128 + signal.SIGTERM
    assert ended([int(pid) for pid in pids.read_text().split()]), "the measurement outlived the benchmark"
