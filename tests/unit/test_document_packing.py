"""Packed documents (data.packing = documents): attention stops at each document's EOS and RoPE
restarts there, so a packed window trains exactly as its documents would alone."""

from __future__ import annotations

import pytest
import torch

from loom.models.gpt.config import GPTConfig
from loom.models.gpt.model import build_model
from loom.parallel.context_parallel import SequenceSplit, document_ids, document_positions

EOS = 1
CFG = GPTConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)


def _model(split: SequenceSplit | None) -> torch.nn.Module:
    model = build_model(CFG, device="cpu")
    model.init_weights(7)
    model.sequence_split = split
    return model


def _docs(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Documents of random ids (no EOS inside), each ending with EOS."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(2, CFG.vocab_size, (n - 1,), generator=g), torch.tensor([EOS])])
            for n in lengths]


def test_document_ids_and_positions():
    tokens = torch.tensor([[5, 1, 7, 8, 1, 9], [1, 1, 4, 4, 4, 4]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert document_positions(document_ids(tokens, EOS)).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize("lengths", [[5, 11, 16], [32], [1, 1, 30], [9, 9, 9, 5]])
def test_packed_window_equals_its_documents_alone(lengths):
    docs = _docs(lengths, seed=len(lengths))
    packed = torch.cat(docs)[None]
    targets = torch.roll(packed, -1, dims=1)
    model = _model(SequenceSplit(None, EOS))
    with torch.no_grad():
        logits = model(packed)[0]
        alone = _model(None)
        pieces = torch.cat([alone(doc[None])[0] for doc in docs])
        loss = model(packed, targets, loss_chunk=8)
    torch.testing.assert_close(logits, pieces, rtol=1e-5, atol=1e-5)
    # the loss: the mean over the window of each token's loss, as the documents alone give it
    want = torch.nn.functional.cross_entropy(pieces, targets[0])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_no_attention_crosses_a_document_end():
    """A planted second document: changing its tokens changes no other document's logits (and does
    without the mask, so the check can fail)."""
    a, b, c = _docs([8, 12, 12], seed=3)
    b_other = _docs([12], seed=99)[0]
    masked, concat = _model(SequenceSplit(None, EOS)), _model(None)
    with torch.no_grad():
        for model, independent in ((masked, True), (concat, False)):
            one = model(torch.cat([a, b, c])[None])[0]
            two = model(torch.cat([a, b_other, c])[None])[0]
            third = slice(20, 32)
            assert torch.equal(one[:8], two[:8])  # before the change: causal either way
            assert torch.allclose(one[third], two[third], rtol=0, atol=1e-6) == independent


def test_packed_gradients_equal_documents_alone():
    docs = _docs([6, 10, 16], seed=5)
    packed = torch.cat(docs)[None]
    targets = torch.roll(packed, -1, dims=1)
    model, alone = _model(SequenceSplit(None, EOS)), _model(None)
    model(packed, targets, loss_chunk=0).backward()
    total = sum(torch.nn.functional.cross_entropy(alone(doc[None])[0], targets[0, s:s + len(doc)],
                                                  reduction="sum")
                for doc, s in zip(docs, (0, 6, 16)))
    (total / packed.shape[1]).backward()
    for (name, p), q in zip(model.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rope_restarts_at_each_document():
    """RoPE's positions restart at each document (the scores of a masked window would be the same
    either way, RoPE being relative: so checked on the positions themselves), under cp too."""
    from loom.parallel.context_parallel import ContextGroup

    tokens = torch.tensor([[5, 1, 7, 8, 1, 9, 9, 9]])
    whole = SequenceSplit(None, EOS)
    assert whole.rope_positions(whole.sequence(8, tokens, "cpu")).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    # rank 1 of cp 2 holds chunks 1 and 2 of 4 (positions 2-3 and 4-5)
    split = SequenceSplit(ContextGroup(None, 2, 1), EOS)
    assert split.rope_positions(split.sequence(8, tokens, "cpu")).tolist() == [[0, 1, 2, 0]]
    assert SequenceSplit(ContextGroup(None, 2, 1)).sequence(8, None, "cpu").positions.tolist() == [2, 3, 4, 5]


def test_cp_split_is_balanced():
    """Rank r holds chunk r of 2·cp and its mirror 2·cp−1−r, so every rank computes the same number of
    attention pieces over the ring (none does all of the late positions' work)."""
    from loom.parallel.context_parallel import ContextGroup, _pieces, chunk_ids

    for size in (2, 4, 8):
        assert sorted(c for r in range(size) for c in chunk_ids(size, r)) == list(range(2 * size))
        work = [sum(len(_pieces(ContextGroup(None, size, r), s)) for s in range(size)) for r in range(size)]
        assert len(set(work)) == 1, (size, work)
