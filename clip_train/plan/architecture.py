"""Where the planning model's text tower gets its shapes, read from disk only: memory depends on the
architecture, not on the weights, so ``clip-train plan`` needs a config, never a checkpoint or the
network. Light to import (no torch): the command checks this before it loads the libraries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError

from clip_train.config import TextTowerConfig
from clip_train.errors import UserError

# BERT-base and -large as published (Devlin et al. 2019); the cased and uncased models differ in the
# vocabulary.
_BERT_BASE: dict[str, Any] = {
    "model_type": "bert",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
_BERT_LARGE = {
    **_BERT_BASE,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
}
KNOWN_TEXT_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "bert-base-uncased": {**_BERT_BASE, "vocab_size": 30522},
    "bert-base-cased": {**_BERT_BASE, "vocab_size": 28996},
    "bert-large-uncased": {**_BERT_LARGE, "vocab_size": 30522},
}


def find_text_architecture(text: TextTowerConfig) -> dict[str, Any] | Path:
    """``model.text``'s architecture: its ``hf_config`` keys, else the config.json of a local
    directory or of the hub cache (a Path, for transformers to read), else the sizes of a known model.
    Anything else fails in one line that says how to provide it."""
    if text.hf_config:
        return dict(text.hf_config)
    found = _config_on_disk(text.hf)
    if found is not None:
        return found
    if text.hf in KNOWN_TEXT_ARCHITECTURES:
        return dict(KNOWN_TEXT_ARCHITECTURES[text.hf])
    raise UserError(
        f"model.text.hf={text.hf!r}: plan needs this text model's architecture (not its weights), and it "
        f"is neither in the hub cache nor a model plan knows ({', '.join(KNOWN_TEXT_ARCHITECTURES)}); on a "
        f"machine with network run `hf download {text.hf} config.json --local-dir DIR` and set "
        "model.text.hf=DIR, or give its sizes as model.text.hf_config"
    )


def _config_on_disk(source: str) -> Path | None:
    """The config.json of directory ``source``, else of hub model ``source`` in the hub cache (None
    when it is not cached); never the network."""
    key = f"model.text.hf={source!r}"
    directory = Path(source).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise UserError(f"{key}: the directory has no config.json, the architecture plan builds")
        return directory / "config.json"
    try:
        cached = try_to_load_from_cache(source, "config.json")
    except HFValidationError:
        raise UserError(f"{key}: no such directory, and not a hub model name") from None
    return Path(cached) if isinstance(cached, str) else None
