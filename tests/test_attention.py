"""Document-causal token-exact sliding-window attention: the block lists against a dense token-level reference, and
FlexAttention (forward, CPU) against its dense CPU twin."""
import pytest
import torch

from train_gpt import ATTENTION_BLOCK_SIZE as BS
import train_gpt
from train_gpt import EOT_TOKEN, CausalSelfAttention, banded_mask, document_causal_masks


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


def reference_mask(seq, window, places=1, cut=0):
    """Query t sees key s when s is in t's document and 0 <= t - s <= window, token by token; with places 2, over
    each token's two places (2t, 2t + 1) of paired heads' sequence, the window counted in places; with cut, in t's
    piece of its document, the pieces `cut` tokens long from its start (the sequence's start, or an EOT_TOKEN)."""
    docs, d, start = [], 0, 0
    for i, t in enumerate(seq.tolist()):
        if t == EOT_TOKEN:
            d, start = d + 1, i
        docs += [(d, (i - start) // cut if cut else 0)] * places
    docs = torch.tensor([d * len(seq) + piece for d, piece in docs])
    docs, pos = torch.tensor(docs), torch.arange(len(docs))
    gap = pos[:, None] - pos[None, :]
    return (gap >= 0) & (gap <= window) & (docs[:, None] == docs[None, :])


def listed_blocks(num, idx):
    nb = idx.size(-1)
    kept = torch.arange(nb)[None, :] < num[0, 0, :, None]
    return torch.zeros(nb, nb, dtype=torch.bool).scatter_(1, idx[0, 0].long(), kept)


@pytest.mark.parametrize("places", [1, 2])
@pytest.mark.parametrize("window", WINDOWS)
def test_block_lists_hold_exactly_the_blocks_the_reference_needs(window, places):
    # full: every pair of the two blocks allowed (no mask_mod there); partial: some but not all; nothing else listed
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    nb = places * len(seq) // BS
    for mask, tokens in zip(document_causal_masks(seq, torch.tensor([window // 2, window], dtype=torch.int32),
                                                  places), (window // 2, window)):
        reference = reference_mask(seq, tokens, places)
        pairs = reference.view(nb, BS, nb, BS).permute(0, 2, 1, 3).reshape(nb, nb, BS * BS)
        full, partial = listed_blocks(mask.full_num, mask.full_idx), listed_blocks(mask.partial_num, mask.partial_idx)
        assert torch.equal(full, pairs.all(-1)), (window, tokens)
        assert torch.equal(partial, pairs.any(-1) & ~pairs.all(-1)), (window, tokens)
        assert torch.equal(mask.dense(), reference), (window, tokens)  # the twin: full blocks whole, mask_mod in partial


@pytest.mark.parametrize("places", [1, 2])
@pytest.mark.parametrize("cut", [100, 128, 256])
@pytest.mark.parametrize("starts", [DOC_STARTS, [300, 700]])  # (the second: a sequence starting mid-document)
def test_documents_cut_for_attention_hold_exactly_the_reference_s_pieces(cut, starts, places):
    # #92's cap: a document cut every `cut` tokens from its start, token by token
    seq = sequence_with_documents(starts, 8 * BS, seed=cut)
    nb = places * len(seq) // BS
    windows = torch.tensor([150, 2048], dtype=torch.int32)
    for mask, tokens in zip(document_causal_masks(seq, windows, places, max_tokens=cut), windows.tolist()):
        reference = reference_mask(seq, tokens, places, cut)
        assert not torch.equal(reference, reference_mask(seq, tokens, places))  # (the cut matters)
        pairs = reference.view(nb, BS, nb, BS).permute(0, 2, 1, 3).reshape(nb, nb, BS * BS)
        full, partial = listed_blocks(mask.full_num, mask.full_idx), listed_blocks(mask.partial_num, mask.partial_idx)
        assert torch.equal(full, pairs.all(-1)) and torch.equal(partial, pairs.any(-1) & ~pairs.all(-1)), tokens
        assert torch.equal(mask.dense(), reference), tokens
    # DC-MHA's band is cut alike: each query's keys are its cut mask's within the band's window
    band, cut_mask = banded_mask(seq, 100, cut), reference_mask(seq, 99, 1, cut)
    t = torch.arange(len(seq)).view(-1, BS, 1)
    keys = (t[:, :1] // BS - 1) * BS + torch.arange(2 * BS)
    assert torch.equal(band, (keys >= 0) & cut_mask[t, keys.clamp(min=0)])


def test_the_model_cuts_documents_for_attention_in_training_only():
    seq = sequence_with_documents([0, 700], 8 * BS)
    args = train_gpt.parse_args(["--preset", "tiny", "--attention_max_tokens", "300"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    windows = torch.tensor([2048, 2048], dtype=torch.int32)
    assert torch.equal(model.attention_masks(seq, windows)["L", 1], reference_mask(seq, 2048, 1, 300))
    model.eval()
    assert torch.equal(model.attention_masks(seq, windows)["L", 1], reference_mask(seq, 2048))


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


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("window", [0, 100, 128, 384, 2048])
def test_flex_attention_equals_dense_twin(window, paired):
    torch.manual_seed(window)
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    attn = CausalSelfAttention(dim=64, num_heads=4, qk_dim=16, paired=paired)
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # zero-init would hide the attention output
    x = torch.randn(1, len(seq), 64)
    ve = torch.randn(1, len(seq), 64)
    for mask in document_causal_masks(seq, torch.tensor([window // 2, window], dtype=torch.int32), 1 + paired):
        with torch.no_grad():
            flex = attn(x, ve, mask.flex())
            dense = attn(x, ve, mask.dense())
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def test_flex_attention_inside_a_compiled_module_equals_the_dense_twin():
    """The branch a compiled model takes (flex_attention traced into the model's graph, not compiled on its own):
    a compiled attention block over a BlockMask against the eager block over the dense mask."""
    torch.manual_seed(0)
    seq = sequence_with_documents(DOC_STARTS, 8 * BS)
    attn = CausalSelfAttention(dim=64, num_heads=4, qk_dim=16)
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)
    x, ve = torch.randn(1, len(seq), 64), torch.randn(1, len(seq), 64)
    mask = document_causal_masks(seq, torch.tensor([100, 200], dtype=torch.int32))[1]
    with torch.no_grad():
        flex = torch.compile(attn, dynamic=False)(x, ve, mask.flex())
        dense = attn(x, ve, mask.dense())
    assert dense.abs().sum() > 0
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def paired_attention_by_hand(attn, x, seq, window):
    """Paired heads written out in float64, head by head: head h's query at token t, rotated as at place 2t + h mod 2
    (#89's), sees the keys of heads h mod H/2 and h mod H/2 + H/2 at every token t' of its document whose place
    2t' + h' // (H/2) is at most its own 2t + h // (H/2) and at most `window` places before it."""
    H, D = attn.head_offsets.numel(), attn.qk_dim
    q, k, v = (t[0].double() for t in attn.project(x.double()))  # (T, H, D)
    q, k = (torch.nn.functional.rms_norm(t, (D,)) for t in (q, k))
    v = attn.value_scale.double() * v
    freq = attn.rotary.angular_freq.double()
    T = len(seq)
    docs = (seq == EOT_TOKEN).cumsum(0)

    def rotated(t, h):  # the dims (j, j + D/2) turned by (2t + h mod 2) x freq_j
        angle = (2 * torch.arange(T, dtype=torch.float64) + h % 2)[:, None] * freq
        first, second = t[:, h, :D // 2], t[:, h, D // 2:]
        return torch.cat([first * angle.cos() + second * angle.sin(), second * angle.cos() - first * angle.sin()], -1)

    out = torch.zeros(T, H, D, dtype=torch.float64)
    for h in range(H):
        place = 2 * torch.arange(T) + h // (H // 2)
        partners = [h % (H // 2), h % (H // 2) + H // 2]
        scores, values = [], []
        for other in partners:
            key_place = 2 * torch.arange(T) + other // (H // 2)
            gap = place[:, None] - key_place[None, :]
            seen = (gap >= 0) & (gap <= window) & (docs[:, None] == docs[None, :])
            s = rotated(q, h) @ rotated(k, other).T * attn.rotary.attention_scale.double()
            scores.append(s.masked_fill(~seen, float("-inf")))
            values.append(v[:, other])
        p = torch.softmax(torch.cat(scores, dim=1), dim=1)
        out[:, h] = p @ torch.cat(values, dim=0)
    return attn.c_proj.weight.double() @ out.reshape(T, H * D).T


@pytest.mark.parametrize("window", [1, 2, 5, 100])
def test_paired_heads_attend_as_written_out_by_hand(window):
    # fp64 both (but the module's rotary): the module (its dense twin's mask) against the formula; the unpaired
    # module must differ from it
    # (window 0 would not tell them apart: each place sees only itself, its own head's key)
    torch.manual_seed(window)
    seq = sequence_with_documents([0, 40, 41, 150], 2 * BS)
    attn = CausalSelfAttention(dim=48, num_heads=6, qk_dim=8, paired=True).double()
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)
    x = torch.randn(1, len(seq), 48, dtype=torch.float64)
    windows = torch.tensor([window, window], dtype=torch.int32)
    with torch.no_grad():
        got = attn(x, None, document_causal_masks(seq, windows, 2)[0].dense())[0]
        expected = paired_attention_by_hand(attn, x, seq, window).T
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # (the rotary turns in float32)
        attn.head_offsets, attn.head_groups = None, 1  # the same weights, unpaired: another function
        unpaired = attn(x, None, document_causal_masks(seq, windows)[0].dense())[0]
    assert (unpaired - expected).norm() > 0.1 * expected.norm()



def composition_by_hand(q, k, v, mix, seq, window):
    """DC-MHA's post-softmax composition written out in float64 over the whole sequence: sum_s a(t, s) v_h(s), with
    a(t, s) = sum_g mix[t, g] softmax_s(scale q_g(t) . k_g(s)) over the keys s of t's document, 0 <= t - s < window."""
    docs = (seq == EOT_TOKEN).cumsum(0)
    pos = torch.arange(len(seq))
    gap = pos[:, None] - pos[None, :]
    seen = (gap >= 0) & (gap < window) & (docs[:, None] == docs[None, :])
    scores = torch.einsum("thd,shd->hts", q[0], k[0]).masked_fill(~seen, float("-inf"))
    a = torch.einsum("th,hts->ts", mix[0], scores.softmax(-1))
    return torch.einsum("ts,shd->thd", a, v[0])[None]


def test_composition_over_chunks_equals_the_whole_sequence_written_out():
    # chunks of 128 queries seeing their chunk and the one before, against the (T, T) formula in fp64; documents start
    # mid-chunk and on a chunk's edge, and a window reaching back across a chunk's edge
    torch.manual_seed(0)
    seq = sequence_with_documents([0, 50, 128, 129, 300], 3 * BS)
    attn = CausalSelfAttention(dim=24, num_heads=3, qk_dim=8, composed=True).double()
    q, k, v = (torch.randn(1, len(seq), 3, 8, dtype=torch.float64) for _ in range(3))
    mix = torch.randn(1, len(seq), 3, dtype=torch.float64)
    mask = banded_mask(seq, train_gpt.DC_WINDOW)
    with torch.no_grad():
        got = attn.composition(q, k, v, mix, mask)
    scale = attn.rotary.attention_scale.double()
    expected = composition_by_hand(q * scale, k, v, mix, seq, train_gpt.DC_WINDOW)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)  # (it scores in float32)
    # what it composes is more than each token's own value: the window's earlier keys move it
    assert (expected - composition_by_hand(q * scale, k, v, mix, seq, 1)).norm() > 0.1 * expected.norm()
