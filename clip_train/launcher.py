"""torchrun's environment for ranks that Slurm's srun started directly, one task per GPU.

Everything that needs a rank reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE); such a task has Slurm's instead, and without this every task of a node would be
rank 0 on cuda:0. Torch-free: the CLI applies it before a config is validated against the world size.
"""

from __future__ import annotations

from collections.abc import Mapping

from clip_train.errors import UserError

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")  # torchrun sets them; srun does not


def torchrun_env_from_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables to set for a task of a multi-task srun step not started by torchrun;
    none otherwise. Such ranks meet at MASTER_ADDR:MASTER_PORT: without them the start is refused.
    A step's own task count, not the job's (``SLURM_NTASKS``): a batch script that runs clip-train
    itself is one process, whatever the allocation holds."""
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if "RANK" in environ or "SLURM_PROCID" not in environ or tasks == 1:
        return {}
    missing = [name for name in ("SLURM_LOCALID", *_RENDEZVOUS) if name not in environ]
    if missing:
        raise UserError(
            f"started by srun without torchrun ({tasks} tasks), but {' and '.join(missing)} not set: "
            "export MASTER_ADDR (the first node's hostname) and MASTER_PORT, or start torchrun on "
            "each node (launch/slurm/train.sbatch)"
        )
    variables = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": environ["SLURM_LOCALID"],
    }
    if "SLURM_NTASKS_PER_NODE" in environ:
        variables["LOCAL_WORLD_SIZE"] = environ["SLURM_NTASKS_PER_NODE"]
    return variables
