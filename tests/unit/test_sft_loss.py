"""The supervised loss: only the completion's targets count (row 1 of an SFT batch), averaged over
them; a batch with none gives 0, not NaN; a text batch is the plain next-token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.train.task import IGNORE, next_token_loss, split_batch


class Logits(torch.nn.Module):
    """Fixed logits per input token: a model whose loss can be computed by hand."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, tokens):
        return self.table[tokens]


def test_only_completion_targets_count():
    model = Logits()
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 1, 2]])
    targets = tokens.clone()
    targets[0, :4] = IGNORE  # the prompt: tokens 1..4 of the first example
    targets[1, :2] = IGNORE
    batch = torch.stack([tokens, targets], dim=1)  # [B, 2, T + 1]
    inputs, shifted = split_batch(batch)
    assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(shifted, targets[:, 1:])
    logits = model.table[tokens[:, :-1]]
    keep = shifted != IGNORE
    by_hand = F.cross_entropy(logits[keep], shifted[keep])
    torch.testing.assert_close(next_token_loss(model, batch), by_hand)


def test_all_masked_is_zero_and_text_is_plain_cross_entropy():
    model = Logits()
    tokens = torch.tensor([[1, 2, 3, 4]])
    masked = torch.stack([tokens, torch.full_like(tokens, IGNORE)], dim=1)
    assert next_token_loss(model, masked).item() == 0.0
    plain = F.cross_entropy(model.table[tokens[:, :-1]].flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(next_token_loss(model, tokens), plain)
