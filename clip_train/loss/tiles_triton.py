"""Triton tiles: the functions of ``tiles_torch.py`` as fused CUDA kernels.

Features may be fp32, bf16 or fp16; logits, exponentials and accumulators are fp32 (fp32 dots
use TF32 only when ``torch.backends.cuda.matmul.allow_tf32`` is set). The softmax forward writes
per-tile row and column LSEs that the host merges; it hands no last tile to the backward.

Gradients use no atomics: ``dI = G T`` and ``dT = Gᵀ I`` are two launches of one *owner* kernel,
each program holding a block of one side's rows and their whole fp32 gradient in registers while
every row of the other side streams past. A tile-grid backward would instead do n·m·d/32 global
atomic read-modify-writes (275 GB at n = m = 65,536, d = 512); the price is one more logits
recomputation, and the d ≤ 1024 limit (≤ 512 for fp32). The sigmoid's owner launches also sum
each row's pair losses. Plain ``tl`` ops, masked loads and int64 offsets keep the kernels runnable
under ``TRITON_INTERPRET=1`` (how CI tests them) and compilable ahead of time for sm_80/sm_90
without a GPU (``tests/test_triton_aot.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

PARTIAL_BUDGET = 1 << 24  # floats in the softmax forward's per-tile partial LSE buffers
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ARCHS = (80, 90)  # the GPU architectures the launch tables are tuned and checked for


@dataclass(frozen=True)
class OwnerBlock:
    """Rows one owner program holds (their fp32 gradient lives in registers) and rows it streams
    per step, with the warps and pipeline stages that hold them."""

    owned: int
    streamed: int
    warps: int = 8
    stages: int = 2


# By operands (16-bit, TF32, or IEEE fp32, which runs on CUDA cores) and padded dim. On tensor
# cores: the largest owned blocks that compile without spills on sm_80 and sm_90 and whose logits
# tile gives every warp its own MMA tiles, so that no instruction is repeated (tests/test_triton_aot.py
# counts them in the PTX). Owning more rows streams the other side fewer times; 32 rows stream it
# twice as often as 64. Why not 64 at d = 512: their fp32 gradient alone is 128 KiB of registers;
# one warpgroup cannot hold it, and two repeat the 64-row logits, since Triton stacks warpgroups
# along the rows (the AOT test keeps both facts checked).
OWNER_BLOCKS = {
    "16-bit": {
        64: OwnerBlock(32, 64),
        128: OwnerBlock(32, 64),
        256: OwnerBlock(32, 64),
        512: OwnerBlock(32, 64),
        1024: OwnerBlock(16, 32),  # every layout that shares out the logits spills: half repeat
    },
    "tf32": {
        64: OwnerBlock(32, 64, stages=1),
        128: OwnerBlock(32, 64),
        256: OwnerBlock(32, 64, stages=1),
        512: OwnerBlock(16, 32, warps=4, stages=1),  # 32 rows of fp32 operands spill
    },
    "fp32": {  # FMA dots: no MMA tiles to share out, the widest blocks that do not spill
        64: OwnerBlock(64, 16, stages=1),
        128: OwnerBlock(64, 16),
        256: OwnerBlock(32, 16),
        512: OwnerBlock(16, 16, stages=1),
    },
}
# Hopper's wgmma takes 64-row warpgroup tiles: two warpgroups own 128 rows where their fp32
# gradient fits without spilling (d = 64).
HOPPER_OWNER_BLOCKS = {"16-bit": {64: OwnerBlock(128, 64)}}


@dataclass(frozen=True)
class Launch:
    """Block sizes and launch options of one kernel specialisation."""

    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for fp32 only when PyTorch allows it (never interpreted)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not interpreted
    return "tf32" if tf32 else "ieee"


def _arch(device: torch.device) -> int:
    """The table to launch from: Hopper's on sm_90 and later, Ampere's otherwise (and interpreted)."""
    if device.type != "cuda":
        return ARCHS[0]
    major, _ = torch.cuda.get_device_capability(device)
    return 90 if major >= 9 else 80


def _operands(dtype: torch.dtype, precision: str) -> str:
    """The owner-block table for ``dtype`` features dotted at ``precision``."""
    return "16-bit" if dtype.itemsize == 2 else "tf32" if precision == "tf32" else "fp32"


def max_dim(dtype: torch.dtype) -> int:
    """The widest embedding the backward can hold on chip for features of ``dtype``."""
    return max(OWNER_BLOCKS[_operands(dtype, "ieee")])


def forward_launch(dtype: torch.dtype, has_cols: bool, precision: str) -> Launch:
    """16-bit operands take twice the rows and depth for the same shared memory; the fp32 logits
    tile and its exponentials bound the rest (128 × 128 spills)."""
    rows, depth = (128, 64) if dtype != torch.float32 else (64, 32)
    constexprs = dict(HAS_COLS=has_cols, BLOCK_M=rows, BLOCK_N=64, BLOCK_D=depth, PRECISION=precision)
    return Launch(constexprs, num_warps=8, num_stages=3)


def owner_launch(dtype: torch.dtype, dim: int, sigmoid: bool, precision: str, arch: int) -> Launch:
    """The owner kernel's specialisation for features of ``dtype`` and width ``dim`` on ``arch``."""
    dim_block = max(64, triton.next_power_of_2(dim))
    operands = _operands(dtype, precision)
    hopper = HOPPER_OWNER_BLOCKS.get(operands, {}) if arch >= 90 else {}
    block = hopper.get(dim_block) or OWNER_BLOCKS[operands][dim_block]
    constexprs = dict(
        SIGMOID=sigmoid,
        BLOCK_OWNED=block.owned,
        BLOCK_STREAMED=block.streamed,
        BLOCK_DIM=dim_block,
        PRECISION=precision,
    )
    return Launch(constexprs, num_warps=block.warps, num_stages=block.stages)


@triton.jit
def _softmax_forward_kernel(
    images, texts, row_part, col_part, n, m, dim, stride_images, stride_texts, scale,
    HAS_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n, cols < m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_offsets = rows.to(tl.int64)[:, None] * stride_images
    col_offsets = cols.to(tl.int64)[:, None] * stride_texts
    for start in range(0, dim, BLOCK_D):
        ks = start + tl.arange(0, BLOCK_D)
        k_mask = ks < dim
        a = tl.load(images + row_offsets + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(texts + col_offsets + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    x = tl.where(row_mask[:, None] & col_mask[None, :], acc * scale, float("-inf"))
    row_max = tl.where(row_mask, tl.max(x, axis=1), 0.0)
    row_sums = tl.where(row_mask, tl.sum(tl.exp(x - row_max[:, None]), axis=1), 1.0)
    tl.store(row_part + tl.program_id(1).to(tl.int64) * n + rows, row_max + tl.log(row_sums), mask=row_mask)
    if HAS_COLS:
        col_max = tl.where(col_mask, tl.max(x, axis=0), 0.0)
        col_sums = tl.where(col_mask, tl.sum(tl.exp(x - col_max[None, :]), axis=0), 1.0)
        col_lse = col_max + tl.log(col_sums)
        tl.store(col_part + tl.program_id(0).to(tl.int64) * m + cols, col_lse, mask=col_mask)


@triton.jit
def _owner_kernel(
    owned, streamed, owned_lse, streamed_lse, grad, row_sums, softplus_sums, n_owned, n_streamed, dim,
    stride_owned, stride_streamed, scale, bias, owned_coef, streamed_coef, grad_scale,
    SIGMOID: tl.constexpr, BLOCK_OWNED: tl.constexpr, BLOCK_STREAMED: tl.constexpr,
    BLOCK_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``grad[rows] += grad_scale · Σ_j g_ij streamed_j`` for this program's owned rows, with
    ``x_ij = scale · owned_i · streamed_j`` and, for softmax,
    ``g_ij = owned_coef·exp(x_ij - owned_lse_i) + streamed_coef·exp(x_ij - streamed_lse_j)``,
    for sigmoid ``g_ij = owned_coef·sigmoid(x_ij + bias)`` (then ``row_sums`` gets Σ_j g_ij and
    ``softplus_sums`` Σ_j softplus(x_ij + bias), the loss).
    The coefficients arrive divided by ``grad_scale`` so that |g| ≤ 2 survives the cast to a
    16-bit dot operand."""
    first = tl.program_id(0) * BLOCK_OWNED
    rows = first + tl.arange(0, BLOCK_OWNED)
    ks = tl.arange(0, BLOCK_DIM)
    row_mask, k_mask = rows < n_owned, ks < dim
    # int32 offsets into the streamed side (``_check`` bounds its size): 64-bit addresses per
    # element cost the registers that decide whether a 32-row block spills.
    owned_block = tl.load(
        owned
        + first.to(tl.int64) * stride_owned
        + (tl.arange(0, BLOCK_OWNED)[:, None] * stride_owned + ks[None, :]),
        mask=row_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    streamed_offsets = tl.arange(0, BLOCK_STREAMED)[:, None] * stride_streamed + ks[None, :]
    if not SIGMOID:
        row_lse = tl.load(owned_lse + rows, mask=row_mask, other=float("inf"))
    acc = tl.zeros((BLOCK_OWNED, BLOCK_DIM), dtype=tl.float32)
    sums = tl.zeros((BLOCK_OWNED,), dtype=tl.float32)
    softplus = tl.zeros((BLOCK_OWNED,), dtype=tl.float32)
    for start in range(0, n_streamed, BLOCK_STREAMED):
        cols = start + tl.arange(0, BLOCK_STREAMED)
        col_mask = cols < n_streamed
        block = tl.load(
            streamed + (start * stride_streamed + streamed_offsets),
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        x = tl.dot(owned_block, tl.trans(block), input_precision=PRECISION) * scale
        if SIGMOID:
            z = x + bias
            e = tl.exp(-tl.abs(z))  # one exp serves the loss and the gradient, neither overflows
            g = owned_coef * tl.where(z >= 0, 1.0, e) / (1.0 + e)
            pair_loss = tl.maximum(z, 0.0) + tl.log(1.0 + e)
            softplus += tl.sum(tl.where(row_mask[:, None] & col_mask[None, :], pair_loss, 0.0), axis=1)
        else:
            col_lse = tl.load(streamed_lse + cols, mask=col_mask, other=float("inf"))
            g = owned_coef * tl.exp(x - row_lse[:, None]) + streamed_coef * tl.exp(x - col_lse[None, :])
        # Padding is zero, so x = 0 there, and exp(0 - lse) may overflow: inf·0 would be NaN.
        g = tl.where(row_mask[:, None] & col_mask[None, :], g, 0.0)
        if SIGMOID:
            sums += tl.sum(g, axis=1)
        acc = tl.dot(g.to(block.dtype), block, acc, input_precision=PRECISION)
    out = grad + first.to(tl.int64) * dim + (tl.arange(0, BLOCK_OWNED)[:, None] * dim + ks[None, :])
    out_mask = row_mask[:, None] & k_mask[None, :]
    tl.store(out, tl.load(out, mask=out_mask, other=0.0) + acc * grad_scale, mask=out_mask)
    if SIGMOID:
        tl.store(row_sums + rows, sums * grad_scale, mask=row_mask)
        tl.store(softplus_sums + rows, softplus, mask=row_mask)


def _check(features: tuple[torch.Tensor, ...], accumulators: tuple[torch.Tensor, ...] = ()) -> None:
    dtypes = {t.dtype for t in features}
    if len(dtypes) != 1 or features[0].dtype not in DTYPES:
        raise ValueError(f"triton loss kernels take fp32, bf16 or fp16 features of one dtype, got {dtypes}")
    for t in accumulators:
        if t.dtype != torch.float32:
            raise ValueError(f"triton loss kernels accumulate in float32, got a {t.dtype} accumulator")
    for t in (*features, *accumulators):
        if not t.is_contiguous():
            raise ValueError(f"triton loss kernels take contiguous tensors, got strides {t.stride()}")
    if max(t.numel() for t in features) >= 2**31:  # the owner kernel's offsets are int32
        raise ValueError("triton loss kernels take under 2^31 elements per feature block; use more ranks")
    if features[0].shape[1] > (limit := max_dim(features[0].dtype)):
        raise ValueError(f"triton loss kernels take {features[0].dtype} features with d <= {limit}")


def _launch(kernel: Any, grid: tuple[int, ...], launch: Launch, *args: Any) -> None:
    kernel[grid](*args, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)


def softmax_forward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: float,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor | None,
    tile: int,
) -> None:
    """Merge the row (and column) log-sum-exps of ``scale · images @ textsᵀ`` into the accumulators."""
    _check((images, texts))
    (n, dim), m = images.shape, texts.shape[0]
    launch = forward_launch(images.dtype, col_lse is not None, _precision(images.dtype))
    block_m, block_n = launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"]
    row_tiles = triton.cdiv(n, block_m)
    # Partial LSEs per column of a chunk: one per row tile, plus n/BLOCK_N per row.
    floats_per_column = row_tiles + triton.cdiv(n, block_n)
    chunk = max(block_n, min(tile, PARTIAL_BUDGET // floats_per_column) // block_n * block_n)
    for start in range(0, m, chunk):
        part = texts[start : start + chunk]
        grid = (row_tiles, triton.cdiv(len(part), block_n))
        row_part = row_lse.new_empty(grid[1], n)
        col_part = row_lse.new_empty(grid[0], len(part)) if col_lse is not None else row_part
        args = (images, part, row_part, col_part, n, len(part), dim, images.stride(0), part.stride(0), scale)
        _launch(_softmax_forward_kernel, grid, launch, *args)
        torch.logaddexp(row_lse, torch.logsumexp(row_part, dim=0), out=row_lse)
        if col_lse is not None:
            cols = col_lse[start : start + len(part)]
            torch.logaddexp(cols, torch.logsumexp(col_part, dim=0), out=cols)


def _owner_pass(
    owned: torch.Tensor,
    streamed: torch.Tensor,
    grad: torch.Tensor,
    scale: float,
    coefs: tuple[float, float, float],
    lse: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: float = 0.0,
    sums: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """One owner-kernel launch, ``grad += G @ streamed`` with G oriented owned × streamed.

    Softmax takes the (owned, streamed) LSEs; sigmoid takes ``sums``, which receive each owned
    row's Σ_j g_ij and Σ_j softplus(x_ij + bias). ``coefs`` is (owned, streamed, grad_scale).
    """
    sigmoid = sums is not None
    launch = owner_launch(owned.dtype, owned.shape[1], sigmoid, _precision(owned.dtype), _arch(owned.device))
    grid = (triton.cdiv(len(owned), launch.constexprs["BLOCK_OWNED"]),)
    unused = (grad, grad)  # pointers the specialisation never reads must still be tensors
    args = (
        owned, streamed, *(lse or unused), grad, *(sums or unused), len(owned), len(streamed), owned.shape[1],
        owned.stride(0), streamed.stride(0), scale, bias, *coefs,
    )  # fmt: skip
    _launch(_owner_kernel, grid, launch, *args)


def softmax_backward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: float,
    row_lse: torch.Tensor,
    row_coef: float,
    col_lse: torch.Tensor | None,
    col_coef: float,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
    tile: int,
    last_tile: None = None,
) -> None:
    """Add ``G @ texts`` to ``grad_images`` and ``Gᵀ @ images`` to ``grad_texts`` (see tiles_torch.py).

    ``last_tile`` is always ``None``: the Triton forward keeps no logits to hand over.
    """
    del tile, last_tile  # each program streams the whole other side; nothing to chunk or reuse
    if col_lse is None:  # hard negatives: an infinite LSE makes the term exactly 0, not 0 · overflow
        col_lse, col_coef = row_lse.new_full((len(texts),), float("inf")), 0.0
    _check((images, texts), (row_lse, col_lse, grad_images, grad_texts))
    grad_scale = max(abs(row_coef), abs(col_coef))
    if grad_scale == 0:  # both terms are zero: so is G
        return
    row_coef, col_coef = row_coef / grad_scale, col_coef / grad_scale
    _owner_pass(images, texts, grad_images, scale, (row_coef, col_coef, grad_scale), lse=(row_lse, col_lse))
    _owner_pass(texts, images, grad_texts, scale, (col_coef, row_coef, grad_scale), lse=(col_lse, row_lse))


def sigmoid_forward_backward(
    images: torch.Tensor,
    texts: torch.Tensor,
    scale: float,
    bias: float,
    coef: float,
    grad_images: torch.Tensor,
    grad_texts: torch.Tensor,
    tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ softplus(X)`` and ``Σ G``, and ``G @ texts`` into ``grad_images`` and ``Gᵀ @ images``
    into ``grad_texts`` for ``G = coef · sigmoid(X)`` (see tiles_torch.py): two owner launches."""
    del tile  # each program streams the whole other side; nothing to chunk
    _check((images, texts), (grad_images, grad_texts))
    grad_scale = abs(coef) or 1.0
    coefs = (coef / grad_scale, 0.0, grad_scale)
    row_sums = images.new_zeros(2, len(images), dtype=torch.float32)  # Σ_j g_ij and Σ_j softplus
    col_sums = images.new_zeros(2, len(texts), dtype=torch.float32)
    _owner_pass(images, texts, grad_images, scale, coefs, bias=bias, sums=row_sums.unbind())
    _owner_pass(texts, images, grad_texts, scale, coefs, bias=bias, sums=col_sums.unbind())
    return row_sums[1].sum(), row_sums[0].sum()  # the text launch's sums are the same totals


def launches(arch: int) -> Iterator[tuple[str, Launch, dict[str, str]]]:
    """Every specialisation the functions above can launch on ``arch``, with its argument types:
    what ``tests/test_triton_aot.py`` compiles."""
    for dtype, name in DTYPES.items():
        forward_args = {
            **dict.fromkeys(["images", "texts"], f"*{name}"),
            **dict.fromkeys(["row_part", "col_part"], "*fp32"),
            **dict.fromkeys(["n", "m", "dim", "stride_images", "stride_texts"], "i32"),
            "scale": "fp32",
        }
        owner_args = {
            **dict.fromkeys(["owned", "streamed"], f"*{name}"),
            **dict.fromkeys(["owned_lse", "streamed_lse", "grad", "row_sums", "softplus_sums"], "*fp32"),
            **dict.fromkeys(["n_owned", "n_streamed", "dim", "stride_owned", "stride_streamed"], "i32"),
            **dict.fromkeys(["scale", "bias", "owned_coef", "streamed_coef", "grad_scale"], "fp32"),
        }
        for precision in ("tf32", "ieee") if dtype == torch.float32 else ("ieee",):
            for has_cols in (True, False):
                yield "_softmax_forward_kernel", forward_launch(dtype, has_cols, precision), forward_args
            for dim_block in OWNER_BLOCKS[_operands(dtype, precision)]:
                for sigmoid in (False, True):
                    yield (
                        "_owner_kernel",
                        owner_launch(dtype, dim_block, sigmoid, precision, arch),
                        owner_args,
                    )
