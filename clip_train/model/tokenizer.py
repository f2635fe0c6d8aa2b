"""Tokenizers returning fixed-length ``input_ids``/``attention_mask``. For DataLoader workers both
pickle as (class, constructor arguments), whether or not the library objects underneath pickle."""

from __future__ import annotations

from pathlib import Path

import torch
from open_clip.tokenizer import SimpleTokenizer, get_clean_fn
from transformers import AutoTokenizer

from clip_train.model.hub import load_hf

OPEN_CLIP = "open_clip"


class OpenCLIPTokenizer:
    """open_clip's bundled CLIP BPE (vocab 49408): [sot] tokens [eot], zero-padded, eot kept on truncation.

    The pad id 0 is also the id of "!", so the mask comes from the eot position, not from ``ids != 0``.
    """

    pad_token_id = 0

    def __init__(self, context_length: int) -> None:
        self.context_length = context_length
        self._bpe = SimpleTokenizer(context_length=context_length)
        self.vocab_size: int = self._bpe.vocab_size

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        input_ids = self._bpe(list(texts), context_length=self.context_length)
        eot = (input_ids == self._bpe.eot_token_id).int().argmax(dim=1, keepdim=True)
        attention_mask = (torch.arange(self.context_length) <= eot).long()
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def save_pretrained(self, directory: Path) -> None:
        """Nothing to write: the vocabulary ships with open_clip."""

    def __reduce__(self):
        return OpenCLIPTokenizer, (self.context_length,)


class HFTokenizer:
    """A transformers tokenizer (e.g. BERT WordPiece) padded and truncated to ``context_length``.

    Captions are cleaned first as open_clip's ``HFTokenizer`` cleans them (ftfy, HTML entities,
    runs of whitespace), so training, eval and an open_clip export all see the same tokens.
    """

    def __init__(self, source: str, context_length: int, key: str = "model.text.tokenizer") -> None:
        self.source, self.context_length, self.key = source, context_length, key
        self._tok = load_hf(AutoTokenizer, source, key)
        self._clean = get_clean_fn("whitespace")
        self.vocab_size: int = len(self._tok)
        self.pad_token_id: int | None = self._tok.pad_token_id

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        out = self._tok(
            [self._clean(text) for text in texts],
            padding="max_length",
            truncation=True,
            max_length=self.context_length,
            return_tensors="pt",
        )
        return {"input_ids": out["input_ids"].long(), "attention_mask": out["attention_mask"].long()}

    def save_pretrained(self, directory: Path) -> None:
        self._tok.save_pretrained(directory)

    def __reduce__(self):
        return HFTokenizer, (self.source, self.context_length, self.key)


Tokenizer = OpenCLIPTokenizer | HFTokenizer


def build_tokenizer(name: str, context_length: int, key: str = "model.text.tokenizer") -> Tokenizer:
    """``open_clip`` for the bundled BPE, else a hub name or local directory for transformers."""
    if name == OPEN_CLIP:
        return OpenCLIPTokenizer(context_length)
    return HFTokenizer(name, context_length, key)
