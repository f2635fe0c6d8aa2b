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
import psutil
import pytest
from processes import Watched, ended, process_status
from small_runs import DEMO_CONFIG, ROOT, run_overrides

from clip_train.preemption import EXIT_PREEMPTED

CLI = forked_cli.CLI
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


def _env(fresh: bool) -> dict[str, str]:
    """The tests' environment, with every command started fresh if ``fresh``."""
    return {**os.environ, **({forked_cli.ALWAYS_FRESH: "1"} if fresh else {})}


def test_sigterm_stops_a_forked_run_as_it_stops_a_fresh_one(digits, tmp_path) -> None:
    """A signal mid-run reaches the forked process, which ends as the fresh one does: the step in
    progress saved, the preemption status, the same last line. (Not SIGINT: pytest-xdist's workers,
    and so every process they start, ignore it.)"""
    ends = []
    for fresh in (True, False):
        env = {**_env(fresh), "PYTHONUNBUFFERED": "1"}
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
        ([*CLI, "train"], {"PYTHONPATH": f"/faults{os.pathsep}/tests-own"}, {}, True),
        ([*CLI, "train"], {"PYTHONPATH": "/faults"}, {}, False),
        ([*CLI, "train"], {"PYTHONPATH": f"/tests-own{os.pathsep}/faults"}, {}, False),
        ([*CLI, "train"], {}, {"preexec_fn": os.setsid}, False),
        ([*CLI, "train"], {forked_cli.ALWAYS_FRESH: "1"}, {}, False),
        ([sys.executable, "-m", "torch.distributed.run", "-m", "clip_train"], {}, {}, True),
        ([sys.executable, "-m", "pytest"], {}, {}, False),
    ],
)
def test_only_python_m_clip_train_or_torchrun_without_other_options_is_forked(
    command, env_changes, options, forks, monkeypatch
) -> None:
    """A PYTHONPATH may only put folders before the tests' own."""
    monkeypatch.setenv("PYTHONPATH", "/tests-own")
    assert forked_cli.can_fork(command, {**os.environ, **env_changes}, options) is forks


SITE_PROBE = """
    import os, sys, clip_train.trainer
    print(getattr(clip_train.trainer, "PATCHED", None), sys.path.index(os.path.abspath("site")))
"""


def test_a_child_imports_the_sitecustomize_of_the_folders_its_pythonpath_adds(tmp_path) -> None:
    """It patches the library, and its folder is where a fresh interpreter puts it on ``sys.path``."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site/sitecustomize.py").write_text(
        "import clip_train.trainer\nclip_train.trainer.PATCHED = 7\n"
    )
    own = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *([own] if own else [])])}
    assert forked_cli.can_fork([*CLI], env, {})
    fresh, forked = _fresh_and_forked(SITE_PROBE, env, tmp_path)
    assert forked == fresh and fresh[:2] == (0, "7 1\n"), fresh


# ---- torchrun's ranks (forked_rank.py standing in for each) ----

RANK_PROBE = """
    import os, signal, subprocess, sys, time
    def say(*words):  # one write a line: the two ranks share the pipe
        sys.stdout.write(" ".join(map(str, words)) + "\\n")
    rank = os.environ["RANK"]
    say("@probe", rank, os.environ.get("OMP_NUM_THREADS"), os.environ.get("PYTHONUNBUFFERED"),
        sys.stdout.write_through, os.getpgid(0) == os.getpid(), os.getcwd(), sys.argv[1:])
    say("@parent", rank, os.getppid())
    ending = sys.argv[1] if rank == "1" else "0"
    if rank == "0":
        open("rank0-said", "w").close()
    while not os.path.exists("rank0-said"):  # rank 1 fails only after rank 0 has said its lines
        time.sleep(0.01)
    if ending == "wait":  # signals print; a child process in the rank's group; then wait to be killed
        signal.signal(signal.SIGUSR1, lambda *_: say("@probe", rank, "got SIGUSR1"))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        say("@group", rank, os.getpid(), child.pid)
        time.sleep(600)
    if ending == "SIGSEGV":
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.exit(int(ending))
"""


def _torchrun_probe(folder, ending: str, env: dict[str, str], nproc: int = 2) -> Watched:
    """``torchrun -m probe ENDING`` in ``folder`` (made here): rank 0 ends at once, rank 1 as
    ``ending`` says."""
    folder.mkdir(exist_ok=True)
    (folder / "probe.py").write_text(textwrap.dedent(RANK_PROBE))
    command = [*forked_cli.TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "probe", ending]
    return Watched.start(command, env=env, cwd=folder, merge_stderr=True)


def _probe_lines(output: str, kind: str) -> list[list[str]]:
    return sorted(line.split(" ", 2)[1:] for line in output.splitlines() if line.startswith(kind + " "))


def _rank_of(worker: psutil.Process) -> str | None:
    """A torchrun worker's rank; None for one that has ended (rank 0 here ends at once)."""
    try:
        return worker.environ().get("RANK")
    except psutil.Error:
        return None


def _reported(output: str) -> list[str]:
    """Rank 1's exit status in torchrun's failure report, if it failed. (Rank 0 ends at once, but
    may still be ending when rank 1 fails, and then torchrun stops it: its end is not compared.)"""
    return re.findall(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: (-?\d+)", output)


def _live_ranks(run: Watched) -> list[str]:
    """The ranks of torchrun's workers that still run."""
    return sorted(rank for worker in psutil.Process(run.process.pid).children() if (rank := _rank_of(worker)))


def _ranks_parents(output: str) -> set[str]:
    return {parent for _, parent in _probe_lines(output, "@parent")}


@pytest.mark.parametrize("ending", ["0", "3", "SIGSEGV"])
def test_torchruns_forked_ranks_start_and_end_as_fresh_ones(ending, tmp_path) -> None:
    """Each rank's environment (torchrun's variables, one OpenMP thread, unbuffered by -u but not
    set), process group, directory and arguments, and how torchrun reports its end (a status, or
    the signal that killed it): as with fresh ranks. The forked ones are children of the server."""
    seen = []
    for fresh in (True, False):
        folder = tmp_path / ("fresh" if fresh else "forked")
        run = _torchrun_probe(folder, ending, _env(fresh))
        result = run.wait()
        parents = _ranks_parents(result.stdout)
        assert (parents == {str(run.process.pid)}) is fresh, (parents, run.process.pid)
        lines = [
            [r, text.replace(str(folder), "FOLDER")] for r, text in _probe_lines(result.stdout, "@probe")
        ]
        seen.append((result.returncode, lines, _reported(result.stdout)))
    assert seen[0] == seen[1]
    assert seen[0][2] == {"0": [], "3": ["3"], "SIGSEGV": ["-11"]}[ending], seen[0]


def test_a_signal_to_a_ranks_stand_in_reaches_its_group_and_its_sigkill_ends_the_group(tmp_path) -> None:
    """A signal sent to a worker's process group, as the tests and torchrun send them, reaches the
    forked rank; SIGKILL to the worker ends the rank and its child processes, and torchrun reports
    the worker killed, as it does for a fresh rank."""
    for fresh in (True, False):
        run = _torchrun_probe(tmp_path / ("fresh" if fresh else "forked"), "wait", _env(fresh))
        try:
            run.wait_for(lambda run=run: "@group 1 " in run.stdout.text, "rank 1's group")
            run.wait_for(lambda run=run: _live_ranks(run) == ["1"], "rank 0's end")  # the one failure
            (worker,) = [p for p in psutil.Process(run.process.pid).children() if _rank_of(p) == "1"]
            os.killpg(worker.pid, signal.SIGUSR1)
            run.wait_for(lambda run=run: "@probe 1 got SIGUSR1" in run.stdout.text, "the signal")
            (group,) = _probe_lines(run.stdout.text, "@group")
            rank_pid, child_pid = map(int, group[1].split())
            worker.send_signal(signal.SIGKILL)
            result = run.wait()
        finally:
            run.process.kill()
        assert ended([rank_pid, child_pid]), (fresh, process_status(rank_pid), process_status(child_pid))
        end = (result.returncode, _reported(result.stdout))
        assert end == (1, ["-9"]), (fresh, end, result.stdout[-3000:])


def test_a_rank_whose_start_up_environment_is_not_the_servers_starts_fresh(tmp_path) -> None:
    """One process without OMP_NUM_THREADS: torchrun sets none, the server was started with one
    thread (as for several ranks), so it answers ``fresh`` and the rank becomes torchrun's own
    fresh child, which runs as before."""
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    run = _torchrun_probe(tmp_path, "0", env, nproc=1)
    result = run.wait()
    assert forked_cli.RANK_CLIENT in result.args and result.returncode == 0, result.stdout[-3000:]
    assert _ranks_parents(result.stdout) == {str(run.process.pid)}
    assert _probe_lines(result.stdout, "@probe")[0][1].split()[0] == "None"  # no OpenMP setting


@pytest.mark.parametrize(
    ("command", "env_changes", "forked"),
    [
        ([*forked_cli.TORCHRUN, "--nproc-per-node=2", "-m", "clip_train", "train"], {}, True),
        ([*forked_cli.TORCHRUN, "-m", "probe"], {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, True),
        (
            [*forked_cli.TORCHRUN, "--nproc-per-node=2", "-m", "clip_train"],
            {"PYTHONPATH": f"/faults{os.pathsep}/tests-own"},
            True,
        ),
        ([*forked_cli.TORCHRUN, "-m", "clip_train"], {"PYTHONPATH": f"/tests-own{os.pathsep}/faults"}, False),
        ([*forked_cli.TORCHRUN, "-m", "clip_train"], {forked_cli.ALWAYS_FRESH: "1"}, False),
        ([*forked_cli.TORCHRUN, "--nproc-per-node=2", "train.py", "-m"], {}, False),
        ([*CLI, "train", "-m", "x"], {}, False),
    ],
)
def test_only_torchrun_of_a_module_without_its_own_pythonpath_gets_forked_ranks(
    command, env_changes, forked, monkeypatch
) -> None:
    """forked_rank.py starts on the tests' own PYTHONPATH; the ranks' comes to it aside."""
    monkeypatch.setenv("PYTHONPATH", "/tests-own")
    env = {**os.environ, **env_changes}
    rewritten, rank_env = forked_cli.with_forked_ranks(command, env, {})
    if not forked:
        assert (rewritten, rank_env) == (command, env)
        return
    at = command.index("-m", 3)
    assert rewritten == [*command[:at], forked_cli.RANK_CLIENT, *command[at:]]
    aside = {forked_cli.RANK_PYTHONPATH: env["PYTHONPATH"], "PYTHONPATH": "/tests-own"}
    assert rank_env == {**env, **aside, forked_cli.RANK_SERVER: rank_env[forked_cli.RANK_SERVER]}
    assert os.path.exists(rank_env[forked_cli.RANK_SERVER])  # the server's socket, listening
