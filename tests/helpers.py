"""Stand-ins shared by several test files: one helper per idea."""

import socket

import torch
from torch import nn


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConstantNLL(nn.Module):
    """A captioner whose every prediction is uniform over `vocab` words: each token's NLL is
    log(vocab) and log p(C | V) = −N·log(vocab) for an N-token caption, the answer an unbiased
    loss or ELBO estimate must average to. It answers both the training call (forward) and the
    scoring calls (encode, image_keys_values, decode)."""

    def __init__(self, vocab: int, *, mask_id: int, pad_id: int, bos_id: int, eos_id: int):
        super().__init__()
        self.vocab, self.mask_id, self.pad_id, self.bos_id, self.eos_id = vocab, mask_id, pad_id, bos_id, eos_id

    def forward(self, images, tokens, t=None, causal=False, where=None, image_free=None):
        return torch.zeros(int(where.sum()), self.vocab)

    def encode(self, images):
        return images

    def image_keys_values(self, features):
        return features

    def decode(self, tokens, image_kv, t=None, where=None):
        return torch.zeros(int(where.sum()), self.vocab)
