"""#92's layer geometry and injection sites: narrow heads (queries and keys of half a head, rotating in every dim; values of half a head
taking half of each head's value embedding), a rotary per window that YaRN stretches, the attention scales, the MLP's
width, a layer without an MLP and one with two, the layers x0 and the n-gram embedding join (and the gate lanes they
take), and #92's head taking in ten earlier states per group of channels; each against a hand computation or #92's
own figures."""
import math

import numpy as np
import pytest
import torch

import train_gpt
from conftest import REPO_ROOT
from train_gpt import EOT_TOKEN, CausalSelfAttention, Rotary, document_causal_masks

SHAKESPEARE = REPO_ROOT / "data" / "shakespeare"



def attention_by_hand(attn, x, seq, window, pairs, scale):
    """fp64: QK-norm, then every one of `pairs` frequencies (1/1024)^(j/(pairs-1)) turning dims (j, j + D/2) of each
    head as a complex number z e^(-i t w), the rest unturned; softmax(scale q.k) over each query's document within
    the window; the values times 0.5; the output projection."""
    T, Dq, Dv = x.size(1), attn.qk_dim, attn.v_dim
    w_qk, w_v = attn.qk.weight.double(), attn.v.weight.double()
    q, k = (x[0] @ w_qk[i].T for i in (0, 1))
    v = 0.5 * (x[0] @ w_v.T).view(T, -1, Dv)
    H = v.size(1)

    def normed_and_turned(t):
        t = t.view(T, H, Dq)
        t = t / (t.square().mean(-1, keepdim=True) + torch.finfo(torch.float64).eps).sqrt()
        freq = torch.zeros(Dq // 2, dtype=torch.float64)
        freq[:pairs] = (1 / 1024) ** (torch.arange(pairs, dtype=torch.float64) / (pairs - 1))
        z = torch.complex(t[..., :Dq // 2], t[..., Dq // 2:])
        z = z * torch.exp(-1j * torch.arange(T, dtype=torch.float64)[:, None, None] * freq)
        return torch.cat([z.real, z.imag], dim=-1)
    q, k = normed_and_turned(q), normed_and_turned(k)
    docs = (seq == EOT_TOKEN).cumsum(0)
    gap = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    seen = (gap >= 0) & (gap <= window) & (docs[:, None] == docs[None, :])
    scores = (scale * torch.einsum("thd,shd->hts", q, k)).masked_fill(~seen, float("-inf"))
    y = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return y.reshape(T, H * Dv) @ attn.c_proj.weight.double().T


@pytest.mark.parametrize("v_dim", [16, 8])
def test_narrow_heads_attend_as_written_out_by_hand(v_dim):
    # #92's narrow heads at a tenth of their size: queries and keys 8 wide (half of a 16-wide head) rotating in all 4
    # pairs of dims at #92's narrow scale 0.13, values 16 or 8 wide; against float64 by hand, rtol 1e-5 (the module's
    # rotary turns in float32). A half-truncated rotary (2 of the 4 pairs) must differ.
    torch.manual_seed(v_dim)
    seq = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    seq[[0, 40, 130]] = EOT_TOKEN
    attn = CausalSelfAttention(dim=32, num_heads=2, qk_dim=8, v_dim=v_dim, rotary=Rotary(8, rotating=4, scale=0.13))
    attn = attn.double()
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # (zero at the start: it would hide the output)
    x = torch.randn(1, len(seq), 32, dtype=torch.float64)
    window = 100
    mask = document_causal_masks(seq, torch.tensor([window, window], dtype=torch.int32))[0].dense()
    assert attn.qk.weight.shape == (2, 16, 32) and attn.v.weight.shape == (2 * v_dim, 32)
    assert attn.c_proj.weight.shape == (32, 2 * v_dim) and not attn.rotary.stationary.any()
    with torch.no_grad():
        got = attn(x, None, mask)[0]
        expected = attention_by_hand(attn, x, seq, window, pairs=4, scale=0.13)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        half_turned = attention_by_hand(attn, x, seq, window, pairs=2, scale=0.13)
    assert (half_turned - expected).norm() > 0.05 * expected.norm()


def test_a_narrow_value_layer_takes_the_first_half_of_each_heads_part_of_its_value_embedding():
    # #92's half-value layers read 64 of each head's 128 dims of a 768-wide plane; by hand, its gate 2 sigmoid(0) = 1
    config = train_gpt.ModelConfig(vocab_size=512, model_dim=48, num_heads=3, head_dim=16,
                                   layers=(train_gpt.LayerConfig(value_embed=True, narrow_v=True),))
    block = train_gpt.Block(config, 0)
    assert block.attn.v.weight.shape == (24, 48)
    ve, read = torch.randn(10, 48), torch.randn(1, 10, 48)
    expected = torch.cat([ve[:, 16 * h:16 * h + 8] for h in range(3)], dim=-1)[None]
    torch.testing.assert_close(block.value_input(read, ve, {}, None), expected, rtol=0, atol=0)


def yarn_by_hand(pairs, windows, scale):
    """#31 in float64: a frequency turning at most once over the old window slowed by old/new, 32 times or more kept,
    a linear ramp between; the scale times 0.2 ln(new/old) + 1 at each change."""
    freq = (1 / 1024) ** np.linspace(0, 1, pairs)
    for old, new in zip(windows, windows[1:]):
        if new != old:
            ramp = np.clip((old * freq / (2 * np.pi) - 1) / 31, 0, 1)
            freq, scale = freq * ((1 - ramp) * old / new + ramp), scale * (0.2 * np.log(new / old) + 1)
    return freq, scale


def test_the_attention_scales_grow_with_the_windows_to_92s_logged_values():
    # #92's log prints each table's scale after each stage's windows (short 1, 3, 5, 6 blocks; long 3, 7, 11, 13):
    # narrow 0.13 -> 0.15856 -> 0.17476 -> 0.18114, wide 0.085 -> 0.09940 -> 0.10839 -> 0.11201
    for windows, start, logged in (((128, 384, 640, 768), 0.13, (0.15856, 0.17476, 0.18114)),
                                   ((384, 896, 1408, 1664), 0.085, (0.09940, 0.10839, 0.11201))):
        for stages, value in zip(range(2, 5), logged):
            assert train_gpt.rotary_frequencies(64, windows[:stages], 32, start)[1] == pytest.approx(value, abs=6e-6)


@pytest.mark.parametrize("follows", ["own", "long"])
def test_each_layers_rotary_follows_its_own_window_or_the_long_one(follows):
    # the tiny model with narrow queries in short-window layers 1 and 2 (tiny's windows: L S S S S L): after stages of
    # windows (128, 256) then (256, 768), a layer follows its own window's changes (#92) or the long one's (#89)
    args = train_gpt.parse_args(["--preset", "tiny", "--narrow_qk_layers", "1,2", "--narrow_attention_scale", "0.13",
                                 "--rotary_follows", follows], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    model.stretch_rotary(((128, 256), (256, 768)))
    for i, block in enumerate(model.blocks):
        if block.attn is None:
            continue
        short, narrow = not train_gpt.layer_stack(args)[i].long_window and follows == "own", i in (1, 2)
        freq, scale = yarn_by_hand(args.head_dim // 4, (128, 256) if short else (256, 768), 0.13 if narrow else 0.1)
        rotary = block.attn.rotary
        np.testing.assert_allclose(rotary.angular_freq[:len(freq)].double().numpy(), freq, rtol=1e-6)
        assert not rotary.angular_freq[len(freq):].any() and len(rotary.angular_freq) == block.attn.qk_dim // 2
        assert rotary.attention_scale.item() == pytest.approx(scale, rel=1e-6)
    assert (model.blocks[1].attn.rotary.attention_scale.item() == pytest.approx(0.13 * (1 + 0.2 * math.log(2)),
                                                                                   rel=1e-6)) == (follows == "own")


def test_a_layer_with_two_mlps_adds_both_and_one_without_scales_its_residual_alone():
    # by hand: residual x + output (MLP1(norm x) + MLP2(norm x)), each relu^2 through its own matrices; no MLP: x times
    # the residual's scale; the hidden width is the config's
    layers = (train_gpt.LayerConfig(attention_free=True, x0=False, double_mlp=True),
              train_gpt.LayerConfig(attention_free=True, x0=False, mlp_free=True))
    config = train_gpt.ModelConfig(vocab_size=512, model_dim=16, num_heads=2, head_dim=8, layers=layers, mlp_hidden=24)
    two, none = train_gpt.Block(config, 0), train_gpt.Block(config, 1)
    torch.manual_seed(0)
    for p in two.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        none.mlp_scales.residual.fill_(0.7)
    x = torch.randn(1, 5, 16)
    n = x / (x.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps).sqrt()
    mlps = [two.mlp, two.second_mlp]
    assert all(m.c_fc.weight.shape == (24, 16) for m in mlps)
    by_hand = sum(torch.relu(n @ m.c_fc.weight.T).square() @ m.c_proj.weight.T for m in mlps)
    expected = two.mlp_scales.residual * x + two.mlp_scales.output * by_hand
    gates = {}
    torch.testing.assert_close(two(x, x, None, None, gates), expected, rtol=1e-5, atol=1e-6)
    assert none.mlp is None and none.mlp_scales.output is None
    assert sorted(name for name, _ in none.named_parameters()) == ["mlp_scales.residual"]
    torch.testing.assert_close(none(x, x, None, None, gates), 0.7 * x, rtol=0, atol=0)


def test_92s_layer_geometry_holds_92s_matrices():
    # #92's package's shapes (its banks hold every head 128 wide; a narrow layer reads the first 64 rows): the live
    # parts are queries and keys 5,308,416, values and outputs 7,077,888, MLPs (10 layers and layer 8's second)
    # 47,579,136
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    attns = [b.attn for b in model.blocks if b.attn is not None]
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None] == [0, 1, 2, 3, 5, 8, 10]
    assert sum(a.qk.weight.numel() for a in attns) == 5_308_416
    assert sum(a.v.weight.numel() + a.c_proj.weight.numel() for a in attns) == 7_077_888
    mlps = [m for b in model.blocks for m in (b.mlp, b.second_mlp) if m is not None]
    assert len(mlps) == 11 and sum(p.numel() for m in mlps for p in m.parameters()) == 47_579_136
    scales = {i: b.attn.rotary.shape["scale"] for i, b in enumerate(model.blocks) if b.attn is not None}
    assert scales == pytest.approx({0: 0.13, 1: 0.13, 2: 0.13, 3: 0.085, 5: 0.13, 8: 0.13, 10: 0.085})
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None and b.attn.key_offset] == [3, 10]


def test_narrow_heads_and_two_mlps_train_under_tensor_and_sequence_parallelism():
    # the tiny model with narrow queries (in a paired and a DC-MHA layer), narrow values (with value embeddings), two
    # MLPs in one layer and none in another (which takes x0 and the bigram embedding), #92's head: 3 steps under
    # --tp 2 --sp, which cuts attention by heads and the MLP by its width, against one process; losses within rtol
    # 1e-5 (tensor parallelism's sums in another order; `--check_layout all` with these flags: every layout OK)
    flags = ["--preset=tiny", "--num_iterations=3", "--train_seq_len=128", "--seqs_per_step=2", "--val_seq_len=128",
             "--val_tokens=256", "--narrow_qk_layers=1,2,3", "--narrow_v_layers=1,2",
             "--double_mlp_layers=0", "--mlp_free_layers=4", "--mlp_hidden=96", "--rotary_follows=own",
             "--x0_layers=0,2,4,5", "--ngram_layers=0,3,4", "--mudd_head=92", "--model_dim=64", "--head_dim=16",
             f"--train_files={SHAKESPEARE}/shakespeare_train_*.bin", f"--val_files={SHAKESPEARE}/shakespeare_val_*.bin"]
    one = train_gpt.train_steps(0, 1, flags, 3)
    split = train_gpt.run_on_ranks(train_gpt.train_steps, 2, flags + ["--tp=2", "--sp=true"], 3)
    assert len(set(one["losses"])) == 3  # (training moves)
    for rank in split:
        np.testing.assert_allclose(rank["losses"], one["losses"], rtol=1e-5)
        assert abs(rank["val_loss"] - one["val_loss"]) < 1e-4


def test_92s_injection_sites_give_its_gate_networks_92s_lanes():
    # #92's package: the gate network entering layer 0 gives 23 per-token coefficients (XSA of layers 1 and 3, layer
    # 3's output gates, x0's share in layers 0-2, the n-gram's in 0 and 1), the one entering layer 4 gives 13 (layer
    # 10's output gates, x0's share in 4, 5, 7, the n-gram's in 4, 5, 9, the skip's gate); the last layer's MUDD
    # network 14
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    assert {k: v.bias.numel() for k, v in model.gate_networks.items()} == {"0": 23, "4": 13}
    assert model.dense_networks["10"].bias.numel() == 14
    slots = [i for i, block in enumerate(model.blocks) if block.attention_slot]
    assert slots == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]  # (layer 6, no attention and no injection, has no slot)
    assert model.blocks[6].attn_scales is None and model.blocks[4].attn_scales.output is None


def test_a_layer_without_attention_takes_x0_and_the_bigram_embedding_after_its_scale_of_the_residual():
    # by hand: r x + a x0 + b bigram, then the MLP's r' x + o MLP(norm x); its learned shares start at #89's 0, 0.05
    config = train_gpt.ModelConfig(vocab_size=512, model_dim=16, num_heads=2, head_dim=8, ngram_rows=64, layers=(
        train_gpt.LayerConfig(), train_gpt.LayerConfig(attention_free=True)))
    block = train_gpt.Block(config, 1)  # (the first layer's input takes the n-gram embedding: a later one's output)
    assert {k: v.item() for k, v in block.shares.items()} == pytest.approx({"x0": 0.0, "ngram": 0.05})
    assert block.attn_scales.output is None
    torch.manual_seed(1)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, x0, bigram = torch.randn(3, 1, 5, 16).unbind(0)
    with torch.no_grad():
        y = block(x, x0, None, None, {}, ngram=bigram)
    mid = block.attn_scales.residual * x + block.shares["x0"] * x0 + block.shares["ngram"] * bigram
    n = mid / (mid.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps).sqrt()
    mlp = torch.relu(n @ block.mlp.c_fc.weight.T).square() @ block.mlp.c_proj.weight.T
    torch.testing.assert_close(y, block.mlp_scales.residual * mid + block.mlp_scales.output * mlp, rtol=1e-5, atol=1e-6)


def test_92s_head_network_gives_each_state_a_share_per_token_and_group_of_channels_as_written_out_by_hand():
    # fp64 by hand: h = gelu(W1 x); share_k = 0.1 (W2 h + b)_k, plus for channel c in group g = c // (D / G) a delta
    # 0.1 (D h)_(k, g); the deltas start at zero, so each share starts at its value (the backout's -0.5)
    wanted = {"head": {"a": (1, 0.0), "attended": (1, -0.5), "c": (1, 0.0)}}
    network = train_gpt.GateNetwork(128, wanted, lr_scale=0.25, learned_scale=False, channel_groups=2).double()
    x = torch.randn(1, 5, 128, dtype=torch.float64)
    with torch.no_grad():
        start = network(x)["head"]
        assert (start["attended"] == -0.5).all() and (start["a"] == 0).all()
        for p in network.parameters():
            torch.nn.init.normal_(p, std=0.2)
        got = network(x)["head"]
    h = torch.nn.functional.gelu(x @ network.hidden.weight.T)
    shares = 0.1 * (h @ network.out.weight.T + network.bias)
    deltas = 0.1 * (h @ network.group_deltas.weight.T).view(1, 5, 3, 2)
    for k, name in enumerate(("a", "attended", "c")):
        expected = torch.cat([(shares[..., k] + deltas[..., k, g])[..., None].expand(1, 5, 64) for g in (0, 1)], -1)
        torch.testing.assert_close(got[name], expected, rtol=1e-12, atol=1e-12)
    assert (got["a"][..., :64] - got["a"][..., 64:]).abs().max() > 1e-3  # (the groups differ)


def test_92s_head_takes_in_its_ten_states():
    # #92's: the first layer's input, layer 7's output (from -0.5: the backout), layer 9's output, the four value
    # embeddings, layer 3's output, the last layer's MLP input and layer 7's output normed; 12 groups of 64 channels.
    # The wiring on the tiny model: the last layer's MLP input is what its MLP read, the normed state layer 3's output
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    head = train_gpt.build_model(args, torch.device("meta")).dense_networks["head"]
    assert list(head.widths["head"]) == ["first_input", "attended", "penultimate", "value_embed_1", "value_embed_2",
                                         "value_embed_8", "value_embed_10", "skip", "last_mlp_input",
                                         "attended_normed"]
    assert head.channel_groups == 12 and head.group_deltas.weight.shape == (10 * 12, 64)
    args = train_gpt.parse_args(["--preset", "tiny", "--mudd_head", "92", "--model_dim", "64", "--head_dim", "16"],
                                cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    seen = {}
    model.blocks[-1].mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("mlp", a[0]))
    model.blocks[3].register_forward_hook(lambda m, a, out: seen.__setitem__("attended", out))
    sources = model.head_sources
    model.head_sources = lambda s: seen.setdefault("sources", sources(s))
    tokens = torch.randint(0, args.vocab_size, (257,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens[:-1], tokens[1:], train_gpt.window_tensor((128, 256), torch.device("cpu")))
    got = seen["sources"]
    assert torch.equal(got["last_mlp_input"], seen["mlp"]) and torch.equal(got["attended"], seen["attended"])
    torch.testing.assert_close(got["attended_normed"], train_gpt.norm(seen["attended"]), rtol=0, atol=0)
    assert sorted(k for k in got if k.startswith("value_embed")) == ["value_embed_1", "value_embed_2", "value_embed_5"]
