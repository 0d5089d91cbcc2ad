"""Document-causal sliding-window attention: FlexAttention (forward, CPU) against its dense CPU twin."""
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


def doc_causal_reference(seq):
    docs = [0] * len(seq)
    d = 0
    for i, t in enumerate(seq.tolist()):
        d += t == EOT_TOKEN
        docs[i] = d
    docs = torch.tensor(docs)
    pos = torch.arange(len(seq))
    return (pos[:, None] >= pos[None, :]) & (docs[:, None] == docs[None, :])


@pytest.mark.parametrize("window_blocks", [1, 2, 3, 5, 8, 20])
def test_flex_attention_equals_dense_twin(window_blocks):
    torch.manual_seed(window_blocks)
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    attn = CausalSelfAttention(dim=64, num_heads=2, head_dim=32, max_seq_len=len(seq))
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # zero-init would hide the attention output
    x = torch.randn(1, len(seq), 64)
    ve = torch.randn(1, len(seq), 64)
    for mask in document_causal_masks(seq, torch.tensor(window_blocks, dtype=torch.int32)):
        with torch.no_grad():
            flex = attn(x, ve, mask.flex())
            dense = attn(x, ve, mask.dense())
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def test_window_wider_than_sequence_is_plain_document_causal():
    seq = sequence_with_documents(DOC_STARTS, 8 * BS, seed=1)
    long_mask, short_mask = document_causal_masks(seq, torch.tensor(16, dtype=torch.int32))
    reference = doc_causal_reference(seq)
    assert torch.equal(long_mask.dense(), reference)
    assert torch.equal(short_mask.dense(), reference)  # 8 blocks still cover the whole sequence


@pytest.mark.parametrize("window_blocks", [0, 1, 2, 3])
def test_single_document_window_keeps_the_nearest_blocks(window_blocks):
    # one document: query block qb sees its own block (causally) and the window-1 blocks before it
    seq = sequence_with_documents([0], 6 * BS, seed=2)
    mask = document_causal_masks(seq, torch.tensor(2 * window_blocks, dtype=torch.int32))[1]  # short = half
    pos = torch.arange(len(seq))
    block_gap = pos[:, None] // BS - pos[None, :] // BS
    reference = (pos[:, None] >= pos[None, :]) & (block_gap < max(window_blocks, 1))
    assert torch.equal(mask.dense(), reference)
