"""Tokenizers returning fixed-length ``input_ids``/``attention_mask``. For DataLoader workers both
pickle as (class, constructor arguments), whether or not the library objects underneath pickle.
``IdsTokenizer`` gives either open_clip's call shape: ids only, the mask derived from them."""

from __future__ import annotations

from collections.abc import Sequence
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

    def __call__(
        self, texts: str | Sequence[str], context_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        input_ids = self._bpe(_text_list(texts), context_length=context_length or self.context_length)
        return {"input_ids": input_ids, "attention_mask": self.attention_mask(input_ids)}

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 up to and including each row's eot token, 0 after it (the padding)."""
        eot = (input_ids == self._bpe.eot_token_id).int().argmax(dim=1, keepdim=True)
        return (torch.arange(input_ids.shape[1], device=input_ids.device) <= eot).long()

    def vocabulary(self) -> dict[str, int]:
        return self._bpe.encoder

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
        self._tok = load_hf(AutoTokenizer, source, key, cached_file="tokenizer_config.json")
        self._clean = get_clean_fn("whitespace")
        self.vocab_size: int = len(self._tok)
        self.pad_token_id: int | None = self._tok.pad_token_id

    def __call__(
        self, texts: str | Sequence[str], context_length: int | None = None
    ) -> dict[str, torch.Tensor]:
        out = self._tok(
            [self._clean(text) for text in _text_list(texts)],
            padding="max_length",
            truncation=True,
            max_length=context_length or self.context_length,
            return_tensors="pt",
        )
        return {"input_ids": out["input_ids"].long(), "attention_mask": out["attention_mask"].long()}

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 where the id is not the pad id. A pad token that also stands for a token of every caption
        (e.g. [SEP]) would mask that token too, so such a tokenizer needs the mask from ``__call__``."""
        if self.pad_token_id in self._tok("")["input_ids"]:
            raise ValueError(
                f"the tokenizer's pad id {self.pad_token_id} also stands for a token of every caption, so "
                "the ids alone do not tell where the padding starts; pass the attention_mask it returns"
            )
        return (input_ids != self.pad_token_id).long()

    def vocabulary(self) -> dict[str, int]:
        return self._tok.get_vocab()

    def save_pretrained(self, directory: Path) -> None:
        self._tok.save_pretrained(directory)

    def __reduce__(self):
        return HFTokenizer, (self.source, self.context_length, self.key)


Tokenizer = OpenCLIPTokenizer | HFTokenizer


class IdsTokenizer:
    """open_clip's tokenizer call shape over a clip_train tokenizer, so code written for open_clip runs
    unchanged: a str or list of str → LongTensor ids; ``attention_mask(ids)`` gives their mask."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.context_length = tokenizer.context_length

    def __call__(self, texts: str | Sequence[str], context_length: int | None = None) -> torch.Tensor:
        return self.tokenizer(texts, context_length)["input_ids"]

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.attention_mask(input_ids)


def build_tokenizer(name: str, context_length: int, key: str = "model.text.tokenizer") -> Tokenizer:
    """``open_clip`` for the bundled BPE, else a hub name or local directory for transformers."""
    if name == OPEN_CLIP:
        return OpenCLIPTokenizer(context_length)
    return HFTokenizer(name, context_length, key)


# Captions with capitals, accents, punctuation and digits: two tokenizers with one vocabulary that
# give these the same ids also clean, case and split text alike.
PROBE_CAPTIONS = ("A Photo of the Number 7.", "zwei Kätzchen, naïve café!", "digits 0123456789 (on a sign)")


def how_tokens_differ(expected: Tokenizer, other: Tokenizer) -> str | None:
    """How ``other`` tokenizes otherwise than ``expected``, in words; None when they agree on the
    vocabulary and on ``PROBE_CAPTIONS``. Weights trained on one tokenizer's ids are meaningless
    under another's, and a same-sized vocabulary would load without complaint."""
    ours, theirs = expected.vocabulary(), other.vocabulary()
    if moved := {token for token, _ in ours.items() ^ theirs.items()}:  # another id, or in one only
        return f"{len(moved)} of its {len(theirs)} vocabulary entries differ from the {len(ours)} expected"
    for caption in PROBE_CAPTIONS:
        want, got = (tokenizer(caption)["input_ids"][0].tolist() for tokenizer in (expected, other))
        if got != want:
            return f"it makes {caption!r} the ids {got} instead of {want}"
    return None


def _text_list(texts: str | Sequence[str]) -> list[str]:
    """One caption is a batch of one, as open_clip's tokenizers take it (not one per character)."""
    return [texts] if isinstance(texts, str) else list(texts)
