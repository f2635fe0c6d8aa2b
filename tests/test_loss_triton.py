"""The Triton loss kernels under ``TRITON_INTERPRET=1`` (no GPU needed), against the PyTorch path.

The interpreter must be switched on before Triton is first imported, and other test modules in
this pytest process may already have imported it, so the checks run in a fresh subprocess.
Shapes are tiny (the interpreter executes kernels with NumPy) but ragged in every dimension and
span several tiles and column chunks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def _features(rows: int, dim: int, seed: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1)


def _check_blocks() -> None:
    """Block kernels: Triton forward/backward equal the tiled PyTorch ones (fp32, ragged shapes)."""
    import torch

    from clip_train.loss import tiled, triton_kernels

    for n, m, dim in [(70, 83, 40), (1, 5, 3)]:
        images = (_features(n, dim, 0) * 30).float()
        texts = _features(m, dim, 1).float()
        for with_cols in (True, False):
            lse = [torch.full((n,), -torch.inf), torch.full((m,), -torch.inf) if with_cols else None]
            expected = [t.clone() if t is not None else None for t in lse]
            tiled.block_forward(images, texts, *expected, 32)
            triton_kernels.block_forward(images, texts, *lse, 64)  # 64 < 83: two column chunks
            for a, e in zip(lse, expected, strict=True):
                if e is not None:
                    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
            row_shift, col_shift = expected[0] + 3.0, expected[1] + 2.0 if with_cols else None
            grads = [torch.zeros(n, dim), torch.zeros(m, dim)]
            expected_grads = [g.clone() for g in grads]
            tiled.block_backward(images, texts, row_shift, -1.0, col_shift, 1.0, *expected_grads, 32)
            triton_kernels.block_backward(images, texts, row_shift, -1.0, col_shift, 1.0, *grads, 64)
            for a, e in zip(grads, expected_grads, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def _check_full_loss() -> None:
    """The whole loss with the Triton kernels forced on, against an fp64 formula reference."""
    import torch

    from clip_train.loss import contrastive_loss, ring, triton_kernels

    ring._kernels = lambda device, dtype: (triton_kernels.block_forward, triton_kernels.block_backward)
    n, m, dim = 37, 50, 24
    labels = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(2))
    cases = [
        (_features(n, dim, 3), _features(n, dim, 4), None, 30.0),
        (_features(n, dim, 3), _features(m, dim, 5), labels, 30.0),
        (_features(1, dim, 3).expand(n, dim), -_features(1, dim, 3).expand(n, dim), None, 100.0),  # all -1
    ]
    for images, texts, case_labels, scale in cases:
        results = []
        for dtype, fn in [(torch.float64, _reference), (torch.float32, contrastive_loss)]:
            i = images.to(dtype).clone().requires_grad_()
            t = texts.to(dtype).clone().requires_grad_()
            s = torch.tensor(scale, dtype=dtype, requires_grad=True)
            loss = fn(i, t, s, labels=case_labels)
            loss.backward()
            results.append([loss.detach(), i.grad, t.grad, s.grad])
        for e, a in zip(*results, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


def _reference(images, texts, scale, labels=None):
    logits = scale * images @ texts.t()
    if labels is None:
        diagonal = logits.diagonal()
        return ((logits.logsumexp(1) - diagonal).mean() + (logits.logsumexp(0) - diagonal).mean()) / 2
    return (logits.logsumexp(1) - logits.gather(1, labels[:, None]).squeeze(1)).mean()


def _run_interpreted(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    code = f"import tests.test_loss_triton as t; t.{check}()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_block_kernels_match_pytorch_tiles() -> None:
    _run_interpreted("_check_blocks")


def test_full_loss_with_triton_kernels_matches_formula() -> None:
    _run_interpreted("_check_full_loss")
