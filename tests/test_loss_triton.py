"""The Triton loss kernels under ``TRITON_INTERPRET=1`` (no GPU needed), against the PyTorch path.

The interpreter must be switched on before Triton is first imported, and other test modules in
this pytest process may already have imported it, so the checks run in a fresh subprocess.
Shapes are tiny (the interpreter executes kernels with NumPy) but ragged in every dimension and
span several blocks, column chunks and padded embedding widths.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from processes import run_to_end

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def _features(rows: int, dim: int, seed: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=1)


def _check_blocks() -> None:
    """Block kernels: Triton forward/backward equal the tiled PyTorch ones (fp32, ragged shapes),
    for both terms, rows only (hard negatives) and a zero row coefficient (columns only)."""
    import torch

    from clip_train.loss import tiles_torch, tiles_triton

    scale = 30.0
    for n, m, dim in [(70, 150, 40), (1, 5, 3), (20, 33, 130)]:
        images, texts = _features(n, dim, 0).float(), _features(m, dim, 1).float()
        for with_cols in (True, False):
            lse = [torch.full((n,), -torch.inf), torch.full((m,), -torch.inf) if with_cols else None]
            expected = [t.clone() if t is not None else None for t in lse]
            tiles_torch.softmax_forward(images, texts, scale, *expected, 32)
            tiles_triton.softmax_forward(images, texts, scale, *lse, 128)  # 128 < 150: two column chunks
            for a, e in zip(lse, expected, strict=True):
                if e is not None:
                    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
            row_lse, col_lse = expected[0] + 3.0, expected[1] + 2.0 if with_cols else None
            for row_coef, col_coef in [(-0.25, 0.5), (0.0, 0.5)] if with_cols else [(-0.25, 0.0)]:
                grads = [torch.zeros(n, dim), torch.zeros(m, dim)]
                expected_grads = [g.clone() + 1.0 for g in grads]  # both accumulate onto what is there
                grads = [g + 1.0 for g in grads]
                args = (scale, row_lse, row_coef, col_lse, col_coef)
                tiles_torch.softmax_backward(images, texts, *args, *expected_grads, 32)
                tiles_triton.softmax_backward(images, texts, *args, *grads, 64)
                for a, e in zip(grads, expected_grads, strict=True):
                    torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def _check_full_loss() -> None:
    """The whole loss with the Triton kernels, against an fp64 formula reference: fp32 features
    (also non-contiguous ones), and bf16/fp16 features, whose reference is the formula on the same
    rounded values (the kernels accumulate in fp32; only G is rounded, to the dot operand dtype)."""
    import torch

    from tests.test_loss import clip_loss_formula

    n, m, dim = 37, 50, 24
    labels = torch.randint(0, m, (n,), generator=torch.Generator().manual_seed(2))
    images, texts, negatives = _features(n, dim, 3), _features(n, dim, 4), _features(m, dim, 5)
    same, opposite = _features(1, dim, 3).expand(n, dim), -_features(1, dim, 3).expand(n, dim)
    cases = [  # (dtype, images, texts, labels, scale, tolerance, image features with a row stride of 2d)
        (torch.float32, images, texts, None, 30.0, 1e-4, False),
        (torch.float32, images, negatives, labels, 30.0, 1e-4, False),
        (torch.float32, same, opposite, None, 100.0, 1e-4, False),  # every similarity is -1
        (torch.float32, images, texts, None, 30.0, 1e-4, True),
        (torch.bfloat16, images, texts, None, 30.0, 1e-2, False),
        (torch.bfloat16, images, negatives, labels, 30.0, 1e-2, False),
        (torch.float16, images, texts, None, 100.0, 2e-3, False),
    ]
    for dtype, rows, cols, case_labels, scale, tolerance, strided in cases:
        if dtype != torch.float32:  # the values the kernels see, exactly
            rows, cols = rows.to(dtype).double(), cols.to(dtype).double()
        results = []
        for run_dtype, fn in [(torch.float64, clip_loss_formula), (dtype, _triton_loss)]:
            i = rows.detach().to(run_dtype).requires_grad_()
            if strided and run_dtype == torch.float32:
                i = torch.empty(n, 2 * dim)[:, ::2].copy_(rows).requires_grad_()
                assert not i.is_contiguous()
            t = cols.detach().to(run_dtype).requires_grad_()
            s = torch.tensor(scale, dtype=torch.float64 if run_dtype == torch.float64 else torch.float32)
            s.requires_grad_()
            loss = fn(i, t, s, labels=case_labels)
            loss.backward()
            results.append([loss.detach(), i.grad, t.grad, s.grad])
        for e, a in zip(*results, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.double(), e, rtol=tolerance, atol=tolerance * e.abs().max() + 5e-5)


def _check_sigmoid() -> None:
    """Sigmoid kernels: blocks against the PyTorch tiles (fp32), and the whole loss against the
    formula in fp64 for fp32, bf16 and fp16 features (as for softmax: same rounded values)."""
    import torch
    import torch.nn.functional as F

    from clip_train.loss import contrastive_loss, tiles_torch, tiles_triton

    for n, m, dim in [(70, 150, 40), (1, 5, 3), (20, 33, 130)]:
        images, texts = _features(n, dim, 0).float(), _features(m, dim, 1).float()
        grads = [torch.ones(n, dim), torch.ones(m, dim)]
        expected_grads = [g.clone() for g in grads]
        args = (30.0, -5.0, -0.3)
        expected = tiles_torch.sigmoid_forward_backward(images, texts, *args, *expected_grads, 32)
        actual = tiles_triton.sigmoid_forward_backward(images, texts, *args, *grads, 32)
        for a, e in zip(actual, expected, strict=True):  # the loss's and the gradient's sums
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        for a, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)

    n, dim = 37, 24
    for dtype, tolerance in [(torch.float32, 1e-4), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]:
        images, texts = _features(n, dim, 3).to(dtype).double(), _features(n, dim, 4).to(dtype).double()
        results = []
        for run_dtype in (torch.float64, dtype):
            i = images.detach().to(run_dtype).requires_grad_()
            t = texts.detach().to(run_dtype).requires_grad_()
            scalar = torch.float64 if run_dtype == torch.float64 else torch.float32
            s = torch.tensor(10.0, dtype=scalar, requires_grad=True)
            b = torch.tensor(-10.0, dtype=scalar, requires_grad=True)
            if run_dtype == torch.float64:
                signs = 2 * torch.eye(n, dtype=torch.float64) - 1
                loss = -F.logsigmoid(signs * (s * i @ t.t() + b)).sum() / n
            else:
                loss = contrastive_loss(i, t, s, logit_bias=b, kind="sigmoid", kernel="triton", tile_size=16)
            loss.backward()
            results.append([loss.detach(), i.grad, t.grad, s.grad, b.grad])
        for e, a in zip(*results, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.double(), e, rtol=tolerance, atol=tolerance * e.abs().max() + 5e-5)


def _triton_loss(images, texts, scale, labels=None):
    from clip_train.loss import contrastive_loss

    return contrastive_loss(images, texts, scale, labels=labels, kernel="triton", tile_size=16)


def _check_errors() -> None:
    """What the kernels refuse says what is wrong with the tensor."""
    import torch

    from clip_train.loss import tiles_triton

    images, texts = _features(8, 4, 0).float(), _features(8, 4, 1).float()
    lse, strided = torch.zeros(8), torch.zeros(8, 8)[:, ::2]
    huge = torch.empty(2**22, 512, dtype=torch.bfloat16, device="meta")  # 2^31 elements, no memory
    backward, forward = tiles_triton.softmax_backward, tiles_triton.softmax_forward
    for call, message in [
        (lambda: backward(images, texts, 1.0, lse, 1.0, lse, 1.0, strided, strided, 8), "contiguous"),
        (lambda: forward(images.double(), texts.double(), 1.0, lse, lse, 8), "fp32, bf16 or fp16"),
        (lambda: forward(images, texts.half(), 1.0, lse, lse, 8), "of one dtype"),
        (lambda: forward(huge, huge, 1.0, lse, lse, 8), "under 2^31 elements"),
    ]:
        try:
            call()
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"no error for {message}")


def _check_gradcache_hands_bf16() -> None:
    """bf16 training with the Triton kernels: Gradient Cache hands the loss bf16 features, and the
    step's gradients (chunks of 5 of 10 rows, both towers replayed) stay as close to the fp64
    full-batch gradients as bf16 towers allow; so does the PyTorch tiles' fp32 hand-off."""
    import test_gradcache as g
    import torch

    from clip_train.engine import GradCache

    batch = g.make_batch()
    exact = g.reference_grads(g.make_model(*g.NO_DROPOUT), batch, 5, 5)
    model = g.make_model(*g.NO_DROPOUT, dtype=torch.float32)
    for kernel, handed in (("triton", torch.bfloat16), ("torch", torch.float32)):
        engine = GradCache(model, precision="bf16", loss_kernel=kernel)
        assert engine._loss_dtype(torch.float32, model.text.proj.out_features) == handed
        got = g.gc_grads(model, batch, image_chunk=5, text_chunk=5, precision="bf16", loss_kernel=kernel)
        g.assert_close_overall(got, exact, rtol=0.05)  # seen: 0.031 (bf16 hand-off), 0.016 (fp32)


def _widen_bf16_dots_in_interpreter() -> None:
    """Triton 3.8's interpreter stores bf16 as uint16 and ``tl.dot`` multiplies those integers.
    Widen bf16 operands to fp32 first: exact, since a product of two bf16 values fits fp32's
    mantissa, which is also what the GPU's bf16 MMA with fp32 accumulation computes."""
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(self, a, b, *args):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, *args)

    interpreter.InterpreterBuilder.create_dot = widened


def _run_interpreted(check: str) -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    code = f"import tests.test_loss_triton as t; t._widen_bf16_dots_in_interpreter(); t.{check}()"
    proc = run_to_end([sys.executable, "-c", code], cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_block_kernels_match_pytorch_tiles() -> None:
    _run_interpreted("_check_blocks")


def test_full_loss_with_triton_kernels_matches_formula() -> None:
    _run_interpreted("_check_full_loss")


def test_sigmoid_kernels_match_pytorch_tiles_and_formula() -> None:
    _run_interpreted("_check_sigmoid")


def test_gradcache_hands_the_kernels_bf16_features_in_bf16_training() -> None:
    _run_interpreted("_check_gradcache_hands_bf16")


def test_kernels_name_what_is_wrong_with_their_inputs() -> None:
    _run_interpreted("_check_errors")
