"""The Triton loss kernels, compiled ahead of time for A100 (sm_80) and H100 (sm_90) on this CPU.

``triton.compile`` needs no GPU to lower a kernel to PTX and cubin, and Triton ships NVIDIA's
``ptxas``, whose ``-v`` report gives registers and spills. Every specialisation the package can
launch (``tiles_triton.launches()``: each dtype, TF32 or IEEE fp32 dots, with and without the
column term, every padded embedding width) must compile for both architectures without register
spills and within the architecture's shared memory. The backward's global atomic traffic is
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

ARCHS = (80, 90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory one block may use
# The tile-grid backward this replaces: every 64×64 tile added its 64 × d partial gradients into
# both outputs with fp32 atomics, n·m·d/32 read-modify-writes in all.
N = M = 65_536
DIM = 512
TILE_GRID_ATOMIC_BYTES = N * M * DIM // 32 * 4  # 275 GB


@dataclass(frozen=True)
class Compiled:
    arch: int
    kernel: str
    constexprs: dict
    threads: int
    shared: int
    registers: int
    spilled: int  # bytes of spill stores + loads
    atomic_bytes_per_thread: int  # summed over the PTX's atomic instructions (each executed once)


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
    return Compiled(
        arch, kernel, constexprs, 32 * warps, compiled.metadata.shared, registers, spilled, per_thread
    )


@pytest.fixture(scope="module")
def compiled() -> list[Compiled]:
    """Every launchable specialisation for both architectures, compiled on all cores."""
    from clip_train.loss import tiles_triton

    jobs = [
        (arch, kernel, signature, launch.constexprs, launch.num_warps, launch.num_stages)
        for arch in ARCHS
        for kernel, launch, signature in tiles_triton.launches()
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count(), mp_context=context) as pool:
        return list(pool.map(compile_one, *zip(*jobs, strict=True)))


def test_every_launchable_variant_compiles_without_spills_within_shared_memory(compiled) -> None:
    from clip_train.loss import tiles_triton

    assert len(compiled) == len(ARCHS) * len(list(tiles_triton.launches()))
    kinds = {(c.kernel, c.constexprs.get("HAS_COLS"), c.constexprs["PRECISION"]) for c in compiled}
    assert {k for k in kinds if k[0] == "_softmax_forward_kernel"} == {
        ("_softmax_forward_kernel", cols, precision)
        for cols in (True, False)
        for precision in ("tf32", "ieee")
    }
    over = [
        f"{c.kernel} sm_{c.arch} {c.constexprs}: {c.spilled} bytes spilled, {c.shared} bytes shared"
        for c in compiled
        if c.spilled or c.registers > 255 or c.shared > SHARED_LIMIT[c.arch]
    ]
    assert not over, "\n".join(over)


@triton.jit
def _atomic_control(out, n, BLOCK: triton.language.constexpr):
    """A known atomic workload for the counter: each program adds BLOCK floats n/BLOCK times."""
    offsets = triton.language.arange(0, BLOCK)
    for _ in range(0, n, BLOCK):
        triton.language.atomic_add(
            out + offsets, triton.language.full((BLOCK,), 1.0, triton.language.float32)
        )


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
