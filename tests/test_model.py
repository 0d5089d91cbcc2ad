"""The model's layer stack (record #89's): the residual stream against its formulas written out, and where each
learned scale starts."""
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt
from train_gpt import norm


def tiny_model_with_every_weight_nonzero():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    draws = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # every scale away from its start, and the zero-initialised layers not zero
            spread = (p.std().item() or p.size(-1) ** -0.5) if p.numel() > 1 else 1.0
            p.add_(0.3 * spread * torch.randn(p.shape, generator=draws))
        for value_embed in model.value_embeds.values():  # (at 0.01 randn they barely move the logits, gated or not)
            value_embed.weight.mul_(100)
    return args, model


def smeared_by_the_formula(model, embeddings):
    """#89's smear, a token at a time: e_t + lambda sigmoid(w . e_t[:12]) e_(t-1), the first token as it is."""
    smear = model.smear
    rows = [embeddings[0]] + [e + smear.scale * torch.sigmoid(smear.gate.weight[0] @ e[:12]) * before
                              for before, e in zip(embeddings[:-1], embeddings[1:])]
    return torch.stack(rows)


def gated_by_the_formula(block, read, ve):
    """#89's value-embedding gate: per head h, ve's part h times 2 sigmoid(w_h . [read[:6], ve[:6]])."""
    gate = 2 * torch.sigmoid(torch.cat([read[0, :, :6], ve[:, :6]], dim=-1) @ block.value_gate.weight.T)  # (T, H)
    return torch.cat([gate[:, h:h + 1] * part for h, part in enumerate(ve.chunk(gate.size(-1), dim=-1))], dim=-1)


def coefficients_by_the_formula(network, x):
    """#85's gate network: (W2 gelu(W1 x) + b) s, cut into its layers' coefficients in the order it lists them."""
    flat = (F.gelu(x @ network.hidden.weight.T) @ network.out.weight.T + network.bias) * network.scale
    parts = iter(flat.split([w for widths in network.widths.values() for w in widths.values()], dim=-1))
    return {int(layer): {name: next(parts) for name in widths} for layer, widths in network.widths.items()}


def logits_by_the_formulas(model, tokens, window, backout=True, attend_over=True, smear=True, value_gates=True,
                           xsa=True, output_gates=True):
    """#89's residual stream spelled out, each block's attention and MLP taken as they are: the previous token's
    embedding smeared in, gate networks' coefficients for the layers from theirs to the next one's, the gated skip
    into its layer's input, attention over the kept layer's output after it with a value embedding gated per head,
    scales on the residual and each output, x0 after attention, and the kept output's share taken back out before
    the head."""
    masks = model.attention_masks(tokens[:-1], window)
    embeddings = model.embed(tokens[:-1])
    embed = norm((smeared_by_the_formula(model, embeddings) if smear else embeddings)[None])
    x, x0, outputs, coefficients = embed, embed, {}, {}
    (skip_from, skip_to), over = model.skip, model.attend_over
    for i, block in enumerate(model.blocks):
        if str(i) in model.gate_networks:
            coefficients.update(coefficients_by_the_formula(model.gate_networks[str(i)], x))
        gates = coefficients.get(i, {})
        if i == skip_to:
            x = x + torch.sigmoid(block.skip_gate) * gates["skip"] * outputs[skip_from]
        if block.attn is not None:
            read = norm(outputs[over] if attend_over and i > over else x)
            ve = model.value_embeds[str(i)](tokens[:-1]) if str(i) in model.value_embeds else None
            if ve is not None and value_gates:
                ve = gated_by_the_formula(block, read, ve)
            out = block.attn(read, ve, masks[model.window_pattern[i]], gates.get("xsa") if xsa else None,
                             gates.get("output_gate") if output_gates else None)
            x = block.attn_scales[0] * x + block.attn_scales[1] * out + gates["x0"] * x0
        x = block.mlp_scales[0] * x + block.mlp_scales[1] * block.mlp(norm(x))
        outputs[i] = x
    if backout:
        x = x + model.backout * outputs[over]
    return model.lm_head(norm(x)[0], None)  # the logits


def test_the_layer_stack_computes_the_formulas_of_record_89():
    args, model = tiny_model_with_every_weight_nonzero()
    assert model.skip == (1, 4) and model.attend_over == 3 and model.blocks[4].attn is None  # the tiny preset's
    assert list(model.gate_networks) == ["0", "2"]  # (its XSA layers 1 and 3, output gates 3 and 5)
    tokens = torch.randint(0, args.vocab_size, (args.train_seq_len + 1,), generator=torch.Generator().manual_seed(2))
    tokens[::37] = train_gpt.EOT_TOKEN
    window = train_gpt.window_tensor(128, torch.device("cpu"))
    with torch.no_grad():
        logits = model(tokens[:-1], None, window)
        expected = logits_by_the_formulas(model, tokens, window)
        spread = (expected - expected.mean()).abs().max()  # (the soft cap centres the logits on 15)
        # what the comparison can see: without the backout, with layer 5 attending over its own input, without the
        # smear, with the value embeddings ungated, without XSA or without the output gates
        for changed in (logits_by_the_formulas(model, tokens, window, backout=False),
                        logits_by_the_formulas(model, tokens, window, attend_over=False),
                        logits_by_the_formulas(model, tokens, window, smear=False),
                        logits_by_the_formulas(model, tokens, window, value_gates=False),
                        logits_by_the_formulas(model, tokens, window, xsa=False),
                        logits_by_the_formulas(model, tokens, window, output_gates=False)):
            assert (changed - expected).abs().max() > 1e-3 * spread
    assert (logits - expected).abs().max() <= 1e-5 * spread  # the same float32 ops: rounding only


def test_each_learned_scale_starts_where_record_89_starts_it():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    # each gate network's coefficients: x0's share 0, the skip's gate 0.5, XSA's strength 0 (tanh 0: none), the
    # output gates 0.25, as #89 starts them, whatever the token (W2 starts at zero)
    tokens = torch.randint(0, args.vocab_size, (args.train_seq_len,), generator=torch.Generator().manual_seed(4))
    stream = model.embed_tokens(tokens)
    first = model.gate_networks["0"](stream["x"])
    assert first.keys() == {"0", "1"} and first["0"].keys() == {"x0"} and first["1"].keys() == {"x0", "xsa"}
    later = model.gate_networks["2"](torch.randn_like(stream["x"]))
    assert later.keys() == {"2", "3", "4", "5"} and later["4"].keys() == {"skip"}
    starts = dict(x0=0.0, skip=0.5, xsa=0.0, output_gate=0.25)
    for coefficients in (*first.values(), *later.values()):
        for name, value in coefficients.items():
            assert torch.allclose(value, torch.full_like(value, starts[name]), rtol=1e-6, atol=0), name
    # the skip: sigmoid(-1.5) x its gate's starting 0.5
    assert torch.sigmoid(model.blocks[4].skip_gate).item() == torch.sigmoid(torch.tensor(-1.5)).item()
    assert [i for i, block in enumerate(model.blocks) if block.skip_gate is not None] == [4]
    for block in model.blocks:  # the residual grows by 1.1 a layer; outputs at 1; x0's share from the networks
        scales = block.mlp_scales if block.attn is None else block.mlp_scales * block.attn_scales[0]
        assert math.isclose(scales[0].item(), 1.1 if block.attn is not None else 1.1 ** 0.5, rel_tol=1e-6)
        assert block.mlp_scales[1].item() == 1.0
        if block.attn is not None:
            assert block.attn_scales.tolist() == [pytest.approx(1.1 ** 0.5), 1.0]
    # without gate networks, the skip's gate is one learned scalar starting at the same weight, by hand
    # 0.5 / (1 + e^1.5), and x0's share a learned scalar starting at 0
    static = train_gpt.build_model(train_gpt.parse_args(["--preset", "tiny", "--gate_network_layers", "",
                                                         "--xsa_layers", "", "--output_gate_layers", ""],
                                                        cuda=False), torch.device("cpu"))
    assert not static.gate_networks and static.blocks[0].attn_scales[2].item() == 0.0
    assert math.isclose(torch.sigmoid(static.blocks[4].skip_gate).item(), 0.0912128, rel_tol=1e-6)
    assert model.backout.item() == -0.5
    # the smear: off (its scale 0), its gate at zero (so at sigmoid(0) = 1/2 once the scale moves)
    assert model.smear.scale.item() == 0.0 and not model.smear.gate.weight.any()
    # the value embeddings: one table per listed layer, 0.01 randn; each gate at 2 sigmoid(0) = 1; v at 0.5
    assert list(model.value_embeds) == ["1", "2", "5"]
    for value_embed in model.value_embeds.values():
        assert abs(value_embed.weight.std().item() - 0.01) < 0.001
    assert [i for i, block in enumerate(model.blocks) if block.value_gate is not None] == [1, 2, 5]
    assert all(not block.value_gate.weight.any() for i, block in enumerate(model.blocks) if i in (1, 2, 5))
    assert all(block.attn.value_scale.item() == 0.5 for block in model.blocks if block.attn is not None)


def test_gates_go_to_adam_at_their_own_share_of_the_gates_lr():
    args = train_gpt.parse_args(["--preset", "tiny", "--lr_gate", "0.5", "--optimizer_recipe", "89"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    networks = [f"gate_networks.{i}.{name}" for i in (0, 2) for name in ("scale", "bias", "hidden.weight",
                                                                         "out.weight")]
    assert groups["gate"] == ["smear.gate.weight", *(f"blocks.{i}.value_gate.weight" for i in (1, 2, 5)), *networks]
    assert "smear.scale" in groups["scalar"]
    adam, muon = train_gpt.build_optimizers(model, groups, args, torch.device("cpu"), cuda_dtypes=False)
    lr_of = {p: (group["lr"], group["betas"]) for group in adam.param_groups for p in group["params"]}
    assert lr_of[model.smear.gate.weight] == (0.5 * 0.01, (0.9, 0.99))  # #89's smear gate: 1/100 of the base lr
    assert lr_of[model.smear.scale] == (args.lr_scalar, (0.9, 0.99))
    assert lr_of[model.blocks[1].value_gate.weight] == (0.5, (0.9, 0.99))  # #89's value gates: its base lr
    for p in model.gate_networks.parameters():  # #89's gate networks, their biases and scale too: 1/10 of it
        assert lr_of[p] == (0.5 * 0.1, (0.9, 0.99))
    assert all(p is not model.smear.gate.weight for group in muon.param_groups for p in group["params"])


def test_the_stream_carries_a_layers_output_only_while_a_later_layer_or_the_head_reads_it():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    tokens = torch.full((args.train_seq_len,), train_gpt.EOT_TOKEN)
    masks = model.attention_masks(tokens, train_gpt.window_tensor(128, torch.device("cpu")))
    stream, carried = model.embed_tokens(tokens), []
    for i in range(len(model.blocks)):
        stream = model.run_block(i, stream, masks)
        carried.append({key for key in stream if key.startswith("layer")} | set(stream["ve"]))
    # the tiny preset: layer 1's output until the skip into layer 4 takes it, layer 3's (attended over by layer 5,
    # taken back out before the head) to the end; the value embeddings of layers 1, 2 and 5 until they feed them
    assert carried == [{"1", "2", "5"}, {"layer1", "2", "5"}, {"layer1", "5"}, {"layer1", "layer3", "5"},
                       {"layer3", "5"}, {"layer3"}]


def test_without_the_skip_and_the_attended_layer_the_model_has_neither_and_its_blocks_read_their_own_stream():
    args = train_gpt.parse_args(["--preset", "tiny", "--skip_layers", "", "--attend_over_layer", ""], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    assert model.backout is None and all(block.skip_gate is None for block in model.blocks)
    tokens = torch.randint(0, args.vocab_size, (args.train_seq_len + 1,), generator=torch.Generator().manual_seed(3))
    masks = model.attention_masks(tokens[:-1], train_gpt.window_tensor(128, torch.device("cpu")))
    stream = model.embed_tokens(tokens[:-1])
    for i in range(len(model.blocks)):
        inputs = model.block_inputs(i, stream, masks)
        assert inputs["skip"] is None and inputs["attend_over"] is None
        stream = model.run_block(i, stream, masks)
    assert set(stream) == {"x", "x0", "ve", "gates"}
    model(tokens[:-1], tokens[1:], train_gpt.window_tensor(128, torch.device("cpu"))).backward()
    assert model.lm_head.weight.grad.abs().sum() > 0  # (the head starts at zero: only its gradient is non-zero)


def test_the_key_offset_gives_each_key_the_previous_tokens_unrotated_dims():
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(dim=32, num_heads=2, head_dim=16, max_seq_len=256, key_offset=True)
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # (zero at the start: it would hide the output)
    x = torch.randn(1, 256, 32)
    tokens = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    tokens[::50] = train_gpt.EOT_TOKEN
    mask = train_gpt.document_causal_masks(tokens, train_gpt.window_tensor(128, torch.device("cpu")))[0].dense()
    with torch.no_grad():
        q, k, v = attn.qkv(x).view(1, 256, 3, 2, 16).unbind(2)
        q, k = attn.rotary(norm(q)), attn.rotary(norm(k))
        # by hand: the rotary turns dims (i, i + 8) for i < 4 of a 16-dim head; dims 4-7 and 12-15 stay put
        unrotated = [4, 5, 6, 7, 12, 13, 14, 15]
        offset = k.clone()
        offset[:, 1:, :, unrotated] = k[:, :-1, :, unrotated]
        expected = [attn.c_proj(torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), (0.5 * v).transpose(1, 2), attn_mask=mask, scale=0.12
        ).transpose(1, 2).reshape(1, 256, 32)) for keys in (offset, k)]
        out = attn(x, None, mask)
        attn.key_offset = False
        plain = attn(x, None, mask)
    assert (out - expected[0]).abs().max() <= 1e-6 * expected[0].abs().max()
    assert (plain - expected[1]).abs().max() <= 1e-6 * expected[1].abs().max()
    assert (expected[0] - expected[1]).abs().max() > 0.01 * expected[1].abs().max()  # the offset shows
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))  # the record: in its long-window layers, 3 and 10
    assert [i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.key_offset] == [3, 10]


def test_xsa_and_the_output_gate_change_each_heads_output_by_their_formulas():
    """#82's XSA and #85's output gate against float64 by hand: head h's output y_h loses tanh(a_h) (y_h . v_h) /
    |v_h|^2 of v_h, its own value, then is scaled by g_h, before the output projection."""
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(dim=32, num_heads=2, head_dim=16, max_seq_len=256).double()
    x = torch.randn(1, 256, 32, dtype=torch.float64)
    strength, gate = torch.randn(1, 256, 2, dtype=torch.float64), torch.rand(1, 256, 2, dtype=torch.float64)
    tokens = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    tokens[::50] = train_gpt.EOT_TOKEN
    mask = train_gpt.document_causal_masks(tokens, train_gpt.window_tensor(128, torch.device("cpu")))[0].dense()
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(32))  # the heads' outputs side by side
        plain = attn(x, None, mask).view(1, 256, 2, 16)
        v = 0.5 * (x @ attn.qkv.weight[2].T).view(1, 256, 2, 16)  # the values, at their 0.5
        along_v = (plain * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)
        expected = (plain - torch.tanh(strength)[..., None] * along_v * v) * gate[..., None]
        out = attn(x, None, mask, strength, gate).view(1, 256, 2, 16)
    assert (out - expected).abs().max() <= 1e-12 * expected.abs().max()
    assert (expected - plain * gate[..., None]).abs().max() > 0.01 * expected.abs().max()  # XSA shows


def test_the_record_gate_networks_serve_record_89s_layers():
    """#89's two networks: at the embedding, for layers 0-3 (x0's share in each, XSA in 1 and 3, output gates in 3),
    and at layer 4's input, for 4-10 (x0's share in each layer with attention, the skip's gate into 6, XSA in 4 and
    7, output gates in 10): by hand 4 + 2 x 6 + 6 = 22 and 6 + 1 + 2 x 6 + 6 = 25 coefficients (#89's 26 and 41
    add its bigram gates and DC-MHA's weights, not here yet, and take layer 10's x0 share from MUDD's network)."""
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    widths = {start: {int(layer): coefficients for layer, coefficients in network.widths.items()}
              for start, network in model.gate_networks.items()}
    assert widths == {"0": {0: dict(x0=1), 1: dict(x0=1, xsa=6), 2: dict(x0=1), 3: dict(x0=1, xsa=6, output_gate=6)},
                      "4": {4: dict(x0=1, xsa=6), 5: dict(x0=1), 6: dict(skip=1), 7: dict(x0=1, xsa=6),
                            8: dict(x0=1), 9: dict(x0=1), 10: dict(x0=1, output_gate=6)}}
    assert [network.bias.numel() for network in model.gate_networks.values()] == [22, 25]
    assert all(network.hidden.weight.shape == (64, 768) for network in model.gate_networks.values())
