"""The launch scripts, run for real: two torchrun "nodes" on localhost, the SLURM batch script under
a simulated two-node allocation, and, where a Slurm cluster answers, under real sbatch/srun with a
requeue in the middle of the run; ranks started by srun without torchrun; the processes per node
the scripts start for the GPUs that CUDA_VISIBLE_DEVICES leaves, with a fake nvidia-smi."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import FilesGrowing, Watched, both_ends, run_to_end
from small_runs import DEMO_CONFIG, ROOT, free_port, run_overrides

from clip_train.checkpoint import STATE_FILE, checkpoint_step, complete_checkpoints
from clip_train.errors import UserError
from clip_train.launcher import torchrun_env_from_slurm


def launch_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}


def assert_trained(out_dir: Path, steps: int, world_size: int) -> None:
    final = complete_checkpoints(out_dir)[-1]
    state = torch.load(final / STATE_FILE, weights_only=True)
    assert (state["trainer"]["step"], state["world_size"]) == (steps, world_size)


def test_two_nodes_on_localhost(digits, tmp_path):
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        env = launch_env(NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="localhost", MASTER_PORT=str(port))
        env |= {"NPROC_PER_NODE": "1", "RDZV_ID": f"test-{port}"}
        command = ["bash", str(ROOT / "launch/multinode.sh"), str(DEMO_CONFIG)]
        overrides = run_overrides(digits, tmp_path, 2, "checkpoint.every_steps=2")
        nodes.append(Watched.start([*command, *overrides], env=env, merge_stderr=True))
    results = [node.wait() for node in nodes]
    outputs = [result.stdout for result in results]
    assert [r.returncode for r in results] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_trained(tmp_path, steps=2, world_size=2)


FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames LIST: one host per line (the simulated allocation's nodes)
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $FAKE_SLURM_HOSTS
"""
FAKE_SRUN = """#!/usr/bin/env bash
# srun: one task per node, in parallel, each with its SLURM_NODEID; records its command line.
while [[ "$1" == --* ]]; do shift; done
printf '%q ' "$@" > "$FAKE_SLURM_LOG"
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_sbatch_script_under_simulated_two_node_allocation(digits, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    port = free_port()
    env = launch_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SLURM_HOSTS="localhost otherhost",
        FAKE_SLURM_LOG=str(tmp_path / "srun.log"),
        SLURM_JOB_NODELIST="localhost,otherhost",
        SLURM_JOB_ID=str(port),
        SLURM_NNODES="2",
        NPROC_PER_NODE="1",
        MASTER_PORT=str(port),
    )
    out = tmp_path / "run"
    command = ["bash", str(ROOT / "launch/slurm/train.sbatch"), str(DEMO_CONFIG)]
    result = run_to_end([*command, *run_overrides(digits, out, 2, "checkpoint.every_steps=2")], env=env)
    assert result.returncode == 0, result.stdout[-3000:] + both_ends(result.stderr)
    assert f"rendezvous at localhost:{port}" in result.stdout
    srun_line = (tmp_path / "srun.log").read_text()
    assert "torch.distributed.run" in srun_line and "--rdzv_backend c10d" in srun_line
    assert "checkpoint.resume=auto" in srun_line and '--node_rank "$SLURM_NODEID"' in srun_line.replace(
        "\\", ""
    )
    assert_trained(out, steps=2, world_size=2)


FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# nvidia-smi --list-gpus on a 4-GPU node: all of them, whatever CUDA_VISIBLE_DEVICES says, as the real one;
# GPU 3 is in MIG mode, its two instances listed below it
[ "$1" = --list-gpus ] || exit 0
for gpu in 0 1 2 3; do echo "GPU $gpu: NVIDIA H100 80GB HBM3 (UUID: GPU-$gpu)"; done
for mig in 0 1; do echo "  MIG 3g.40gb     Device  $mig: (UUID: MIG-$mig)"; done
"""
FAKE_TORCHRUN_PYTHON = """#!/usr/bin/env bash
# PYTHON for the launch scripts: prints the torchrun command line instead of running it
echo "$@"
"""
RECORDING_SRUN = """#!/usr/bin/env bash
# srun that starts nothing and prints its options
echo "srun ${*:1:3}"
"""


def fake_bin(tmp_path: Path, **scripts: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def gpu_node_env(tmp_path: Path, cuda_visible_devices: str | None, **extra: str) -> dict[str, str]:
    """A 4-GPU node (fake nvidia-smi on PATH) with ``cuda_visible_devices`` (None: unset)."""
    bin_dir = fake_bin(tmp_path, **{"nvidia-smi": FAKE_NVIDIA_SMI, "python": FAKE_TORCHRUN_PYTHON})
    env = launch_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python"))
    for name in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE", "SLURM_GPUS_ON_NODE"):
        env.pop(name, None)
    env |= extra
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


@pytest.mark.parametrize(
    ("cuda_visible_devices", "processes"),
    [
        (None, 4),
        ("1,3", 2),
        ("GPU-1,GPU-3,MIG-0", 3),
        ("0,1,2,3,4,5", 4),  # more entries than GPUs: CUDA sees at most the node's
        ("2,-1,3", 1),  # CUDA stops at the first negative entry
        ("", 1),  # no GPU visible: one CPU process
    ],
)
def test_scripts_start_one_process_per_gpu_that_cuda_visible_devices_leaves(
    tmp_path, cuda_visible_devices, processes
):
    env = gpu_node_env(tmp_path, cuda_visible_devices)
    command = ["bash", str(ROOT / "launch/train.sh"), str(DEMO_CONFIG), "train.max_steps=1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert f"--nproc_per_node {processes} " in result.stdout, result.stdout
    env |= {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "localhost"}
    command[1] = str(ROOT / "launch/multinode.sh")
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert f"--nproc_per_node {processes} " in result.stdout, result.stdout


def test_multinode_restarts_need_a_rendezvous_id_of_the_launchs_own(tmp_path):
    """A restart resumes the run its launch took, recorded by torchrun's run id (the rendezvous id):
    the default one, shared by every launch, would let a restart take over another launch's run."""
    env = gpu_node_env(tmp_path, "0", NNODES="2", NODE_RANK="0", MASTER_ADDR="localhost", MAX_RESTARTS="3")
    env.pop("RDZV_ID", None)
    command = ["bash", str(ROOT / "launch/multinode.sh"), str(DEMO_CONFIG)]
    refused = subprocess.run(command, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "MAX_RESTARTS needs RDZV_ID" in refused.stderr
    env["RDZV_ID"] = "job-7"
    started = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert "--rdzv_id job-7 --max-restarts 3 " in started.stdout, started.stdout


def test_nproc_per_node_overrides_the_count(tmp_path):
    env = gpu_node_env(tmp_path, "0,1", NPROC_PER_NODE="3")
    command = ["bash", str(ROOT / "launch/train.sh"), str(DEMO_CONFIG)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert "--nproc_per_node 3 " in result.stdout


@pytest.mark.parametrize(
    ("cuda_visible_devices", "gpus_on_node", "processes"),
    [("0,1", "8", 2), (None, "4", 4), (None, None, 8), ("", "8", 1)],
)
def test_sbatch_script_starts_one_process_per_gpu_slurm_left_visible(
    tmp_path, cuda_visible_devices, gpus_on_node, processes
):
    env = gpu_node_env(tmp_path, cuda_visible_devices)
    fake_bin(tmp_path, scontrol=FAKE_SCONTROL, srun=RECORDING_SRUN)
    env |= {
        "FAKE_SLURM_HOSTS": "node1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "15007",
        "SLURM_NNODES": "1",
        "SLURM_CPUS_PER_TASK": "64",
    }
    env.pop("MASTER_PORT", None)
    if gpus_on_node is not None:
        env["SLURM_GPUS_ON_NODE"] = gpus_on_node
    command = ["bash", str(ROOT / "launch/slurm/train.sbatch"), str(DEMO_CONFIG)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    # a rendezvous port of the job's own; srun's tasks get the job's CPUs (Slurm >= 22.05 drops them)
    assert f"job 15007: 1 node(s) x {processes} process(es), rendezvous at node1:15007" in result.stdout
    assert "srun --cpus-per-task 64 --kill-on-bad-exit=1" in result.stdout


SLURM_TASK = {
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "2",
}
RENDEZVOUS = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


def test_a_task_srun_started_without_torchrun_gets_torchruns_variables_from_slurms():
    assert torchrun_env_from_slurm(SLURM_TASK | RENDEZVOUS) == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    # torchrun's own variables win; a one-task step, a batch script of a many-task job (no step of
    # its own) or no Slurm at all is one process
    assert torchrun_env_from_slurm(SLURM_TASK | RENDEZVOUS | {"RANK": "0"}) == {}
    assert torchrun_env_from_slurm(SLURM_TASK | {"SLURM_STEP_NUM_TASKS": "1"}) == {}
    batch_script = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert torchrun_env_from_slurm(batch_script | {"SLURM_PROCID": "0"}) == {}
    assert torchrun_env_from_slurm({}) == {}
    with pytest.raises(
        UserError, match=r"srun without torchrun \(2 tasks\), but MASTER_ADDR and MASTER_PORT not set"
    ):
        torchrun_env_from_slurm(SLURM_TASK)
    no_local_id = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_LOCALID"}
    with pytest.raises(UserError, match="SLURM_LOCALID not set"):
        torchrun_env_from_slurm(no_local_id | RENDEZVOUS)


def srun_task_env(task: int, **extra: str) -> dict[str, str]:
    """A task of a 2-task Slurm step on one node that srun started directly: Slurm's variables only."""
    env = launch_env(
        SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(task), SLURM_LOCALID=str(task)
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env | extra


def test_ranks_that_srun_starts_without_torchrun_train_together(digits, tmp_path):
    port = str(free_port())
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG)]
    command += run_overrides(digits, tmp_path, 2, "checkpoint.every_steps=2")
    tasks = [
        Watched.start(
            command, env=srun_task_env(task, MASTER_ADDR="127.0.0.1", MASTER_PORT=port), merge_stderr=True
        )
        for task in (0, 1)
    ]
    results = [task.wait() for task in tasks]
    assert [r.returncode for r in results] == [0, 0], results[0].stdout[-3000:] + results[1].stdout[-3000:]
    assert_trained(tmp_path, steps=2, world_size=2)


def test_srun_without_torchrun_or_a_rendezvous_address_is_refused_in_one_line(digits, tmp_path):
    command = [
        sys.executable,
        "-m",
        "clip_train",
        "train",
        str(DEMO_CONFIG),
        *run_overrides(digits, tmp_path, 2),
    ]
    result = run_to_end(command, env=srun_task_env(0))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "started by srun without torchrun (2 tasks), but MASTER_ADDR and MASTER_PORT not set" in line


def slurm_available() -> bool:
    if not shutil.which("sbatch"):
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0


def job_state(job: str) -> str:
    result = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in result.stdout.split() if "=" in f)
    return fields.get("JobState", "GONE")


def submit(digits: Path, tmp_path: Path, out: Path, steps: int, *extra: str) -> str:
    """sbatch the launch script for a 2-process CPU run of the demo recipe; returns the job id."""
    env = launch_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    command = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", f"--chdir={tmp_path}"]
    command += [
        str(ROOT / "launch/slurm/train.sbatch"),
        str(DEMO_CONFIG),
        *run_overrides(digits, out, steps, *extra),
    ]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return submitted.stdout.strip().split(";")[0]


def start_requeued_now(job: str, progress: FilesGrowing) -> None:
    """Slurm holds a requeued job for ~2 minutes (Reason=BeginTime); no need to wait that out here."""
    while job_state(job) in ("RUNNING", "COMPLETING", "REQUEUED") and not progress.stalled():
        time.sleep(0.2)
    assert job_state(job) == "PENDING", f"job {job} was not requeued: {job_state(job)}"
    # The node revokes the last run's credential when it has cleaned up, and refuses credentials
    # issued in the same second ("Job credential revoked"): start after that, in a later second.
    # A start time of now, not now+2: the update runs the scheduler, which starts the job at once,
    # where a start time still ahead left it to the backfill pass, up to 30 s later.
    while node_state() != "idle" and not progress.stalled():
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)


def node_state() -> str:
    return subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip()


def wait_until_done(job: str, progress: FilesGrowing) -> str:
    while job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE") and not progress.stalled():
        time.sleep(0.5)
    return job_state(job)


def job_progress(tmp_path: Path, job: str, out: Path) -> FilesGrowing:
    """A job is making progress while its log or its run directory's metrics grow."""
    return FilesGrowing([tmp_path / f"clip_train-{job}.out", out / "metrics.jsonl"])


def starts(log: str, job: str) -> int:
    return log.count(f"job {job}: 1 node(s)")


@pytest.mark.skipif(not slurm_available(), reason="no Slurm cluster here (.ci/run starts a local one)")
def test_real_slurm_job_requeued_mid_run_resumes(digits, tmp_path):
    out = tmp_path / "run"
    steps = 40
    job = submit(digits, tmp_path, out, steps, "checkpoint.every_steps=2")
    progress = job_progress(tmp_path, job, out)
    while not complete_checkpoints(out) and not progress.stalled():
        time.sleep(0.2)
    assert complete_checkpoints(out), f"job {job} wrote no checkpoint: {job_state(job)}"
    subprocess.run(["scontrol", "requeue", job], check=True)
    start_requeued_now(job, progress)
    state = wait_until_done(job, progress)
    log = (tmp_path / f"clip_train-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert starts(log, job) == 2 and "resumed from" in log, log[-3000:]
    assert_trained(out, steps=steps, world_size=2)


@pytest.mark.skipif(not slurm_available(), reason="no Slurm cluster here (.ci/run starts a local one)")
def test_real_slurm_usr1_checkpoints_requeues_and_resumes_without_redoing_a_step(digits, tmp_path):
    """USR1 to the batch script, as ``#SBATCH --signal=B:USR1@900`` sends it before the time limit: the
    script forwards it to the step, the ranks save the step they finished (no periodic checkpoint
    is due), and the script requeues the job, which resumes at the next step."""
    out = tmp_path / "run"
    steps = 40
    job = submit(digits, tmp_path, out, steps, "checkpoint.every_steps=1000", "log.every_steps=1")
    progress = job_progress(tmp_path, job, out)
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and not progress.stalled():
        time.sleep(0.05)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    start_requeued_now(job, progress)
    (saved,) = complete_checkpoints(out)  # the job is requeued only once its step has ended
    stopped = checkpoint_step(saved)
    state = wait_until_done(job, progress)
    log = (tmp_path / f"clip_train-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert 3 <= stopped < steps, log[-3000:]
    assert f"job {job}: USR1 received" in log and "clip-train: preempted: SIGUSR1 received" in log, log[
        -3000:
    ]
    assert starts(log, job) == 2 and f"resumed from {saved} at step {stopped}" in log, log[-3000:]
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # every step once: none lost, none redone
    assert_trained(out, steps=steps, world_size=2)


@pytest.mark.skipif(not slurm_available(), reason="no Slurm cluster here (.ci/run starts a local one)")
def test_real_slurm_term_to_the_batch_script_checkpoints_and_ends_without_a_requeue(digits, tmp_path):
    """TERM to the batch script (``scancel --batch --signal=TERM``): passed on as TERM, srun killed
    every rank at once (SIGKILL) and nothing was saved. As USR1, the ranks save the step they
    finished and stop, and the script does not requeue the job."""
    out = tmp_path / "run"
    job = submit(digits, tmp_path, out, 40, "checkpoint.every_steps=1000", "log.every_steps=1")
    progress = job_progress(tmp_path, job, out)
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and not progress.stalled():
        time.sleep(0.05)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True)
    state = wait_until_done(job, progress)
    log = (tmp_path / f"clip_train-{job}.out").read_text()
    (saved,) = complete_checkpoints(out)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert state != "PENDING" and starts(log, job) == 1 and "requeued" not in log, log[-3000:]
    said = f"job {job}: TERM received" in log and "clip-train: preempted: SIGUSR1 received" in log
    assert said, log[-3000:]
    assert 3 <= checkpoint_step(saved) == logged[-1] < 40, log[-3000:]
