"""The tests' forked ``python -m clip_train`` (``forked_cli``) ends as a fresh interpreter does: the
same exit status, stdout and stderr, in the caller's working directory and environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import forked_cli
import pytest
from processes import Watched
from small_runs import DEMO_CONFIG, ROOT, run_overrides

from clip_train.preemption import EXIT_PREEMPTED

CLI = [sys.executable, "-m", "clip_train"]
CASES = {  # args, environment changes, run in the repository, the status
    "help": (["--help"], {}, False, 0),
    "a config relative to the working directory": (["config", "configs/demo-digits.yaml"], {}, True, 0),
    "the same from elsewhere: not found": (["config", "configs/demo-digits.yaml"], {}, False, 2),
    "WORLD_SIZE from the environment: the batch does not divide": (
        ["config", str(DEMO_CONFIG), "batch.global_size=16"],
        {"WORLD_SIZE": "3"},
        False,
        2,
    ),
    "an unknown command": (["no-such-command"], {}, False, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_a_forked_command_ends_as_a_fresh_interpreter_does(case, tmp_path) -> None:
    args, env_changes, in_repo, status = CASES[case]
    env, cwd = {**os.environ, **env_changes}, ROOT if in_repo else tmp_path
    forked = Watched.start([*CLI, *args], env=env, cwd=cwd)
    assert isinstance(forked.process, forked_cli.ForkedProcess)
    fresh = subprocess.run([*CLI, *args], env=env, cwd=cwd, capture_output=True, text=True)
    result = forked.wait()
    assert (result.returncode, result.stdout, result.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == status


def test_sigterm_stops_a_forked_run_as_it_stops_a_fresh_one(digits, tmp_path) -> None:
    """A signal mid-run reaches the forked process, which ends as the fresh one does: the step in
    progress saved, the preemption status, the same last line. (Not SIGINT: pytest-xdist's workers,
    and so every process they start, ignore it.)"""
    ends = []
    for fresh in (True, False):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({forked_cli.ALWAYS_FRESH: "1"} if fresh else {})}
        out = tmp_path / ("fresh" if fresh else "forked")
        overrides = run_overrides(digits, out, 1000, "log.every_steps=1")
        run = Watched.start([*CLI, "train", str(DEMO_CONFIG), *overrides], env=env)
        assert isinstance(run.process, forked_cli.ForkedProcess) is not fresh
        try:
            run.wait_for(lambda run=run: "step: 2/" in run.output, "its second step")
            run.process.send_signal(signal.SIGTERM)
            result = run.wait()
        finally:
            run.process.kill()
        last_line = re.sub(
            r"step[ _]0*\d+", "step N", result.stderr.splitlines()[-1].replace(str(out), "OUT")
        )
        ends.append((result.returncode, last_line))
    assert ends[0] == ends[1] and ends[0][0] == EXIT_PREEMPTED, ends


def _fresh_and_forked(
    code: str, env: dict[str, str], folder
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """(status, stdout, stderr) of ``python -m probe an-argument``, with ``code`` as probe.py in
    ``folder``: fresh, then forked."""
    (folder / "probe.py").write_text(textwrap.dedent(code))
    command = [sys.executable, "-m", "probe", "an-argument"]
    fresh = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True)
    out, err = os.pipe(), os.pipe()
    forked = forked_cli.start(command, env, str(folder), out[1], err[1])
    for _, write in (out, err):
        os.close(write)
    with open(out[0]) as stdout, open(err[0]) as stderr:
        output = stdout.read(), stderr.read()
    return (fresh.returncode, fresh.stdout, fresh.stderr), (forked.wait(), *output)


PROBE = """
    import os, sys, torch, clip_train.trainer  # which sets TOKENIZERS_PARALLELISM
    print(torch.get_num_threads(), sys.stdout.write_through, os.environ.get("OMP_NUM_THREADS"),
          os.environ.get("TOKENIZERS_PARALLELISM"), os.environ.get("ONLY_HERE"), os.getcwd(), sys.argv)
"""


@pytest.mark.parametrize(
    "env_changes",
    [
        {},
        {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        {"ONLY_HERE": "x", "TOKENIZERS_PARALLELISM": "true"},
    ],
)
def test_a_child_starts_as_a_fresh_interpreter_would_in_its_environment(env_changes, tmp_path) -> None:
    """Threads and unbuffered output set as the interpreter starts, a variable set by an import
    (transformers' TOKENIZERS_PARALLELISM) unless the command sets it, the rest of the environment,
    the working directory and the arguments: as a fresh ``python -m`` sees them."""
    fresh, forked = _fresh_and_forked(PROBE, {**os.environ, **env_changes}, tmp_path)
    assert forked == fresh and fresh[0] == 0


ENDINGS = {  # probe.py, the status, the end of stdout and of stderr
    "an exception": ("raise RuntimeError('boom')", 1, "", "RuntimeError: boom"),
    "exit with a message": ("import sys; sys.exit('bye')", 1, "", "bye"),
    "exit with a status": ("import sys; print('out'); sys.exit(3)", 3, "out", ""),
    "a thread still running, then atexit": (
        """
        import atexit, threading, time
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
        """,
        0,
        "thread done\natexit ran",
        "",
    ),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_child_exits_as_a_fresh_interpreter_does(ending, tmp_path) -> None:
    """The status, the output, and the traceback's last line; non-daemon threads finish before the
    ``atexit`` handlers run."""
    code, *expected = ENDINGS[ending]
    ends = _fresh_and_forked(code, dict(os.environ), tmp_path)
    assert [(status, out.strip(), err.strip().rpartition("\n")[2]) for status, out, err in ends] == [
        tuple(expected)
    ] * 2


@pytest.mark.parametrize(
    ("command", "env_changes", "options", "forks"),
    [
        ([*CLI, "train"], {}, {}, True),
        ([*CLI, "train"], {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, {"cwd": "/"}, True),
        ([*CLI, "train"], {"PYTHONPATH": "/faults"}, {}, False),
        ([*CLI, "train"], {}, {"preexec_fn": os.setsid}, False),
        ([*CLI, "train"], {forked_cli.ALWAYS_FRESH: "1"}, {}, False),
        ([sys.executable, "-m", "torch.distributed.run", "-m", "clip_train"], {}, {}, False),
    ],
)
def test_only_python_m_clip_train_without_other_options_or_pythonpath_is_forked(
    command, env_changes, options, forks
) -> None:
    assert forked_cli.can_fork(command, {**os.environ, **env_changes}, options) is forks
