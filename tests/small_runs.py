"""Shared by the tests that launch real training runs: a tiny model and a short run on digits."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs/demo-digits.yaml"
TINY_MODEL_CONFIG = ROOT / "configs/model/tiny.yaml"  # TINY_MODEL overrides apply to it too

# A WordPiece vocabulary of the digits captions' and templates' words, with single characters for
# any other text: 139 tokens instead of open_clip's 49,408, whose embedding was 97 % of the tiny
# model, and with it of each step's update and each checkpoint the tests write and verify.
DIGITS_VOCAB = Path(__file__).with_name("digits-vocab")

TINY_MODEL = [
    f"model.text.tokenizer={DIGITS_VOCAB}",
    "model.embed_dim=16",
    "model.image.timm_kwargs={img_size: 16, patch_size: 8, depth: 2, embed_dim: 32, num_heads: 2, "
    "drop_path_rate: 0.1}",
    "model.text.hf_config={model_type: bert, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
    "intermediate_size: 64, max_position_embeddings: 16, hidden_dropout_prob: 0.1}",
    "model.text.context_length=12",
]


def run_overrides(digits: Path, out_dir: Path, steps: int, *extra: str) -> list[str]:
    """A short run: 16-pair batches in chunks with offload and the ring loss, no eval, no wandb."""
    return [
        *TINY_MODEL,
        f"data.train={digits}/train",
        "data.val=",
        "eval.zeroshot=",
        "eval.zeroshot_data=",
        "data.num_samples=256",
        "data.workers=1",
        "batch.global_size=16",
        "batch.image_chunk=4",
        "batch.text_chunk=8",
        "batch.offload=true",
        "loss.impl=inf",
        f"train.max_steps={steps}",
        "train.dist_timeout_s=120",
        f"train.out_dir={out_dir}",
        "log.wandb.mode=disabled",
        *extra,
    ]


def slow_zeroshot(digits: Path, folder: Path) -> list[str]:
    """Zero-shot on digits with 3000 templates a class: an evaluation that takes a while."""
    classes = json.loads((digits / "zeroshot.json").read_text())
    slow = {**classes, "templates": [f"digit {{}} number {i}" for i in range(3000)]}
    (folder / "slow-zeroshot.json").write_text(json.dumps(slow))
    return [f"eval.zeroshot={folder / 'slow-zeroshot.json'}", f"eval.zeroshot_data={digits}/val"]


def free_port() -> int:
    """A port no listener holds, for a rendezvous the test starts later. It is drawn below the
    kernel's ephemeral range (32768 and up): a port the kernel hands out for binding 0 is also handed
    out as the local port of outgoing connections (gloo makes many), which may take it first."""
    draw = random.Random()
    while True:
        port = draw.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
