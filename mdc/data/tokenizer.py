"""Caption tokenizer: CLIP's BPE vocabulary, built offline from the file inside `open-clip-torch`.

Ids 0..49407 are CLIP's (49406 <|startoftext|> = BOS, 49407 <|endoftext|> = EOS); two ids are
appended: [MASK] = 49408 and pad = 49409. Captions are encoded as text tokens only, right-padded to
`max_length`; the autoregressive objectives add BOS/EOS themselves.
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

CLIP_BPE_MERGES = 49152 - 256 - 2  # the merges CLIP uses from the file (open_clip does the same)


def bpe_file() -> Path:
    """The vocabulary file open-clip-torch ships, found without importing open_clip: its import
    loads timm and triton (seconds), and a Ray Data read task that builds the tokenizer must not
    (a read task stopped part-way through triton's import left the worker process with a broken
    half-imported triton, and its next task failed on `triton.language.core`: CI, 2026-12-07)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("CLIP BPE vocabulary not found: is open-clip-torch installed?")
    path = Path(next(iter(spec.submodule_search_locations))) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise FileNotFoundError(f"CLIP BPE vocabulary not found at {path}; is open-clip-torch installed?")
    return path


def _bytes_to_unicode() -> list[str]:
    """CLIP's byte alphabet in CLIP's order: printable bytes as themselves, then the other bytes
    mapped to code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + n) for n in range(len(others))]


@lru_cache(maxsize=1)
def _clip_fast_tokenizer():
    from transformers import CLIPTokenizerFast  # seconds to import: once, when the tokenizer is first built

    lines = gzip.open(bpe_file(), "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(m.split()) for m in lines[1 : CLIP_BPE_MERGES + 1]]
    alphabet = _bytes_to_unicode()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizerFast(vocab=vocab, merges=merges)


class CaptionTokenizer:
    bos_id = 49406
    eos_id = 49407
    mask_id = 49408
    pad_id = 49409
    vocab_size = 49410

    def __init__(self, max_length: int = 32):
        self.max_length = max_length
        self._tok = _clip_fast_tokenizer()
        if len(self._tok) != self.bos_id + 2:
            raise RuntimeError(f"CLIP vocabulary has {len(self._tok)} tokens, expected 49408")

    def encode(self, captions: list[str]) -> np.ndarray:
        """(B, max_length) int64: text tokens, truncated, right-padded with pad_id."""
        ids = self._tok(list(captions), add_special_tokens=False, truncation=True, max_length=self.max_length)[
            "input_ids"
        ]
        out = np.full((len(ids), self.max_length), self.pad_id, dtype=np.int64)
        for row, seq in zip(out, ids):
            row[: len(seq)] = seq
        return out

    def decode(self, tokens: torch.Tensor | np.ndarray) -> list[str]:
        """Text up to the first EOS/pad; [MASK] and BOS are dropped."""
        texts = []
        for row in np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).tolist():
            kept = []
            for tok in row:
                if tok in (self.eos_id, self.pad_id):
                    break
                if tok < self.bos_id:
                    kept.append(tok)
            texts.append(self._tok.decode(kept, clean_up_tokenization_spaces=False).strip())
        return texts
