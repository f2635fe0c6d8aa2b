"""Every path a training run will read, checked before the process group and the model exist.

Unchecked, a wrong path fails where it is first read: a zero-shot file after the last training
step, an ``init_from`` source after the towers are built. Each check here is the function that
later reads the path, or the same test with the same message, so the user sees one line naming
the key. Remote sources (``pipe:`` and URL shards, hub names) cannot be checked offline and pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clip_train.checkpoint import find_weights, resolve_resume
from clip_train.config import Config, ConfigError, ModelConfig
from clip_train.data import expand_urls
from clip_train.data.eval_sources import is_image_folder, labelled_images
from clip_train.errors import UserError
from clip_train.eval import zeroshot_metadata
from clip_train.model.hub import _looks_like_path


def check_paths(cfg: Config) -> None:
    """Raise a one-line ``UserError`` naming the key of the first path the run could not read."""
    expand_urls(cfg.data.train, what="data.train")
    if cfg.data.val:
        expand_urls(cfg.data.val, what="data.val")
    if cfg.eval.zeroshot_data and not is_image_folder(cfg.eval.zeroshot_data):
        expand_urls(cfg.eval.zeroshot_data, what="eval.zeroshot_data")
    if cfg.eval.zeroshot:
        zeroshot_metadata(cfg.eval.zeroshot)
        labelled_images(cfg.eval, cfg.data)
    _check_model_sources(cfg.model)
    resume_from = resolve_resume(cfg.checkpoint.resume, cfg.train.out_dir)
    if cfg.model.init_from and resume_from is None:  # a resumed run never reads init_from
        with _named("model.init_from", cfg.model.init_from):
            find_weights(cfg.model.init_from)


def _check_model_sources(model: ModelConfig) -> None:
    """Local pretrained weights, text encoder and tokenizer directories; ``init_from`` replaces the
    towers' pretrained weights, so they are not read then."""
    pretrained = model.image.pretrained
    if not model.init_from and pretrained not in ("", "hub") and not Path(pretrained).expanduser().exists():
        raise ConfigError(f"model.image.pretrained={pretrained!r}: no such file or directory")
    for key, source in (("model.text.hf", model.text.hf), ("model.text.tokenizer", model.text.tokenizer)):
        if _looks_like_path(source) and not Path(source).expanduser().is_dir():
            raise ConfigError(f"{key}={source!r}: no such directory")


@contextmanager
def _named(key: str, value: str) -> Iterator[None]:
    """Prefix a ``UserError`` from a helper that does not know which key it was given."""
    try:
        yield
    except UserError as err:
        raise UserError(f"{key}={value}: {err}") from None
