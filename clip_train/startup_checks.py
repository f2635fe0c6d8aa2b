"""Every local path a training run will read, checked at start-up rather than where it is first read
(a zero-shot file after the last step), and those of ``clip-train eval`` before it reads the
checkpoint: each check is the reader's own, so the message is the same.
Remote sources (``pipe:`` and URL shards, hub names) cannot be checked offline and pass. wandb is
checked too: rank 0 imports it only once the model, the loader and a resume are built.
"""

from __future__ import annotations

import importlib.util

from clip_train.checkpoint import resolve_resume
from clip_train.config import Config, ModelConfig, WandbConfig, load_model_config
from clip_train.data import check_readable, check_source_options, expand_urls, source_urls
from clip_train.data.eval_sources import class_map, zeroshot_sources
from clip_train.data.tables import is_piece, is_table
from clip_train.errors import UserError, naming_key
from clip_train.eval import synsets_of, zeroshot_metadata
from clip_train.init_from import check_init_from
from clip_train.model.hub import check_local_dir
from clip_train.model.image import local_weights_file


def check_paths(cfg: Config) -> None:
    """Raise a one-line ``UserError`` naming the key of the first path the run could not read."""
    train = expand_urls(cfg.data.train, what="data.train")
    check_readable(train, what="data.train")
    val = check_eval_paths(cfg)
    check_source_options(cfg.data, train + val)
    # A resumed run reads neither init_from nor the pretrained weights; with checkpoint.remote, auto
    # may find its checkpoint there (on a fresh disk): the trainer then reads what it needs.
    may_resume = resolve_resume(cfg.checkpoint.resume, cfg.train.out_dir) is not None or (
        cfg.checkpoint.resume == "auto" and bool(cfg.checkpoint.remote)
    )
    _check_model_sources(cfg.model, may_resume)
    if cfg.model.init_from and not may_resume:
        with naming_key("model.init_from", cfg.model.init_from):
            check_init_from(cfg.model.init_from)
    if cfg.distill.teacher:  # read at every start, a resumed one's too
        with naming_key("distill.teacher", cfg.distill.teacher):
            check_init_from(cfg.distill.teacher)
        if cfg.distill.teacher_model:
            load_model_config(cfg.distill.teacher_model, "distill.teacher_model")


def check_eval_paths(cfg: Config) -> list[str]:
    """What an evaluation reads, in training and in ``clip-train eval``: ``data.val`` (its URLs are
    returned) and the zero-shot sets, which must carry labels."""
    val: list[str] = []
    if cfg.data.val:  # a table's header is checked as it is split (tiny next to a training table)
        val = source_urls(cfg.data.val, cfg.data, what="data.val")
        check_readable(val, what="data.val")
    if cfg.eval.zeroshot:  # the zero-shot sets are read only then
        classnames, _ = zeroshot_metadata(cfg.eval.zeroshot)
        synsets = synsets_of(cfg.eval.zeroshot)
        for key, source in zeroshot_sources(cfg.eval, cfg.data).values():
            if class_map(source, classnames, synsets, key) is None:  # shards or tables
                urls = val if source == cfg.data.val else expand_urls(source, what=key)
                _check_labelled(key, source, urls)
    return val


def _check_labelled(key: str, source: str, urls: list[str]) -> None:
    """Zero-shot scores each image against its label, which a table's rows do not carry (data.val's
    ``urls`` are its tables' pieces already)."""
    if any(is_table(url) or is_piece(url) for url in urls):
        instead = "set eval.zeroshot_data to" if key == "data.val" else "give"
        raise UserError(
            f"{key}={source}: a table's rows carry no labels, which eval.zeroshot needs; {instead} "
            "labelled shards or an image folder"
        )


def _check_model_sources(model: ModelConfig, may_resume: bool) -> None:
    """Local pretrained weights (unread with ``init_from`` or on a resume), text encoder and tokenizer
    directories."""
    if not (model.init_from or may_resume) and model.image.pretrained not in ("", "hub"):
        local_weights_file(model.image.pretrained)
    check_local_dir(model.text.hf, "model.text.hf")
    check_local_dir(model.text.tokenizer, "model.text.tokenizer")


def check_wandb(wandb: WandbConfig) -> None:
    """A run that logs to wandb (``log.wandb.mode`` offline, the default, or online) needs it
    installed; the offline GPU kit (``launch/gpu_wheels.py``) leaves it out on purpose."""
    if wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise UserError(
            f"log.wandb.mode={wandb.mode}: wandb is not installed; install it (pip install wandb) "
            "or set log.wandb.mode=disabled"
        )
