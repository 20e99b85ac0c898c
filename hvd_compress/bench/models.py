"""Models that both rank programs of the benchmarks build (``cluster_rank`` and
``converge_rank``), kept here so that neither imports the other for them."""

from __future__ import annotations

import torch
from torch import nn


class CharTransformer(nn.Module):
    """A GPT-style character model from ``torch.nn`` parts: token and learned position
    embeddings, ``layers`` pre-norm ``nn.TransformerEncoderLayer`` blocks (``heads`` heads,
    feed-forward width ``4 d``, GELU, no dropout) under a causal mask, a final LayerNorm
    and a linear read-out to the vocabulary."""

    def __init__(self, vocab: int, context: int, d: int = 128, layers: int = 2,
                 heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos.weight[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))
