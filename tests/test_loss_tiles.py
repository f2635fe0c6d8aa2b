"""The CPU tile kernels on their own, in fp64 against the formula on the whole block.

The loss-level tests run with one strip per tile (their tiles are tiny); here strips of a
single row, ragged strips, ragged tiles, all three gradient paths and the forward's hand-over of
its last tile are checked directly.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_loss import _adversarial, _assert_all_close, _features, _run, clip_loss_formula
from torch.utils._python_dispatch import TorchDispatchMode

from clip_train.loss import contrastive_loss, tiles_torch

SHAPES = [(13, 11, 5), (1, 4, 3), (9, 9, 9), (6, 17, 4)]  # (n, m, tile)
STRIPS = [1, 7, 1 << 20]  # elements per strip: one row, ragged rows, the whole tile


SCALE = 30.0


class _CountOps(TorchDispatchMode):
    """Counts the ops run inside it for which ``counted(op, kwargs)`` holds."""

    def __init__(self, counted) -> None:
        super().__init__()
        self.counted, self.count = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += bool(self.counted(func.overloadpacket, kwargs))
        return func(*args, **kwargs)


def _logit_matmul(op, kwargs) -> bool:
    """A matmul that computes a tile's logits (``addmm`` with ``beta=0``), not a gradient
    accumulation (``addmm`` into the gradients, ``beta=1``)."""
    addmm = op in (torch.ops.aten.addmm, torch.ops.aten.addmm_)
    return op is torch.ops.aten.mm or (addmm and kwargs.get("beta") == 0)


def _host_read(op, kwargs) -> bool:
    """An op that hands tensor values to the host (``.item()``, ``bool()``, ``float()``,
    ``nonzero``); ``.tolist()`` bypasses the dispatcher, so ``tiles_torch._read`` is counted apart."""
    return op in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero)


@contextlib.contextmanager
def numbers_assigned_into_tensors() -> Iterator[list[str]]:
    """Where ``tensor[index] = number`` runs inside (file:line of each). On CUDA the number goes in
    as a copy of a CPU scalar, which waits for the device (one wait each, seen on an H200), so a step
    fills instead: on the CPU the two look the same to the host-read count above."""
    assigned, setitem = [], torch.Tensor.__setitem__

    def recorded(tensor: torch.Tensor, index, value) -> None:
        if isinstance(value, int | float):  # bool is an int
            caller = traceback.extract_stack(limit=2)[0]
            assigned.append(f"{Path(caller.filename).name}:{caller.lineno}")
        setitem(tensor, index, value)

    with mock.patch.object(torch.Tensor, "__setitem__", recorded):
        yield assigned


def _block(n: int, m: int, dim: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 100 + m)
    images = F.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)
    texts = F.normalize(torch.randn(m, dim, generator=gen, dtype=torch.float64), dim=1)
    return images, texts


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_forward_merges_exact_log_sum_exps(n, m, tile, strip_elements, symmetric) -> None:
    images, texts = _block(n, m)
    logits = SCALE * images @ texts.t()
    # Start from earlier partial sums, as the ring does for every block after the first.
    row_lse = torch.linspace(-3, 40, n, dtype=torch.float64)
    col_lse = torch.linspace(50, -2, m, dtype=torch.float64)
    expected_rows = torch.logaddexp(row_lse, logits.logsumexp(1))
    expected_cols = torch.logaddexp(col_lse, logits.logsumexp(0))
    last = tiles_torch.softmax_forward(
        images, texts, SCALE, row_lse, col_lse if symmetric else None, tile, strip_elements=strip_elements
    )
    torch.testing.assert_close(row_lse, expected_rows, rtol=1e-13, atol=0)
    if symmetric:
        torch.testing.assert_close(col_lse, expected_cols, rtol=1e-13, atol=0)
    assert (last.rows.stop, last.cols.stop) == (n, m)
    torch.testing.assert_close(last.logits, logits[last.rows, last.cols], rtol=1e-14, atol=1e-14)


def _expected_grads(images, texts, row_lse, row_coef, col_lse, col_coef):
    logits = SCALE * images @ texts.t()
    grads = row_coef * (logits - row_lse[:, None]).exp()
    if col_lse is not None:
        grads = grads + col_coef * (logits - col_lse[None, :]).exp()
    return grads @ texts, grads.t() @ images


# (row coefficient, column coefficient, column LSE offset): the column LSE sits near the row LSEs
# (one exp per element, rank-one column factor), 300 below them (beyond a gap of -log(tiny)/3 ≈
# 236 the kernel takes the two-exp path), or is absent (hard negatives), or a coefficient is 0.
PATHS = {
    "rank_one": (-0.3, 0.7, -1.0),
    "wide_gap": (-0.3, 0.7, -300.0),
    "rows_only": (-0.3, 0.0, None),
    "columns_only": (0.0, 0.7, -1.0),
    "no_terms": (0.0, 0.0, -1.0),
}


@pytest.mark.parametrize("strip_elements", STRIPS)
@pytest.mark.parametrize(("n", "m", "tile"), SHAPES)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("hand_over", [False, True])
def test_backward_matches_formula(n, m, tile, strip_elements, path, hand_over) -> None:
    images, texts = _block(n, m)
    logits = SCALE * images @ texts.t()
    row_coef, col_coef, col_offset = PATHS[path]
    row_lse = logits.logsumexp(1) + 2.0
    col_lse = logits.logsumexp(0) + col_offset if col_offset is not None else None
    no_lse = torch.full((n,), -torch.inf, dtype=torch.float64)
    last = tiles_torch.softmax_forward(images, texts, SCALE, no_lse, None, tile)
    grad_images, grad_texts = torch.zeros_like(images), torch.zeros_like(texts)
    with _CountOps(_logit_matmul) as matmuls:
        tiles_torch.softmax_backward(
            images, texts, SCALE, row_lse, row_coef, col_lse, col_coef, grad_images, grad_texts, tile,
            last if hand_over else None, strip_elements=strip_elements,
        )  # fmt: skip
    expected_images, expected_texts = _expected_grads(images, texts, row_lse, row_coef, col_lse, col_coef)
    for actual, expected in [(grad_images, expected_images), (grad_texts, expected_texts)]:
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())
    tiles = -(-n // tile) * -(-m // tile)
    assert not (path == "no_terms" and (grad_images.any() or grad_texts.any()))
    if path == "no_terms" and not tiles_torch._fused(images.device):
        assert matmuls.count == 0  # the strips read the zero coefficients and skip the block
    else:  # the fused path never reads its coefficients: a zero one gives a zero G
        assert matmuls.count == tiles - hand_over  # the hand-over's tile is not recomputed


def test_forward_recovers_columns_whose_sums_underflow_in_fp32() -> None:
    """Identical images against texts at +1 and -1: at scale 100 a tile holding both kinds has a
    -1 column's terms at exp(-200), 0 in fp32; those columns' LSEs must still come out exact."""
    image, _ = _block(1, 1)
    images = image.expand(12, -1).float()
    texts = torch.cat([images[:6], -images[:6]])
    row_lse, col_lse = torch.full((12,), -torch.inf), torch.full((12,), -torch.inf)
    tiles_torch.softmax_forward(images, texts, 100.0, row_lse, col_lse, tile=4)
    logits = 100.0 * images.double() @ texts.double().t()
    torch.testing.assert_close(row_lse.double(), logits.logsumexp(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(col_lse.double(), logits.logsumexp(0), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("kind", "reads_per_call"), [("softmax", 2), ("sigmoid", 0)])
def test_host_reads_per_loss_call_do_not_grow_with_the_tiles(monkeypatch, kind, reads_per_call) -> None:
    """A forward and backward over 256 tiles reads the host as often as over one tile: the tiles'
    decisions are one read per tile-function call (softmax: the forward's underflowed columns,
    the backward's rank-one tiles), and no op reads values per tile."""
    reads, read = [], tiles_torch._read
    monkeypatch.setattr(tiles_torch, "_read", lambda flags: reads.append(flags.shape) or read(flags))
    counts = {}
    for tile in (4, 64):
        images, texts = (t.requires_grad_() for t in _block(64, 64))
        scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(-5.0, dtype=torch.float64) if kind == "sigmoid" else None
        with _CountOps(_host_read) as ops:
            contrastive_loss(images, texts, scale, logit_bias=bias, kind=kind, tile_size=tile).backward()
        counts[tile] = (len(reads), ops.count)
        reads.clear()
    assert counts[4] == counts[64]
    assert counts[4][0] == reads_per_call


@pytest.fixture
def fused(monkeypatch) -> None:
    """The CUDA path's compiled tile functions, run here by inductor's CPU backend."""
    monkeypatch.setattr(tiles_torch, "_fused", lambda device: True)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("symmetric", [True, False])
def test_fused_forward_merges_exact_log_sum_exps(symmetric) -> None:
    test_forward_merges_exact_log_sum_exps(13, 11, 5, None, symmetric)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("path", list(PATHS))
def test_fused_backward_matches_formula(path) -> None:
    """Every gradient path, through one compiled function; the hand-over's tile is not recomputed."""
    test_backward_matches_formula(13, 11, 5, None, path, hand_over=True)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("tile", [None, 8])  # one tile (exact column LSEs) and a 3x3 grid
@pytest.mark.parametrize(
    ("case", "scale", "upstream"),
    [("random", 30.0, 1.0), ("random", 10.0, -2.5), ("random", 10.0, 0.0), ("split_columns", 400.0, 1.0)],
)
def test_fused_loss_matches_formula_fp64(tile, case, scale, upstream) -> None:
    """The CUDA path's loss whole, its scale and coefficients on the device: at scale 400 the
    grid's columns underflow and are recovered, the single tile takes them exactly, and a
    negative or zero upstream gradient goes through the signs and shifts."""
    images, texts = _adversarial(case)
    expected = _run(lambda i, t, s: upstream * clip_loss_formula(i, t, s), images, texts, scale)
    actual = _run(lambda i, t, s: upstream * contrastive_loss(i, t, s, tile_size=tile), images, texts, scale)
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("fused")
def test_fused_hard_negatives_match_formula_fp64() -> None:
    images, texts = _features(13, 9, 2), _features(40, 9, 3)
    labels = torch.randint(0, 40, (13,), generator=torch.Generator().manual_seed(4))
    expected = _run(lambda i, t, s: clip_loss_formula(i, t, s, labels), images, texts, 20.0)
    actual = _run(lambda i, t, s: contrastive_loss(i, t, s, labels=labels, tile_size=5), images, texts, 20.0)
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize(
    ("kind", "tile", "reads"), [("softmax", 64, 0), ("softmax", 16, 1), ("sigmoid", 16, 0)]
)
def test_the_fused_loss_reads_the_host_only_for_a_grids_underflow(monkeypatch, kind, tile, reads) -> None:
    """What CUDA runs never waits for the device, but for the one read of a grid's underflowed
    columns (a block of one tile takes its column LSEs exactly): the scale, the bias and the
    upstream gradient stay on the device, and so would a step's loss at a small batch."""
    seen, read = [], tiles_torch._read
    monkeypatch.setattr(tiles_torch, "_read", lambda flags: seen.append(flags.shape) or read(flags))
    images, texts = (t.requires_grad_() for t in _block(64, 64))
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-5.0, dtype=torch.float64, requires_grad=True) if kind == "sigmoid" else None
    with _CountOps(_host_read) as ops:
        contrastive_loss(images, texts, scale, logit_bias=bias, kind=kind, tile_size=tile).backward()
    assert (len(seen), ops.count) == (reads, 0)
    assert images.grad.abs().sum() > 0 and scale.grad != 0


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_the_fused_loss_allocates_no_strip(monkeypatch, kind) -> None:
    """Its compiled kernels never use one, and the strips' default on CUDA was a whole tile."""

    def no_strip(*args):
        raise AssertionError("the fused path allocated a strip")

    monkeypatch.setattr(tiles_torch, "_strip_buffer", no_strip)
    images, texts = (t.requires_grad_() for t in _block(64, 64))
    bias = torch.tensor(-5.0, dtype=torch.float64) if kind == "sigmoid" else None
    contrastive_loss(images, texts, SCALE, logit_bias=bias, kind=kind, tile_size=16).backward()
    assert images.grad.abs().sum() > 0


def test_fused_sigmoid_matches_strips(monkeypatch) -> None:
    images, texts = _block(13, 11)
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(tiles_torch, "_fused", lambda device, fused=fused: fused)
        grads = torch.zeros_like(images), torch.zeros_like(texts)
        sums = tiles_torch.sigmoid_forward_backward(images, texts, SCALE, -8.0, 0.3, *grads, 5)
        results[fused] = (*sums, *grads)
    for actual, expected in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())


def test_fused_backward_and_sigmoid_are_one_kernel_each() -> None:
    """G (either loss) comes from one generated kernel: one read of the tile's ``I·Tᵀ`` (the scale,
    the shifts, the signs and the positives are device inputs), one write of G."""
    from torch._inductor import metrics

    products, scale, sign = torch.randn(64, 48), torch.tensor(20.0), torch.tensor(-1.0)
    shifts, positives = (torch.randn(64), torch.randn(48)), torch.arange(64) - 8
    for fn, args in [
        (
            tiles_torch._softmax_tile_grads,
            (products, scale, *shifts, sign, -sign, positives, sign, torch.bfloat16),
        ),
        (tiles_torch._sigmoid_tile, (products, scale, torch.tensor(-8.0), sign, positives, torch.bfloat16)),
    ]:
        torch._dynamo.reset()
        metrics.reset()
        torch.compile(fn, dynamic=True)(*args)
        assert metrics.generated_kernel_count == 1, fn.__name__


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_features_multiply_in_fp32_and_match_fp64(monkeypatch, fused) -> None:
    """bf16 features (what Gradient Cache hands the tiles on CUDA in bf16 training): logits and
    sums in fp32, so the LSEs match fp64 on the same rounded values to fp32 rounding; G is fp32 in
    the strips and bf16 in the fused GEMM operand (8 bits)."""
    monkeypatch.setattr(tiles_torch, "_fused", lambda device: fused)
    images, texts = (t.bfloat16() for t in _block(40, 36, dim=16))
    exact_images, exact_texts = images.double(), texts.double()
    logits = SCALE * exact_images @ exact_texts.t()
    row_lse, col_lse = torch.full((40,), -torch.inf), torch.full((36,), -torch.inf)
    tiles_torch.softmax_forward(images, texts, SCALE, row_lse, col_lse, 16)
    torch.testing.assert_close(row_lse.double(), logits.logsumexp(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(col_lse.double(), logits.logsumexp(0), rtol=1e-6, atol=0)
    grads = torch.zeros(40, 16), torch.zeros(36, 16)
    tiles_torch.softmax_backward(images, texts, SCALE, row_lse, -0.3, col_lse, 0.7, *grads, 16)
    expected = _expected_grads(exact_images, exact_texts, row_lse.double(), -0.3, col_lse.double(), 0.7)
    tolerance = 1e-2 if fused else 1e-5
    for actual, want in zip(grads, expected, strict=True):
        assert actual.dtype == torch.float32
        assert (actual.double() - want).norm() <= tolerance * want.norm()


def _matched_pairs(n: int = 48, dim: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 features of pairs a model has learned: each image near its text, so at scale 15 the
    positive's probability is 1 - ε with ε from about 1e-4 to 1 over the rows."""
    gen = torch.Generator().manual_seed(7)
    texts = F.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)
    noise = torch.randn(n, dim, generator=gen, dtype=torch.float64) * torch.linspace(0.01, 0.3, n)[:, None]
    return F.normalize(texts + noise, dim=1).bfloat16(), texts.bfloat16()


def _row_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (actual.double() - expected).norm(dim=1) / expected.norm(dim=1)


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_gradients_keep_the_pull_of_well_matched_pairs(monkeypatch, fused) -> None:
    """A learned pair's gradient is the small difference ``P + Q - 2`` (softmax) or ``sigmoid(X) - 1``
    on the diagonal: taken after G is rounded to bf16 (8 bits: 2 - 2ε is 2 for ε < 1/256), the pull
    towards its partner was lost (the softmax's rows here were off by up to 1.6 times their size).
    Each row's image gradient against fp64 on the same bf16 values, for both losses."""
    monkeypatch.setattr(tiles_torch, "_fused", lambda device: fused)
    images, texts = _matched_pairs()
    n, scale = len(images), 15.0
    diagonal = torch.arange(n)
    exact_images, exact_texts = images.double().requires_grad_(), texts.double()
    logits = scale * exact_images @ exact_texts.t()
    (1 / scale * clip_loss_formula(exact_images, exact_texts, scale)).backward()
    row_lse, col_lse = torch.full((n,), -torch.inf), torch.full((n,), -torch.inf)
    tiles_torch.softmax_forward(images, texts, scale, row_lse, col_lse, 16)
    grads = torch.zeros(n, 32), torch.zeros(n, 32)
    coefs = dict(positives=diagonal, positive_coef=-1 / n)
    tiles_torch.softmax_backward(
        images, texts, scale, row_lse, 0.5 / n, col_lse, 0.5 / n, *grads, 16, **coefs
    )
    softmax_errors = _row_errors(grads[0], exact_images.grad)
    bias, grads = -10.0, (torch.zeros(n, 32), torch.zeros(n, 32))
    tiles_torch.sigmoid_forward_backward(images, texts, scale, bias, 1 / n, *grads, 16, positives=diagonal)
    expected = ((logits + bias).sigmoid() - torch.eye(n, dtype=torch.float64)) / n @ exact_texts
    sigmoid_errors = _row_errors(grads[0], expected.detach())
    epsilon = 1 - logits.detach().softmax(dim=1).diagonal()
    assert epsilon.min() < 1e-3 and epsilon.max() > 1e-2  # the rows span the range where it mattered
    tolerance = 2e-2 if fused else 1e-3  # G in bf16 (the fused GEMM's operand) or in fp32 (strips)
    assert softmax_errors.max() < tolerance, softmax_errors
    assert sigmoid_errors.max() < tolerance, sigmoid_errors


@pytest.mark.usefixtures("fused")
def test_where_the_compiler_fails_the_tiles_run_eager_and_say_so(caplog) -> None:
    """A box whose compiler cannot build the kernels (here a C++ compiler that is not there, as a
    GPU box without the one Triton needs): the loss still runs, exact, with one warning a function.
    The compiler is in the compiled graphs' cache key: no kernel cached by another test is reused."""
    tiles_torch._compiled.cache_clear()
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
            images, texts = _adversarial("random")
            expected = _run(clip_loss_formula, images, texts, SCALE)
            actual = _run(lambda i, t, s: contrastive_loss(i, t, s, tile_size=8), images, texts, SCALE)
    finally:
        tiles_torch._compiled.cache_clear()
        torch._dynamo.reset()
    _assert_all_close(actual, expected, rtol=1e-10, atol=1e-10)
    eager = sorted(r.getMessage().split()[3] for r in caplog.records if "runs" in r.getMessage())
    assert eager == ["_softmax_tile_grads", "_softmax_tile_stats"], caplog.text  # once each


def test_fused_positives_anywhere_in_the_block_match_the_strips(monkeypatch) -> None:
    """Hard negatives on a rank whose rows pair with texts of another rank's block: each row's
    positive column lies in any tile of the block, or in none (-1); the fused kernels find it from
    the tile's first column, the strips add it after. Both losses, fp64, to rounding."""
    images, texts = _block(13, 17)
    positives = torch.tensor([16, -1, 0, 5, 5, -1, 11, 3, -1, 12, 7, 16, 1])  # 5 and 16 twice
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(tiles_torch, "_fused", lambda device, fused=fused: fused)
        row_lse, col_lse = (torch.full((size,), -torch.inf, dtype=torch.float64) for size in (13, 17))
        tiles_torch.softmax_forward(images, texts, SCALE, row_lse, col_lse, 5)
        softmax = torch.zeros_like(images), torch.zeros_like(texts)
        tiles_torch.softmax_backward(
            images,
            texts,
            SCALE,
            row_lse,
            0.4,
            col_lse,
            0.2,
            *softmax,
            5,
            positives=positives,
            positive_coef=-0.7,
        )
        sigmoid = torch.zeros_like(images), torch.zeros_like(texts)
        sums = tiles_torch.sigmoid_forward_backward(
            images, texts, SCALE, -8.0, 0.3, *sigmoid, 5, positives=positives
        )
        results[fused] = (*softmax, *sigmoid, *sums)
    for actual, expected in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())
    delta = torch.zeros(13, 17, dtype=torch.float64)
    delta[positives >= 0, positives[positives >= 0]] = 1.0
    logits = SCALE * images @ texts.t()
    expected_images, _ = _expected_grads(images, texts, row_lse, 0.4, col_lse, 0.2)
    torch.testing.assert_close(
        results[False][0], expected_images - 0.7 * delta @ texts, rtol=1e-12, atol=1e-12
    )
    sigmoid_grads = 0.3 * ((logits - 8.0).sigmoid() - delta)
    torch.testing.assert_close(results[False][2], sigmoid_grads @ texts, rtol=1e-12, atol=1e-12)
