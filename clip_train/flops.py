"""Model FLOPs per training sample and the device's dense peak: the two halves of MFU.

MFU is the model's FLOP rate over the device's peak. The model FLOPs of a sample are counted once,
at start-up, with ``FlopCounterMode`` on one sample through each half of each tower
(``encode_frozen``, ``encode_trainable``); a trained part costs its forward three times (forward,
then backward at twice the forward), a frozen one once, and Gradient Cache adds the forward it
replays. The loss is left out: O(B·d) per sample against the towers' O(depth·width²).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from timm.layers import PatchDropout
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from clip_train.config import Precision
from clip_train.engine.rng import preserved_rng

aten = torch.ops.aten

# Dense (no sparsity) peak TFLOP/s of one device, from NVIDIA's datasheets, by the dtype its matmuls
# run in (fp32 runs take TF32 on CUDA; the CPU has no entry). Keys are matched as whole words of
# torch.cuda.get_device_name(), longest first: "H100 PCIe" before "H100", whose key is the SXM part,
# and neither "GB200" nor "RTX A1000" is taken for a B200 or an A100.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0},
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0},
}


# PyTorch counts the CUDA attention kernels but not the CPU one; the same formulas apply (to shapes).
def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter_mode() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU attention kernel."""
    return FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


def matmul_dtype(precision: Precision, device: torch.device) -> str | None:
    """The dtype the matmuls of a run at ``precision`` run in: fp32 runs TF32 matmuls on CUDA (the
    trainer sets them); fp64 has no tensor-core peak."""
    if precision == "fp32":
        return "tf32" if device.type == "cuda" else "fp32"
    return None if precision == "fp64" else precision


def device_peak_tflops(device: torch.device, precision: Precision, override: float = 0.0) -> float | None:
    """``override`` when set (``log.peak_tflops``), else the table's dense peak of this CUDA device
    for the run's matmul dtype; None where unknown (the CPU, an unlisted GPU, fp64)."""
    if override > 0:
        return override
    dtype = matmul_dtype(precision, device)
    if device.type != "cuda" or dtype is None:
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", name):
            return PEAK_TFLOPS[key][dtype]
    return None


@dataclass(frozen=True)
class TowerFlops:
    """Forward FLOPs of one sample through a tower's two halves."""

    frozen: int  # encode_frozen: input preparation and a locked trunk
    trainable: int  # encode_trainable


def forward_flops(fn: Callable[..., object], *inputs: torch.Tensor) -> int:
    """FLOPs of ``fn(*inputs)`` without a graph."""
    with torch.no_grad(), flop_counter_mode() as counter:
        fn(*inputs)
    return counter.get_total_flops()


def tower_flops(model: nn.Module) -> tuple[TowerFlops, TowerFlops]:
    """Forward FLOPs of one sample through the image and the text tower of a ``CLIP`` (on its
    device, with every token of the context attended). In eval mode, so that no batch-norm
    statistics move, and with the RNG restored: the run is the same with or without the count.
    A training ViT's patch dropout (timm's, as FLIP) stays on: the step's blocks see only the
    tokens it keeps, a fixed number per sample."""
    device = model.logit_scale.device
    size, context = model.image_size, model.tokenizer.context_length
    image = torch.zeros(1, 3, size, size, dtype=torch.uint8, device=device)
    tokens = torch.ones(1, context, dtype=torch.long, device=device)
    counts, training = [], model.training
    dropping = [m for m in model.modules() if isinstance(m, PatchDropout) and m.training]
    model.eval()
    for module in dropping:
        module.train()
    with preserved_rng(device):
        for tower, inputs in ((model.visual, (image,)), (model.text, (tokens, torch.ones_like(tokens)))):
            frozen = forward_flops(tower.encode_frozen, *inputs)
            with torch.no_grad():
                hidden = tower.encode_frozen(*inputs)
            counts.append(TowerFlops(frozen, forward_flops(tower.encode_trainable, *hidden)))
    model.train(training)
    return counts[0], counts[1]


def training_flops_per_sample(
    towers: tuple[TowerFlops, TowerFlops], trains: tuple[bool, bool], replayed: tuple[float, float]
) -> float:
    """Model FLOPs of one sample in a training step: each tower's frozen half forward once; its
    trainable half, if it ``trains``, forward × 3 (backward = 2 × forward) plus the share of the
    samples it ``replayed`` under Gradient Cache (a frozen tower's trainable half: forward once)."""
    total = 0.0
    for flops, trained, share in zip(towers, trains, replayed, strict=True):
        total += flops.frozen + flops.trainable * ((3 + share) if trained else 1)
    return total
