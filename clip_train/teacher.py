"""The frozen teacher of distillation (``distill.teacher``, OpenCLIP's ``--distill-model``).

It is built and loaded at every start, as ``model.init_from`` loads a start (a clip_train checkpoint
or an open_clip CLIP), then kept in eval mode without gradients. The teacher encodes the student's
own batch, so it must read the same inputs: the same image size and the same token ids.
"""

from __future__ import annotations

import dataclasses

import torch

from clip_train.checkpoint import checkpoint_model_config, find_weights
from clip_train.config import DistillConfig, ModelConfig, load_model_config
from clip_train.errors import UserError, naming_key
from clip_train.init_from import built_from
from clip_train.model import CLIP

# Words, digits, case, punctuation and accents: tokenizers that agree on it agree in practice.
PROBE_CAPTION = "A photo of 2 Dogs, naïve & café-style — at 10:30!"


def teacher_model_config(distill: DistillConfig) -> ModelConfig:
    """The teacher's architecture: ``distill.teacher_model``, else its checkpoint's ``model.yaml``."""
    if distill.teacher_model:
        cfg = load_model_config(distill.teacher_model, "distill.teacher_model")
    else:
        with naming_key("distill.teacher", distill.teacher):
            cfg = checkpoint_model_config(find_weights(distill.teacher).parent)
    return dataclasses.replace(cfg, init_from=distill.teacher)


def load_teacher(distill: DistillConfig, student: CLIP, device: torch.device, dtype: torch.dtype) -> CLIP:
    """The teacher on ``device`` in ``dtype``, frozen, after checking it reads the student's inputs."""
    cfg = teacher_model_config(distill)
    with naming_key("distill.teacher", distill.teacher):
        teacher = built_from(cfg, "distill.teacher")
        check_same_inputs(teacher, student)
    return teacher.requires_grad_(False).eval().to(device, dtype)


def check_same_inputs(teacher: CLIP, student: CLIP) -> None:
    """Both models encode the same uint8 images and token ids; each normalises images its own way."""
    if teacher.image_size != student.image_size:
        raise UserError(
            f"the teacher takes {teacher.image_size} px images and the student {student.image_size} px; "
            "they encode the same batch: pick a teacher of the student's size"
        )
    theirs, ours = teacher.tokenizer(PROBE_CAPTION), student.tokenizer(PROBE_CAPTION)
    if any(not torch.equal(theirs[key], ours[key]) for key in ("input_ids", "attention_mask")):
        raise UserError(
            "the teacher's tokenizer gives other token ids than the student's (or another context length); "
            "they read the same ids: pick a teacher with the student's tokenizer"
        )
