"""A compact decoder-only GPT over bytes: pre-norm blocks with causal attention (charlm's ``Block``,
torch's scaled_dot_product_attention), learned positions, tied input/output embeddings, GPT-2's
initialisation. Our own rather than a ``transformers`` model: every peer imports the task, and this
needs torch only (``transformers`` takes seconds to import and adds nothing a byte model uses)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from swarmgrad.tasks.charlm import CharTransformer

VOCAB = 256


@dataclass(frozen=True)
class GPTShape:
    dim: int
    layers: int
    heads: int


# named sizes; parameter counts (context 256) in docs/architecture.md's task table and the lm test
SIZES: dict[str, GPTShape] = {
    "tiny": GPTShape(dim=256, layers=4, heads=4),  # ~3.2M
    "small": GPTShape(dim=384, layers=6, heads=6),  # ~10.8M
    "medium": GPTShape(dim=512, layers=6, heads=8),  # ~19M: the comparison benchmark's
    "base": GPTShape(dim=768, layers=18, heads=12),  # ~128M: GPT-2 small's width, its parameters in layers
}


class GPT(CharTransformer):
    """(batch, length) byte ids -> (batch, length, 256) next-byte logits: charlm's transformer (its
    forward included) in a named shape, with GPT-2's initialisation."""

    def __init__(self, shape: GPTShape, context: int):
        super().__init__(context=context, dim=shape.dim, heads=shape.heads, layers=shape.layers)
        self._init(shape.layers)

    @torch.no_grad()
    def _init(self, layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.position, std=0.02)
        for block in self.blocks:  # residual writes shrink with depth, so the stream's variance does not grow
            for out in (block.proj, block.mlp[-1]):
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * layers))


def parameter_count(size: str, context: int) -> int:
    """Parameters of a named size, without allocating them."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(SIZES[size], context).parameters())
