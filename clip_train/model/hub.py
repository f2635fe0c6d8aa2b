"""Finding weights: one error type, and one-line messages that say how to get missing weights."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError

from clip_train.errors import UserError


class ModelLoadError(UserError, RuntimeError):
    """Weights or a tokenizer could not be found or loaded; the message says how to fix it in one line."""


def download_hint(name: str, key: str) -> str:
    """How to fetch a hub model on a machine with network and point the config at the copy."""
    return f"pre-download it with `hf download {name} --local-dir DIR` and set {key}=DIR"


def load_hf(auto_cls: type, source: str, key: str, cached_file: str = "config.json", **kwargs):
    """``auto_cls.from_pretrained`` from a local dir or the hub cache, with one-line errors.

    A hub name whose ``cached_file`` the cache holds is read from the cache first, without a
    request: every rank of a large run would otherwise ask the hub at start-up, and without network
    the hub client retries for half a minute before failing. Other names go to the hub (unless
    HF_HUB_OFFLINE). A tokenizer names its own file: transformers builds one with an empty
    vocabulary from a snapshot that holds only the model's config."""
    check_local_dir(source, key)
    path = Path(source).expanduser()
    if path.is_dir():
        try:
            return auto_cls.from_pretrained(str(path), **kwargs)
        except (OSError, HFValidationError) as err:
            reason = str(err).splitlines()[0]
            raise ModelLoadError(f"{key}={source!r}: cannot load from this directory: {reason}") from None
    attempts = [{"local_files_only": True}] if _in_cache(source, cached_file) else []
    if not hf_constants.HF_HUB_OFFLINE:
        attempts.append({})
    for attempt in attempts:
        try:
            return auto_cls.from_pretrained(source, **kwargs, **attempt)
        except (OSError, HFValidationError):
            continue
    raise ModelLoadError(
        f"{key}={source!r} is neither a local directory nor in the local hub cache (offline?); "
        f"{download_hint(source, key)}"
    )


def _in_cache(repo: str, filename: str) -> bool:
    try:
        return isinstance(try_to_load_from_cache(repo, filename), str)
    except HFValidationError:  # not a hub name
        return False


def check_local_dir(source: str, key: str) -> None:
    """A source meant as a local path must be a directory; a hub id (``name`` or ``org/name``) passes."""
    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source
    if looks_like_path and not Path(source).expanduser().is_dir():
        raise ModelLoadError(f"{key}={source!r}: no such directory")
