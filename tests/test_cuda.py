"""On a CUDA GPU only (``make gpu-check``; the ``cuda`` marker keeps them out of ``make test``).

What the CPU suite cannot reach: the Triton kernels compiled for the device at hand (every dtype
and padded embedding width), the PyTorch tiles on cuBLAS, Gradient Cache's GPU-only paths
(pinned host batch, side-stream prefetch), and a training run, each against a CPU reference.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from small_runs import DEMO_CONFIG, run_overrides
from test_gradcache import NO_DROPOUT, make_batch, make_model
from test_loss import clip_loss_formula

from clip_train.checkpoint import complete_checkpoints
from clip_train.engine import GradCache
from clip_train.loss import contrastive_loss, tiles_triton

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """IEEE fp32 matmuls unless a test asks for TF32, restored afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _features(rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1)


def _loss_and_grads(fn, images, texts, scale, labels, dtype, device):
    i = images.detach().to(device, dtype).requires_grad_()
    t = texts.detach().to(device, dtype).requires_grad_()
    s = torch.tensor(scale, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    s.requires_grad_()
    loss = fn(i, t, s, labels=None if labels is None else labels.to(device))
    loss.backward()
    return [x.detach().double().cpu() for x in (loss, i.grad, t.grad, s.grad)]


@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize(
    ("dtype", "tf32", "tolerance"),
    [
        (torch.float32, False, 1e-4),
        (torch.float32, True, 2e-2),
        (torch.bfloat16, False, 1e-2),
        (torch.float16, False, 2e-3),
    ],
)
@pytest.mark.parametrize("dim", [64, 200, 512, 768, 1024])  # every padded width the backward has
@pytest.mark.parametrize("hard_negatives", [False, True])
def test_tiled_loss_on_gpu_matches_fp64(kernel, dtype, tf32, tolerance, dim, hard_negatives) -> None:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    n, m = 1000, 1300 if hard_negatives else 1000
    images, texts = _features(n, dim, 0), _features(m, dim, 1)
    images, texts = images.to(dtype).double(), texts.to(dtype).double()  # the values the GPU sees
    labels = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(2)) if hard_negatives else None
    expected = _loss_and_grads(clip_loss_formula, images, texts, 50.0, labels, torch.float64, "cpu")

    def tiled(i, t, s, labels):
        return contrastive_loss(i, t, s, labels=labels, kernel=kernel, tile_size=512)

    if kernel == "triton" and dim > tiles_triton.max_dim(dtype):
        with pytest.raises(ValueError, match="use kernel='torch'"):
            _loss_and_grads(tiled, images, texts, 50.0, labels, dtype, CUDA)
        return
    actual = _loss_and_grads(tiled, images, texts, 50.0, labels, dtype, CUDA)
    for a, e in zip(actual, expected, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, rtol=tolerance, atol=tolerance * e.abs().max() + 1e-5)


@pytest.mark.parametrize("offload", [False, True])
def test_gradcache_step_on_gpu_equals_cpu(offload) -> None:
    """Same weights and batch: the CUDA step (offload: pinned host batch, side-stream prefetch)
    gives the CPU step's gradients, with at most two input chunks on the device."""
    batch = make_batch(rows=24)
    grads = []
    for device, streamed in ((torch.device("cpu"), False), (CUDA, offload)):
        model = make_model(*NO_DROPOUT, dtype=torch.float32).to(device)
        stats = GradCache(model, image_chunk=8, text_chunk=12, offload=streamed).step(*batch)
        grads.append({k: p.grad.double().cpu() for k, p in model.named_parameters() if p.grad is not None})
    assert stats.max_live_chunks <= 2 and stats.peak_mem > 0
    assert grads[0].keys() == grads[1].keys()
    for key, expected in grads[0].items():
        torch.testing.assert_close(grads[1][key], expected, rtol=1e-3, atol=1e-5, msg=key)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_training_run_on_gpu(digits, tmp_path, kernel) -> None:
    command = [sys.executable, "-m", "clip_train", "train", str(DEMO_CONFIG)]
    overrides = run_overrides(
        digits, tmp_path, 3, "train.device=cuda", f"loss.kernel={kernel}", "train.precision=bf16"
    )
    result = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003"]
