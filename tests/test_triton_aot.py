"""The Triton loss kernels, compiled ahead of time for A100 (sm_80) and H100 (sm_90) on this CPU.

``triton.compile`` needs no GPU to lower a kernel to PTX and cubin, and Triton ships NVIDIA's
``ptxas``, whose ``-v`` report gives registers and spills. Every specialisation the package can
launch (``tiles_triton.launches(arch)``: each dtype, TF32 or IEEE fp32 dots, with and without the
column term, every padded embedding width) must compile for both architectures within the
architecture's shared memory and, with Triton 3.8, without register spills. The backward's global
atomic traffic, the tensor-core work the loss executes and the bytes the backward streams are
derived from the PTX and the launch grid.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
tl = triton.language

ARCHS = (80, 90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory one block may use
# Bytes of registers a thread may spill. Triton 3.8 (what a fresh install resolves) fits every block;
# Triton 3.6 (torch 2.11: the supported floor and the Docker image) spills up to 356 B in the 16-bit
# d = 512 and 1,024 and TF32 d = 512 blocks, and every block there that does not spill repeats MMA
# work instead (1.5-2.5x, swept over owned and streamed rows, 4 or 8 warps, 1-3 stages).
SPILL_ALLOWANCE = 0 if tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 8) else 400
# The tile-grid backward this replaces: every 64×64 tile added its 64 × d partial gradients into
# both outputs with fp32 atomics, n·m·d/32 read-modify-writes in all.
N = M = 65_536
DIM = 512
TILE_GRID_ATOMIC_BYTES = N * M * DIM // 32 * 4  # 275 GB


@dataclass(frozen=True)
class Compiled:
    arch: int
    kernel: str
    features: str  # the feature dtype: fp32, bf16 or fp16
    constexprs: dict
    threads: int
    shared: int
    registers: int
    spilled: int  # bytes of spill stores + loads
    atomic_bytes_per_thread: int  # summed over the PTX's atomic instructions (each executed once)
    mma: MmaWork


@dataclass(frozen=True)
class MmaWork:
    """Multiply-adds one program issues to tensor cores: once, and on every trip of its loop."""

    once: int
    per_trip: int

    def total(self, trips: int) -> int:
        return self.once + self.per_trip * trips


ATOMIC = re.compile(r"^\s*(?:@!?%p\d+\s+)?(atom|red)\.([\w.]+)", re.MULTILINE)
TYPE_BYTES = {"f16x2": 4, "bf16x2": 4, "f16": 2, "bf16": 2, "f32": 4, "b32": 4, "u32": 4, "s32": 4}
TYPE_BYTES |= {"f64": 8, "b64": 8, "u64": 8, "s64": 8}


def atomic_bytes_per_thread(ptx: str) -> int:
    """Bytes one thread reads-modifies-writes if each atomic instruction in ``ptx`` runs once."""
    total = 0
    for _, suffix in ATOMIC.findall(ptx):
        parts = suffix.split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        total += vector * next(TYPE_BYTES[p] for p in reversed(parts) if p in TYPE_BYTES)
    return total


MMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?(w?gmma\.mma_async|mma\.sync)\S*\.m(\d+)n(\d+)k(\d+)", re.MULTILINE)
LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.MULTILINE)
BACK_BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def _warp_macs(ptx: str, warps: int) -> int:
    """Multiply-adds of ``ptx``'s MMA instructions, each executed once by every warp that issues
    it: ``mma.sync`` by each warp, Hopper's ``wgmma`` once per warpgroup of four."""
    return sum(
        int(m) * int(n) * int(k) * (warps // 4 if op.startswith("wgmma") else warps)
        for op, m, n, k in MMA.findall(ptx)
    )


def mma_work(ptx: str, warps: int) -> MmaWork:
    """Tensor-core multiply-adds per program, split into the code around the kernel's one loop and
    the loop body (from its label to the last branch back to it)."""
    labels = {m.group(1): m.start() for m in LABEL.finditer(ptx)}
    loops: dict[str, int] = {}  # loop label -> end of its last back edge
    for branch in BACK_BRANCH.finditer(ptx):
        if labels.get(branch.group(1), branch.end()) < branch.start():
            loops[branch.group(1)] = branch.end()
    assert len(loops) <= 1, "a kernel with several loops needs its trips counted per loop"
    if not loops:
        return MmaWork(_warp_macs(ptx, warps), 0)
    ((label, end),) = loops.items()
    start = labels[label]
    return MmaWork(_warp_macs(ptx[:start] + ptx[end:], warps), _warp_macs(ptx[start:end], warps))


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spilled bytes) from Triton's bundled ptxas -v."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ptx")
        source.write_text(ptx)
        result = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", target, str(source), "-o", str(Path(tmp, "kernel.cubin"))],
            capture_output=True,
            text=True,
            check=True,
        )
    report = result.stdout + result.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return registers, int(spills.group(1)) + int(spills.group(2))


def compile_one(
    arch: int, kernel: str, signature: dict, constexprs: dict, warps: int, stages: int
) -> Compiled:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from clip_train.loss import tiles_triton

    fn = getattr(tiles_triton, kernel)
    types = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(fn, {name: types[name] for name in fn.arg_names}, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = compiled.asm["ptx"]
    registers, spilled = _ptxas_report(ptx)
    per_thread = atomic_bytes_per_thread(ptx)
    features = signature.get("images", signature.get("owned", "*?")).lstrip("*")
    return Compiled(
        arch,
        kernel,
        features,
        constexprs,
        32 * warps,
        compiled.metadata.shared,
        registers,
        spilled,
        per_thread,
        mma_work(ptx, warps),
    )


@pytest.fixture(scope="module")
def compiled() -> list[Compiled]:
    """Every launchable specialisation for both architectures, compiled on all cores."""
    from clip_train.loss import tiles_triton

    jobs = [
        (arch, kernel, signature, launch.constexprs, launch.num_warps, launch.num_stages)
        for arch in ARCHS
        for kernel, launch, signature in tiles_triton.launches(arch)
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count(), mp_context=context) as pool:
        return list(pool.map(compile_one, *zip(*jobs, strict=True)))


def test_every_launchable_variant_compiles_within_registers_and_shared_memory(compiled) -> None:
    from clip_train.loss import tiles_triton

    assert len(compiled) == sum(len(list(tiles_triton.launches(arch))) for arch in ARCHS)
    kinds = {(c.kernel, c.constexprs.get("HAS_COLS"), c.constexprs["PRECISION"]) for c in compiled}
    assert {k for k in kinds if k[0] == "_softmax_forward_kernel"} == {
        ("_softmax_forward_kernel", cols, precision)
        for cols in (True, False)
        for precision in ("tf32", "ieee")
    }
    over = [
        f"{c.kernel} sm_{c.arch} {c.features} {c.constexprs}: {c.spilled} B spilled, {c.shared} B shared"
        for c in compiled
        if c.spilled > SPILL_ALLOWANCE or c.registers > 255 or c.shared > SHARED_LIMIT[c.arch]
    ]
    assert not over, "\n".join(over)


@triton.jit
def _atomic_control(out, n, BLOCK: tl.constexpr):
    """A known atomic workload for the counter: each program adds BLOCK floats n/BLOCK times."""
    offsets = tl.arange(0, BLOCK)
    for _ in range(0, n, BLOCK):
        tl.atomic_add(out + offsets, tl.full((BLOCK,), 1.0, tl.float32))


def test_atomic_counter_reproduces_a_known_workload() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block, n, programs, warps = 256, 4096, 10, 4
    source = ASTSource(
        _atomic_control, {"out": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": block}
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 80, 32), options={"num_warps": warps}).asm["ptx"]
    trips = n // block
    derived = atomic_bytes_per_thread(ptx) * 32 * warps * trips * programs
    assert derived == programs * trips * block * 4


def test_backward_global_atomic_traffic_is_under_an_eighth_of_the_tile_grid(compiled) -> None:
    """Upper bound at n = m = 65,536, d = 512: every atomic instruction counted as if it ran on
    every trip of the streamed loop, in every program of the two owner launches."""
    from clip_train.loss import tiles_triton

    backward = [c for c in compiled if c.kernel == "_owner_kernel" and c.constexprs["BLOCK_DIM"] == DIM]
    assert len(backward) == len(ARCHS) * 4 * 2  # bf16, fp16, fp32 with TF32 or IEEE dots; softmax, sigmoid
    for c in backward:
        programs = math.ceil(N / c.constexprs["BLOCK_OWNED"])
        trips = math.ceil(M / c.constexprs["BLOCK_STREAMED"])
        traffic = 2 * programs * c.threads * trips * c.atomic_bytes_per_thread  # dI and dT launches
        assert traffic <= TILE_GRID_ATOMIC_BYTES / 8, (
            f"{c.kernel} sm_{c.arch} {c.constexprs}: {traffic:,} bytes"
        )
    forward = [c for c in compiled if c.kernel.endswith("_forward_kernel")]
    assert all(c.atomic_bytes_per_thread == 0 for c in forward)
    assert all(tiles_triton.max_dim(dtype) >= DIM for dtype in tiles_triton.DTYPES)


@triton.jit
def _matmul_control(a, b, out, K: tl.constexpr, BLOCK: tl.constexpr):
    """A known tensor-core workload: one BLOCK × BLOCK output tile of an (BLOCK × K)(K × BLOCK)
    product, K / BLOCK trips of one dot each."""
    rows, ks = tl.arange(0, BLOCK), tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(a + rows[:, None] * K + start + ks[None, :])
        y = tl.load(b + (start + ks)[:, None] * BLOCK + rows[None, :])
        acc = tl.dot(x, y, acc)
    tl.store(out + rows[:, None] * BLOCK + rows[None, :], acc)


@pytest.mark.parametrize("arch", ARCHS)
def test_mma_counter_reproduces_a_known_workload(arch: int) -> None:
    """The counter finds mma.sync (sm_80) and wgmma (sm_90) work and credits it to the loop."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block, k, warps = 128, 4096, 8
    signature = {"a": "*bf16", "b": "*bf16", "out": "*fp32", "K": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(_matmul_control, signature, constexprs={"K": k, "BLOCK": block})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    work = mma_work(compiled.asm["ptx"], warps)
    assert work.total(k // block) == block * block * k


def _loss_macs(compiled: list[Compiled], arch: int, features: str, precision: str) -> int:
    """Tensor-core multiply-adds of one softmax forward and backward at N = M, d = DIM on ``arch``:
    the forward kernel over its (row tile, column tile) grid, then the two owner launches."""
    ours = [
        c
        for c in compiled
        if (c.arch, c.features, c.constexprs["PRECISION"]) == (arch, features, precision)
        and c.constexprs.get("HAS_COLS", True)
        and not c.constexprs.get("SIGMOID", False)
        and c.constexprs.get("BLOCK_DIM", DIM) == DIM
    ]
    forward, owner = (
        next(c for c in ours if c.kernel == name) for name in ("_softmax_forward_kernel", "_owner_kernel")
    )
    forward_grid = math.ceil(N / forward.constexprs["BLOCK_M"]) * math.ceil(M / forward.constexprs["BLOCK_N"])
    forward_macs = forward_grid * forward.mma.total(math.ceil(DIM / forward.constexprs["BLOCK_D"]))
    programs = math.ceil(N / owner.constexprs["BLOCK_OWNED"])
    return forward_macs + 2 * programs * owner.mma.total(math.ceil(M / owner.constexprs["BLOCK_STREAMED"]))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("features", "precision"), [("bf16", "ieee"), ("fp16", "ieee"), ("fp32", "tf32")])
def test_the_loss_issues_each_multiply_add_once(compiled, arch: int, features: str, precision: str) -> None:
    """Forward and backward are 5 matmul-equivalents (logits; then per owner launch the logits
    again and G·streamed): the MMAs the PTX issues over the launch grid stay within 15 % of that,
    so no warp repeats another's tile. (IEEE fp32 dots use no tensor cores.)"""
    ideal = 5 * N * M * DIM
    assert ideal <= _loss_macs(compiled, arch, features, precision) <= 1.15 * ideal


def test_the_backward_streams_at_most_twice_what_64_row_blocks_would() -> None:
    """Each owner program reads the whole other side once: at d = 512 with 16-bit features (what
    Gradient Cache hands the loss in bf16 training) 32-row blocks read it twice as often as 64-row
    ones, and no more."""
    import torch

    from clip_train.loss import tiles_triton

    for arch in ARCHS:
        for dtype in (torch.bfloat16, torch.float16):
            launch = tiles_triton.owner_launch(dtype, DIM, False, "ieee", arch)
            streamed = math.ceil(N / launch.constexprs["BLOCK_OWNED"]) * M * DIM * dtype.itemsize
            assert streamed <= 2 * math.ceil(N / 64) * M * DIM * dtype.itemsize


def test_hopper_owns_128_rows_at_64_dims_and_64_rows_do_not_fit_at_512() -> None:
    """sm_90 owns 128 rows (two wgmma warpgroups) at d = 64. At d = 512 a 64-row block either
    spills (one warpgroup holds the 128 KiB fp32 gradient) or computes its logits twice (two
    warpgroups stacked on the same 64 rows): the reason the table stops at 32 rows there."""
    import torch

    from clip_train.loss import tiles_triton

    assert tiles_triton.owner_launch(torch.bfloat16, 64, False, "ieee", 90).constexprs["BLOCK_OWNED"] == 128
    launch = tiles_triton.owner_launch(torch.bfloat16, DIM, False, "ieee", 90)
    signature = next(sig for kernel, _, sig in tiles_triton.launches(90) if kernel == "_owner_kernel")
    signature = {**signature, "owned": "*bf16", "streamed": "*bf16"}
    for warps in (4, 8):
        constexprs = {**launch.constexprs, "BLOCK_OWNED": 64}
        try:
            c = compile_one(90, "_owner_kernel", signature, constexprs, warps, 1)
        except Exception as err:  # ptxas refuses: not enough registers for one instruction
            assert "registers" in str(err).lower()
            continue
        ideal_per_trip = 2 * 64 * constexprs["BLOCK_STREAMED"] * DIM
        assert c.spilled > 0 or c.mma.per_trip > 1.15 * ideal_per_trip, (
            f"64 rows at d = {DIM} now fit sm_90 with {warps} warps: revisit tiles_triton.OWNER_BLOCKS"
        )
