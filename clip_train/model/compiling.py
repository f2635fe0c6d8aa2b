"""``train.compile``: the towers' transformer blocks through ``torch.compile`` one at a time, as
torchtitan compiles its models, each in place (``nn.Module.compile``)."""

from __future__ import annotations

import torch
from torch import nn

from clip_train.model import CLIP
from clip_train.model.freezing import LockableTower, tower_blocks

# The graphs one block may need: no_grad (encoding, frozen trunks) and grad (replay), train and
# eval mode, a first shape and then a dynamic one (a smaller last chunk, another eval batch).
_GRAPHS_PER_BLOCK = 2 * 2 * 2


def compile_towers(model: CLIP, cuda_graphs: bool = False) -> None:
    """Compile each block of both towers with ``nn.Module.compile``: in place, so parameter names,
    state-dict keys and the modules FSDP2 shards (one unit a block) stay as they are, and whatever
    runs a block (encoding, Gradient Cache's replay, a LiT trunk under ``no_grad``, evaluation)
    runs it compiled. Blocks alike share their graphs; timm's drop-path rate, a constant of each
    block, gives each ViT block with stochastic depth graphs of its own.

    Only the blocks, where nearly all FLOPs are: what lies around them (patch or token embedding,
    the final norm, pooling, the projection) is a few cheap ops among Python that differs by mode
    (LiT's split, the text masks, FSDP's gathers for the tower roots), where a compiled graph would
    fuse little and add graph breaks and recompiles. A tower without repeated blocks (timm's
    ResNets) has its whole backbone compiled.

    Random ops keep eager semantics (inductor's ``fallback_random``, for these graphs only, not
    process-wide): a replayed chunk draws the dropout and drop-path masks its first pass drew, which
    keeps Gradient Cache exact. Dynamo's recompile limits, which count the graphs of one code object
    (all the blocks of a tower share one), are raised process-wide to what the blocks may need, so
    that no block falls back to eager unnoticed.

    ``cuda_graphs`` (``train.compile_mode=reduce-overhead``) has inductor replay each block's graphs
    as CUDA graphs (its ``triton.cudagraphs``, which that mode sets; ``torch.compile`` takes a mode
    or options, not both): one launch a graph, not one a kernel. That pays where the host launches
    kernels slower than the GPU runs them, as for BERT-base's short blocks at batch 256 on an H200
    (a compiled step's GPU idle 27 % of the time, 10 % with CUDA graphs). Off CUDA inductor skips it."""
    towers = [compiled_modules(tower) for tower in (model.visual, model.text)]
    needed = _GRAPHS_PER_BLOCK * max(len(modules) for modules in towers)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, needed)
    for modules in towers:
        for module in modules:
            module.compile(options={"fallback_random": True, "triton.cudagraphs": cuda_graphs})


def cudagraph_skips() -> int:
    """The compiled graphs inductor has run without CUDA graphs in this process, though asked for
    them (an op they cannot hold, a CPU tensor, a shape that keeps changing)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def compiled_modules(tower: LockableTower) -> list[nn.Module]:
    """The tower's blocks, or its whole backbone (timm trunk, transformers encoder) if it has none."""
    return tower_blocks(tower) or [getattr(tower, "trunk", None) or tower.encoder]
