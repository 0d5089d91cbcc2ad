"""Document-causal token-exact sliding-window attention: the block lists against a dense token-level reference, and
FlexAttention (forward, CPU) against its dense CPU twin."""
import pytest
import torch

from train_gpt import ATTENTION_BLOCK_SIZE as BS
from train_gpt import EOT_TOKEN, CausalSelfAttention, document_causal_masks


def sequence_with_documents(starts, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 1000, (length,), generator=g)
    seq[list(starts)] = EOT_TOKEN
    return seq


# documents starting mid-block, on a block edge, a one-token document, and one spanning several blocks
DOC_STARTS = [0, 70, 128, 129, 300, 700, 701, 1000]
# in tokens: none but the token itself, within a block, one short of, at and past a block's edges, across blocks, past
# the sequence
WINDOWS = [0, 1, 64, 126, 127, 128, 129, 200, 254, 384, 1000, 2048]


def reference_mask(seq, window):
    """Query t sees key s when s is in t's document and 0 <= t - s <= window, token by token."""
    docs, d = [], 0
    for t in seq.tolist():
        d += t == EOT_TOKEN
        docs.append(d)
    docs, pos = torch.tensor(docs), torch.arange(len(seq))
    gap = pos[:, None] - pos[None, :]
    return (gap >= 0) & (gap <= window) & (docs[:, None] == docs[None, :])


def listed_blocks(num, idx):
    nb = idx.size(-1)
    kept = torch.arange(nb)[None, :] < num[0, 0, :, None]
    return torch.zeros(nb, nb, dtype=torch.bool).scatter_(1, idx[0, 0].long(), kept)


@pytest.mark.parametrize("window", WINDOWS)
def test_block_lists_hold_exactly_the_blocks_the_reference_needs(window):
    # full: every pair of the two blocks allowed (no mask_mod there); partial: some but not all; nothing else listed
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    nb = len(seq) // BS
    for mask, tokens in zip(document_causal_masks(seq, torch.tensor([window // 2, window], dtype=torch.int32)),
                            (window // 2, window)):
        reference = reference_mask(seq, tokens)
        pairs = reference.view(nb, BS, nb, BS).permute(0, 2, 1, 3).reshape(nb, nb, BS * BS)
        full, partial = listed_blocks(mask.full_num, mask.full_idx), listed_blocks(mask.partial_num, mask.partial_idx)
        assert torch.equal(full, pairs.all(-1)), (window, tokens)
        assert torch.equal(partial, pairs.any(-1) & ~pairs.all(-1)), (window, tokens)
        assert torch.equal(mask.dense(), reference), (window, tokens)  # the twin: full blocks whole, mask_mod in partial


def test_a_window_past_the_sequence_is_plain_document_causal():
    seq = sequence_with_documents(DOC_STARTS, 8 * BS, seed=1)
    short_mask, long_mask = document_causal_masks(seq, torch.tensor([2048, 4096], dtype=torch.int32))
    docs = (seq == EOT_TOKEN).cumsum(0)
    pos = torch.arange(len(seq))
    causal = (pos[:, None] >= pos[None, :]) & (docs[:, None] == docs[None, :])  # no window at all
    assert torch.equal(long_mask.dense(), causal) and torch.equal(short_mask.dense(), causal)


def test_one_document_sees_exactly_window_plus_one_tokens():
    # by hand: in one document, a query far enough in sees itself and the `window` tokens before it
    seq = sequence_with_documents([0], 4 * BS, seed=2)
    short_mask, long_mask = document_causal_masks(seq, torch.tensor([100, 200], dtype=torch.int32))
    assert long_mask.dense().sum(-1)[300:].tolist() == [201] * (len(seq) - 300)
    assert short_mask.dense().sum(-1)[300:].tolist() == [101] * (len(seq) - 300)
    assert long_mask.dense()[10].sum() == 11  # near the start: what there is


@pytest.mark.parametrize("window", [0, 100, 128, 384, 2048])
def test_flex_attention_equals_dense_twin(window):
    torch.manual_seed(window)
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    attn = CausalSelfAttention(dim=64, num_heads=2, head_dim=32)
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # zero-init would hide the attention output
    x = torch.randn(1, len(seq), 64)
    ve = torch.randn(1, len(seq), 64)
    for mask in document_causal_masks(seq, torch.tensor([window // 2, window], dtype=torch.int32)):
        with torch.no_grad():
            flex = attn(x, ve, mask.flex())
            dense = attn(x, ve, mask.dense())
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
