"""The NaN guard's ledger: the steps skipped for a non-finite loss or gradient norm, and the stop
after ``train.max_bad_steps`` of them in a row.

Where the optimizer skips a step on the device (fused AdamW's ``found_inf``), the ledger is kept on
the device too and read only when ``settle`` is called, on logged and checkpoint steps: a step then
never waits for the GPU to learn whether it was skipped. The skipped steps themselves change nothing
(weights, optimizer states, EMA), so finding a run of them a few steps late costs only those steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from clip_train.checkpoint import latest_checkpoint
from clip_train.distributed import rank_and_world
from clip_train.errors import UserError
from clip_train.logs import get_logger


class TrainingAborted(UserError):
    """Too many consecutive non-finite steps: the run stops, keeping its last good checkpoint."""

    def __init__(self, message: str, step: int, total: int) -> None:
        super().__init__(message)
        self.step, self.total = step, total  # where it stopped, and the steps skipped in all

    def __reduce__(self):
        return type(self), (str(self), self.step, self.total)


class SkippedSteps:
    """``in_a_row`` (the run of skipped steps ending at the last settled step) and ``total``, as of
    the last ``settle``; the guard ``count``s steps it decided on the host and ``record``s those it
    decided on the device."""

    def __init__(self, max_in_a_row: int, run_dir: Path) -> None:
        self.max_in_a_row, self.run_dir = max_in_a_row, run_dir
        self.in_a_row = self.total = 0
        # Since the last settle, on the device: the run now, the longest run, the steps skipped, and
        # the latest skipped step with its loss and gradient norm (for the warning). None: nothing.
        self._unread: torch.Tensor | None = None

    def count(self, skipped: bool, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step whose fate the host already read (the values are read only for a skipped one)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        self._warn(f"step {step} skipped, non-finite (loss {float(loss)}, grad norm {float(grad_norm)})")
        self._stop_after(self.in_a_row, step)

    @torch.no_grad()  # a loss with a graph must not chain the steps' graphs through the ledger
    def record(self, skipped: torch.Tensor, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step skipped or not on the device (``skipped``, a bool tensor there): a few kernels on
        six numbers, and no read."""
        if self._unread is None:  # filled on the device: a host list, or a number assigned into a
            # CUDA tensor (a CPU scalar copied in), would be a synchronous copy
            self._unread = torch.full((6,), math.nan, dtype=torch.float64, device=loss.device)
            self._unread[:2].fill_(self.in_a_row)
            self._unread[2:3].fill_(0)
        run, longest, skips, *latest = self._unread.unbind()
        run = (run + 1) * skipped
        counts = torch.stack([run, longest.maximum(run), skips + skipped])
        this_step = torch.stack([torch.full_like(run, step), loss.to(run.dtype), grad_norm.to(run.dtype)])
        self._unread = torch.cat([counts, this_step.where(skipped, torch.stack(latest))])

    def settle(self, step: int) -> None:
        """Read what the device recorded (one read, which waits for the step's kernels), warn of the
        skipped steps and stop the run after a run of ``max_in_a_row``. Every rank calls it at the
        same steps: their records agree (the guard's flags are all-reduced), and so do their stops."""
        if self._unread is None:
            return
        run, longest, skips, latest, loss, grad_norm = self._unread.tolist()
        self._unread = None
        self.in_a_row, self.total = int(run), self.total + int(skips)
        if skips:
            self._warn(
                f"{int(skips)} step(s) skipped up to step {step}, non-finite (the latest, step "
                f"{int(latest)}: loss {loss}, grad norm {grad_norm})"
            )
        self._stop_after(int(longest), step)

    def _warn(self, what: str) -> None:
        rank, _ = rank_and_world()
        get_logger().warning(f"rank {rank}: {what}; {self.in_a_row} in a row")

    def _stop_after(self, in_a_row: int, step: int) -> None:
        if in_a_row >= self.max_in_a_row:
            raise TrainingAborted(
                f"{in_a_row} consecutive steps had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={self.max_in_a_row}); stopped at step {step}. "
                f"Last good checkpoint: {latest_checkpoint(self.run_dir) or 'none'}. "
                "Lower optim.lr or use fp32/bf16.",
                step,
                self.total,
            )
