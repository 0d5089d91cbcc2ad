"""The model's layer stack (record #89's): the residual stream against its formulas written out, and where each
learned scale starts."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt
from train_gpt import norm


def tiny_model_with_every_weight_nonzero(mudd=True):
    args = train_gpt.parse_args(["--preset", "tiny", "--mudd", str(mudd)], cuda=False)
    torch.manual_seed(0)  # the model drawn alike every run: a test that a change moves the logits must not draw
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


def coefficients_by_the_formula(network, x, scale=None):
    """#85's gate network and MUDD's: (W2 gelu(W1 x) + b) s, cut into its layers' coefficients in the order it lists
    them (MUDD's: its dense layer's, or the head's); s the network's own, or the one every gate network shares."""
    flat = (F.gelu(x @ network.hidden.weight.T) @ network.out.weight.T + network.bias) * \
        (network.scale if scale is None else scale)
    parts = iter(flat.split([w for widths in network.widths.values() for w in widths.values()], dim=-1))
    return {layer: {name: next(parts) for name in widths} for layer, widths in network.widths.items()}


def lanes_by_the_formula(lanes, ve, head_dim):
    """A dense layer's value-embedding gate (#89's): head h of H takes lane h x L // H of its L lanes."""
    heads = ve.chunk(ve.size(-1) // head_dim, dim=-1)
    return torch.cat([lanes[0, :, h * lanes.size(-1) // len(heads), None] * part for h, part in enumerate(heads)],
                     dim=-1)


def int32(value):
    """A Python integer wrapped into int32, as the hardware's int32 arithmetic wraps it."""
    return (value + 2**31) % 2**32 - 2**31


def bigram_rows_by_hand(tokens, rows):
    """#89's hash in Python integers: (36313 t_j xor 27191 t_(j-1)) mod (rows - 1), in int32; position 0 takes the
    last row, and position 1's previous token is that row's index."""
    tokens, last = [int(t) for t in tokens], rows - 1
    previous = [last] + tokens[1:-1]  # of positions 1, 2, ...
    return [last] + [(int32(36313 * t) ^ int32(27191 * p)) % last for t, p in zip(tokens[1:], previous)]


def bigram_by_the_formula(model, tokens):
    """Each position's row of the hash table times the sign vector of (previous xor own) mod 8192 (the first: row 0)."""
    bigram, tokens = model.ngram, [int(t) for t in tokens]
    rows = bigram_rows_by_hand(tokens, bigram.table.num_embeddings)
    signs = [0] + [(p ^ t) % 8192 for p, t in zip(tokens[:-1], tokens[1:])]
    return torch.stack([bigram.table.weight[r] * bigram.signs[s] for r, s in zip(rows, signs)])[None]


def logits_by_the_formulas(model, tokens, window, backout=True, attend_over=True, smear=True, value_gates=True,
                           xsa=True, output_gates=True, bigram=True, dense=True, dense_head=True, composition=True):
    """#89's residual stream spelled out, each block's attention and MLP taken as they are: the previous token's
    embedding smeared in, gate networks' coefficients for the layers from theirs to the next one's, the gated skip
    into its layer's input, attention over the kept layer's output after it with a value embedding gated per head,
    scales on the residual and each output, x0 after attention, and the kept output's share taken back out before
    the head; with MUDD, the last layer's input and values take in the first layer's input, the attended layer's
    output and the layer's own input, its value gate per half of the heads, its scales and shares per token (x0's
    of the first layer's input), and the head's input the first layer's input, the attended layer's output, the
    last layer's input, the first value embedding and the skip's source (backout in it); a composed layer's
    attention takes DC-MHA's mix of heads, normed over them (eps 1e-6, #89's), and its weights."""
    masks = model.attention_masks(tokens[:-1], window)
    embeddings = model.embed(tokens[:-1])
    embed = norm((smeared_by_the_formula(model, embeddings) if smear else embeddings)[None])
    x, x0, outputs, coefficients = embed, embed, {}, {}
    pairs = bigram_by_the_formula(model, tokens[:-1]) if bigram else torch.zeros_like(x)
    c = model.config
    (skip_from, skip_to), over = c.skip, c.attend_over
    for i, block in enumerate(model.blocks):
        for network, scale in ((networks[str(i)], shared) for networks, shared in (
                (model.gate_networks, model.gate_networks["0"].scale), (model.dense_networks, None))
                if str(i) in networks):  # (#89's one scale for its gate networks: the first one's)
            for layer, coefs in coefficients_by_the_formula(network, x, scale).items():
                coefficients.setdefault(layer, {}).update(coefs)
        gates = coefficients.get(i, {})
        if i == skip_to:
            x = x + torch.sigmoid(block.skip_gate) * gates["skip"] * outputs[skip_from]
        if i == 0:  # the bigram embedding: into the first layer's input, after each later layer's attention
            x = x + gates["ngram"] * pairs
            outputs[-1] = x
        dense_value = None
        if i == c.dense_layer:
            states = [outputs[-1], outputs[over], x]
            dense_value = sum(gates["dense_value"][..., k, None] * state for k, state in enumerate(states))
            x = x + sum(gates["dense"][..., k, None] * state for k, state in enumerate(states)) * dense
        if block.attn is not None:
            read = norm(outputs[over] if attend_over and i > over else x)
            ve = model.value_embeds[str(i)](tokens[:-1]) if str(i) in model.value_embeds else None
            if ve is not None and value_gates:
                ve = gated_by_the_formula(block, read, ve) if "value_gate" not in gates else \
                    lanes_by_the_formula(gates["value_gate"], ve, block.attn.v_dim)
            if dense_value is not None and dense:
                ve = dense_value if ve is None else ve + dense_value
            dc = [torch.nn.functional.rms_norm(gates["dc_mix"], (gates["dc_mix"].size(-1),), eps=1e-6),
                  gates["dc_weight"], masks["banded"]] if "dc_mix" in gates and composition else []
            out = block.attn(read, ve, masks[c.layers[i].window, 1 + c.layers[i].paired_head],
                             gates.get("xsa") if xsa else None, gates.get("output_gate") if output_gates else None, *dc)
            residual, output = gates["attn_scales"].split(1, -1) if "attn_scales" in gates else \
                (block.attn_scales.residual, block.attn_scales.output)
            x = residual * x + output * out + gates["x0"] * (outputs[-1] if i == c.dense_layer else x0)
            if i > 0:
                x = x + gates["ngram"] * pairs
        residual, output = gates["mlp_scales"].split(1, -1) if "mlp_scales" in gates else \
            (block.mlp_scales.residual, block.mlp_scales.output)
        x = residual * x + output * block.mlp(norm(x))
        outputs[i] = x
    if backout and model.backout is not None:
        x = x + model.backout * outputs[over]
    if c.mudd and dense_head:
        coefs = coefficients_by_the_formula(model.dense_networks["head"], x)["head"]
        ve = model.value_embeds[str(min(map(int, model.value_embeds)))](tokens[:-1])[None]
        states = [outputs[-1], outputs[over], outputs[len(model.blocks) - 2], ve, outputs[skip_from]]
        x = x + sum(coef * state for coef, state in zip(coefs.values(), states))
    return model.lm_head(norm(x)[0], None)  # the logits


@pytest.mark.parametrize("mudd", [True, False])
def test_the_layer_stack_computes_the_formulas_of_record_89(mudd):
    ROUNDING = 1e-5  # of the logits' spread
    args, model = tiny_model_with_every_weight_nonzero(mudd=mudd)
    assert model.config.skip == (1, 4) and model.config.attend_over == 3 and model.blocks[4].attn is None  # tiny
    assert list(model.gate_networks) == ["0", "2"]  # (its XSA layers 1 and 3, output gates 3 and 5)
    assert list(model.dense_networks) == (["5", "head"] if mudd else [])
    tokens = torch.randint(0, args.vocab_size, (train_gpt.context_length(args) + 1,),
                           generator=torch.Generator().manual_seed(2))
    tokens[::37] = train_gpt.EOT_TOKEN
    window = train_gpt.window_tensor((128, 128), torch.device("cpu"))
    with torch.no_grad():
        logits = model(tokens[:-1], None, window)
        expected = logits_by_the_formulas(model, tokens, window)
        spread = (expected - expected.mean()).abs().max()  # (the soft cap centres the logits on 15)
        # what the comparison can see: without the backout (or MUDD's dense connections into the last layer's input
        # and values, or into the head's), with layer 5 attending over its own input, without the smear, with the
        # value embeddings ungated, without XSA or without the output gates
        changes = [dict(dense=False), dict(dense_head=False)] if mudd else [dict(backout=False)]
        for change in changes + [dict(attend_over=False), dict(smear=False), dict(value_gates=False), dict(xsa=False),
                                 dict(output_gates=False), dict(bigram=False), dict(composition=False)]:
            changed = logits_by_the_formulas(model, tokens, window, **change)
            # seen: ten times the rounding the comparison below allows (without MUDD, the attend-over layer moves
            # the logits by ~1e-3 of their spread)
            assert (changed - expected).abs().max() > 10 * ROUNDING * spread, change
    assert (logits - expected).abs().max() <= ROUNDING * spread  # the same float32 ops: rounding only


def test_each_learned_scale_starts_where_record_89_starts_it():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    # each gate network's coefficients: x0's share 0, the skip's gate 0.5, XSA's strength 0 (tanh 0: none), the
    # output gates 0.25, DC-MHA's mix 1 and its weight 0 (none), as #89 starts them, whatever the token (W2 starts at
    # zero)
    tokens = torch.randint(0, args.vocab_size, (train_gpt.context_length(args),),
                           generator=torch.Generator().manual_seed(4))
    x = model(tokens, None, train_gpt.window_tensor((128, 128), torch.device("cpu")), layers=range(0)).x  # embedded
    first = model.gate_networks["0"](x)
    assert first.keys() == {0, 1} and first[0].keys() == {"x0", "ngram"}
    assert first[1].keys() == {"x0", "ngram", "xsa"}
    later = model.gate_networks["2"](torch.randn_like(x))
    assert later.keys() == {2, 3, 4, 5} and later[4].keys() == {"skip"}
    starts = dict(x0=0.0, ngram=0.05, skip=0.5, xsa=0.0, output_gate=0.25, dc_mix=1.0, dc_weight=0.0)
    for coefficients in (*first.values(), *later.values()):
        for name, value in coefficients.items():
            assert torch.allclose(value, torch.full_like(value, starts[name]), rtol=1e-6, atol=0), name
    # the skip: sigmoid(-1.5) x its gate's starting 0.5
    assert torch.sigmoid(model.blocks[4].skip_gate).item() == torch.sigmoid(torch.tensor(-1.5)).item()
    assert [i for i, block in enumerate(model.blocks) if block.skip_gate is not None] == [4]
    for block in model.blocks[:-1]:  # the residual grows by 1.1 a layer; outputs at 1; x0's share from the networks
        residual = block.mlp_scales.residual * (1 if block.attn is None else block.attn_scales.residual)
        assert math.isclose(residual.item(), 1.1 if block.attn is not None else 1.1 ** 0.5, rel_tol=1e-6)
        assert block.mlp_scales.output.item() == 1.0
        if block.attn is not None:
            assert [block.attn_scales.residual.item(), block.attn_scales.output.item()] == \
                [pytest.approx(1.1 ** 0.5), 1.0]
    # without gate networks, the skip's gate is one learned scalar starting at the same weight, by hand
    # 0.5 / (1 + e^1.5), and x0's and the bigram embedding's shares learned scalars starting at 0 and 0.05
    static = train_gpt.build_model(train_gpt.parse_args(["--preset", "tiny", "--gate_network_layers", "",
                                                         "--xsa_layers", "", "--output_gate_layers", "",
                                                         "--dc_layers", "", "--mudd", "false"], cuda=False),
                                   torch.device("cpu"))
    assert static.backout.item() == -0.5 and not static.dense_networks  # (without MUDD: a learned scalar)
    assert not static.gate_networks and static.blocks[0].shares["x0"].item() == 0.0
    assert static.blocks[0].shares["ngram"].item() == pytest.approx(0.05) and "ngram" not in static.blocks[4].shares
    # the bigram table starts at zero; its signs are +-1
    assert not model.ngram.table.weight.any() and set(model.ngram.signs.unique().tolist()) == {-1.0, 1.0}
    assert math.isclose(torch.sigmoid(static.blocks[4].skip_gate).item(), 0.0912128, rel_tol=1e-6)
    # MUDD's networks (#89's): the last layer's 14 coefficients, whatever the token, start at its mixes 0, its value
    # gate 2 per half of the heads, its scales sqrt(1.1) and 1, x0's share 0 and the bigram's 0.05; the head's at 0
    # but -0.5 for the attended layer's output (the backout, which it replaces)
    assert model.backout is None and model.blocks[-1].attn_scales is None and model.blocks[-1].mlp_scales is None
    x = torch.randn_like(x)
    dense = model.dense_networks["5"](x)[5]
    starts = dict(dense_value=[0.0] * 3, dense=[0.0] * 3, value_gate=[2.0, 2.0], attn_scales=[1.1 ** 0.5, 1.0],
                  x0=[0.0], ngram=[0.05], mlp_scales=[1.1 ** 0.5, 1.0])
    assert list(dense) == list(starts)  # (#89's order)
    for name, values in starts.items():
        assert torch.allclose(dense[name], torch.tensor(values).expand_as(dense[name]), rtol=1e-6, atol=0), name
    head = model.dense_networks["head"](x)["head"]
    assert list(head) == ["first_input", "attended", "penultimate", "value_embed", "skip"]  # (#89's order)
    for name, value in head.items():
        assert torch.allclose(value, torch.full_like(value, -0.5 if name == "attended" else 0.0), rtol=1e-6, atol=0)
    # the smear: off (its scale 0), its gate at zero (so at sigmoid(0) = 1/2 once the scale moves)
    assert model.smear.scale.item() == 0.0 and not model.smear.gate.weight.any()
    # the value embeddings: one table per listed layer, 0.01 randn; each gate at 2 sigmoid(0) = 1; v at 0.5
    assert list(model.value_embeds) == ["1", "2", "5"]
    for value_embed in model.value_embeds.values():
        assert abs(value_embed.weight.std().item() - 0.01) < 0.001
    assert [i for i, block in enumerate(model.blocks) if block.value_gate is not None] == [1, 2]  # (5's: MUDD's)
    assert all(not block.value_gate.weight.any() for i, block in enumerate(model.blocks) if i in (1, 2))
    assert all(block.attn.value_scale.item() == 0.5 for block in model.blocks if block.attn is not None)


def test_the_record_starts_attentions_output_uniform_as_89_and_the_cpu_preset_at_zero():
    # #89's (#64): uniform with std 0.5 / sqrt(fan in), as the other matrices; the mlp's output at zero either way
    assert not train_gpt.parse_args(["--preset", "record89"], cuda=False).zero_attn_out
    args = train_gpt.parse_args(["--preset", "tiny", "--zero_attn_out", "false"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    bound = 3 ** 0.5 * 0.5 * 32 ** -0.5
    for block in (block for block in model.blocks if block.attn is not None):
        weight = block.attn.c_proj.weight
        assert weight.abs().max() <= bound and abs(weight.std().item() - bound / 3 ** 0.5) < 0.1 * bound
        assert not block.mlp.c_proj.weight.any()
    cpu = train_gpt.build_model(train_gpt.parse_args(["--preset", "cpu"], cuda=False), torch.device("cpu"))
    assert all(not block.attn.c_proj.weight.any() for block in cpu.blocks if block.attn is not None)


def test_gates_go_to_adam_at_their_own_share_of_the_gates_lr():
    args = train_gpt.parse_args(["--preset", "tiny", "--lr_gate", "0.5", "--optimizer_recipe", "89"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    networks = [f"gate_networks.{i}.{name}" for i in (0, 2) for name in ("scale", "bias", "hidden.weight",
                                                                         "out.weight") if name != "scale" or i == 0]
    networks += [f"dense_networks.{i}.{name}" for i in (5, "head") for name in ("bias", "hidden.weight", "out.weight")]
    assert groups["gate"] == ["smear.gate.weight", *(f"blocks.{i}.value_gate.weight" for i in (1, 2)), *networks]
    assert "smear.scale" in groups["scalar"]
    adam, muon = train_gpt.build_optimizers(model, groups, args, torch.device("cpu"), cuda_dtypes=False)
    lr_of = {p: (group["lr"], group["betas"]) for group in adam.param_groups for p in group["params"]}
    assert lr_of[model.smear.gate.weight] == (0.5 * 0.01, (0.9, 0.99))  # #89's smear gate: 1/100 of the base lr
    assert lr_of[model.smear.scale] == (args.lr_scalar, (0.9, 0.99))
    assert lr_of[model.blocks[1].value_gate.weight] == (0.5, (0.9, 0.99))  # #89's value gates: its base lr
    for p in model.gate_networks.parameters():  # #89's gate networks, their biases and scale too: 1/10 of it
        assert lr_of[p] == (0.5 * 0.1, (0.9, 0.99))
    for p in model.dense_networks.parameters():  # #89's MUDD networks: 1/4 of it
        assert lr_of[p] == (0.5 * 0.25, (0.9, 0.99))
    assert all(p is not model.smear.gate.weight for group in muon.param_groups for p in group["params"])
    # #89's decay (0.005 x lr^2) on the gates' matrices, none on the smear's gate nor a network's bias and its scale
    decay_of = {p: group["cautious_weight_decay"] for group in adam.param_groups for p in group["params"]}
    undecayed = {model.smear.gate.weight, model.gate_networks["0"].scale,
                 *(network.bias for network in [*model.gate_networks.values(), *model.dense_networks.values()])}
    assert {decay_of[p] for p in undecayed} == {0.0}
    matrices = [m.weight for m in model.modules() if isinstance(m, train_gpt.Gate) and m.weight is not
                model.smear.gate.weight]  # (the value gates, and each network's two or three)
    assert len(matrices) == 2 + 2 * 2 + 2 * 2 and {decay_of[p] for p in matrices} == {0.005}


@pytest.mark.parametrize("mudd", [False, True])
def test_what_a_later_part_reads_of_the_stream_is_found_on_the_traced_forward(mudd):
    # the tiny preset, by hand: layer 1's output (s.skip) until the skip into layer 4 takes it, layer 3's
    # (s.attended) to the end (attended over by layer 5, taken back out before the head); x0 until the last layer with
    # attention reads it; the value embeddings of layers 1, 2 and 5 until they feed them; the gate coefficients of
    # the layers still to come (network 0 serves 0-1, network 2 serves 2-5); the bigram embedding, which every layer
    # with attention takes
    args = train_gpt.parse_args(["--preset", "tiny", "--mudd", str(mudd)], cuda=False)
    trace = train_gpt.ModelTrace(train_gpt.build_model(args, torch.device("cpu")), 256).run()
    live = [sorted(train_gpt.pytree.keystr(path) for path in trace.live_after(b)) for b in range(1, 6)]
    gates = {1: [".gates[1]['ngram']", ".gates[1]['x0']", ".gates[1]['xsa']"],
             3: [f".gates[3]['{name}']" for name in ("ngram", "dc_mix", "dc_weight", "output_gate", "x0", "xsa")]}
    if not mudd:
        expected = [[".ngram", *gates[1], ".ve[1]", ".ve[2]", ".ve[5]", ".x", ".x0"],
                    [".ngram", ".skip", ".ve[2]", ".ve[5]", ".x", ".x0"],
                    [".ngram", *gates[3], ".gates[4]['skip']", ".gates[5]['ngram']", ".gates[5]['output_gate']",
                     ".gates[5]['x0']", ".skip", ".ve[5]", ".x", ".x0"],
                    [".attended", ".ngram", ".gates[4]['skip']", ".gates[5]['ngram']", ".gates[5]['output_gate']",
                     ".gates[5]['x0']", ".skip", ".ve[5]", ".x", ".x0"],
                    [".attended", ".ngram", ".gates[5]['ngram']", ".gates[5]['output_gate']", ".gates[5]['x0']",
                     ".ve[5]", ".x", ".x0"]]
    else:  # and to the end, for MUDD's dense layer 5 or its head: the first layer's input, layer 1's output (the
        # skip's source), layer 4's and layer 1's value embedding; x0 no longer after layer 3 (layer 4 has no
        # attention, and the dense layer re-adds the first layer's input instead), and layer 5's shares its own
        expected = [[".ngram", ".first_input", *gates[1], ".ve[1]", ".ve[2]", ".ve[5]", ".x", ".x0"],
                    [".ngram", ".first_input", ".skip", ".ve[1]", ".ve[2]", ".ve[5]", ".x", ".x0"],
                    [".ngram", ".first_input", *gates[3], ".gates[4]['skip']", ".gates[5]['output_gate']", ".skip",
                     ".ve[1]", ".ve[5]", ".x", ".x0"],
                    [".attended", ".ngram", ".first_input", ".gates[4]['skip']", ".gates[5]['output_gate']", ".skip",
                     ".ve[1]", ".ve[5]", ".x"],
                    [".attended", ".ngram", ".first_input", ".gates[5]['output_gate']", ".penultimate", ".skip",
                     ".ve[1]", ".ve[5]", ".x"]]
    assert live == [sorted(paths) for paths in expected]


def test_without_the_skip_and_the_attended_layer_the_model_has_neither_and_its_blocks_read_their_own_stream():
    args = train_gpt.parse_args(["--preset", "tiny", "--skip_layers", "", "--attend_over_layer", "", "--mudd",
                                 "false"], cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    assert model.backout is None and all(block.skip_gate is None for block in model.blocks)
    tokens = torch.randint(0, args.vocab_size, (train_gpt.context_length(args) + 1,),
                           generator=torch.Generator().manual_seed(3))
    window = train_gpt.window_tensor((128, 128), torch.device("cpu"))
    for i in range(len(model.blocks)):
        assert set(vars(model(tokens[:-1], tokens[1:], window, layers=range(i)))) == {"x", "x0", "ve", "gates",
                                                                                       "ngram"}
    model(tokens[:-1], tokens[1:], window).backward()
    assert model.lm_head.weight.grad.abs().sum() > 0  # (the head starts at zero: only its gradient is non-zero)


def test_the_key_offset_gives_each_key_the_previous_tokens_unrotated_dims():
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(dim=32, num_heads=2, qk_dim=16, key_offset=True)
    torch.nn.init.normal_(attn.c_proj.weight, std=0.1)  # (zero at the start: it would hide the output)
    x = torch.randn(1, 256, 32)
    tokens = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    tokens[::50] = train_gpt.EOT_TOKEN
    mask = train_gpt.document_causal_masks(tokens, train_gpt.window_tensor((128, 128), torch.device("cpu")))[0].dense()
    with torch.no_grad():
        q, k, v = attn.project(x)
        q, k = attn.rotary(norm(q), norm(k))
        # by hand: the rotary turns dims (i, i + 8) for i < 4 of a 16-dim head; dims 4-7 and 12-15 stay put
        unrotated = [4, 5, 6, 7, 12, 13, 14, 15]
        offset = k.clone()
        offset[:, 1:, :, unrotated] = k[:, :-1, :, unrotated]
        expected = [attn.c_proj(torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), (0.5 * v).transpose(1, 2), attn_mask=mask, scale=0.1
        ).transpose(1, 2).reshape(1, 256, 32)) for keys in (offset, k)]
        out = attn(x, None, mask)
        attn.key_offset = False
        plain = attn(x, None, mask)
    assert (out - expected[0]).abs().max() <= 1e-6 * expected[0].abs().max()
    assert (plain - expected[1]).abs().max() <= 1e-6 * expected[1].abs().max()
    assert (expected[0] - expected[1]).abs().max() > 0.01 * expected[1].abs().max()  # the offset shows
    args = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))  # the record: in its long-window layers, 3 and 10
    assert [i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.key_offset] == [3, 10]
    # and, as #89, not where heads attend in pairs, also in a long-window layer: a stack that would is refused
    with pytest.raises(train_gpt.UserError, match=re.escape(
            "--key_offset_layers '3,10' (the record89 preset's) and --paired_head_layers '0,3' both name layers [3]")):
        train_gpt.parse_args(["--preset", "record89", "--paired_head_layers", "0,3"], cuda=False)
    args = train_gpt.parse_args(["--preset", "record89", "--paired_head_layers", "0,3", "--key_offset_layers", "10"],
                                cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    assert [i for i, block in enumerate(model.blocks) if block.attn is not None and block.attn.key_offset] == [10]


def test_yarn_stretches_the_rotary_and_raises_the_attention_scale_at_each_change_of_the_long_window():
    """#31 in float64 by hand: a frequency that turns at most once over the old long window is slowed by old/new, one
    that turns 32 times or more is kept, those between by a linear ramp; the scale, from #89's 0.1, grows by
    0.2 ln(new/old) + 1. A stage that keeps the window changes nothing."""
    freq, scale = train_gpt.rotary_frequencies(64, (384, 896, 896, 1408))
    expected, expected_scale = (1 / 1024) ** np.linspace(0, 1, 16), 0.1
    for old, new in ((384, 896), (896, 1408)):
        ramp = np.clip((old * expected / (2 * np.pi) - 1) / 31, 0, 1)
        expected, expected_scale = expected * ((1 - ramp) * old / new + ramp), expected_scale * (0.2 * np.log(new / old) + 1)
    np.testing.assert_allclose(freq[:16].double().numpy(), expected, rtol=1e-6)
    assert not freq[16:].any() and scale == pytest.approx(expected_scale, rel=1e-12)
    # the ends by hand: 1 rad a token turns 61 times over 384 tokens, kept; 1/1024 turns 0.06 times, slowed twice
    assert freq[0] == 1 and freq[15].item() == pytest.approx(384 / 1408 / 1024, rel=1e-6)
    assert 0 < freq[8] / ((1 / 1024) ** (8 / 15)) < 1  # (one between: slowed, by less than the whole)
    # the model's rotaries and attention take them: each layer's cos and sin, and the scale in the softmax
    args, model = tiny_model_with_every_weight_nonzero()
    tokens = torch.randint(0, args.vocab_size, (train_gpt.context_length(args) + 1,),
                           generator=torch.Generator().manual_seed(2))
    window = train_gpt.window_tensor((128, 256), torch.device("cpu"))
    with torch.no_grad():
        before = model(tokens[:-1], None, window)
        model.stretch_rotary(((128, 128), (128, 256)))
        after = model(tokens[:-1], None, window)
    freq, scale = train_gpt.rotary_frequencies(args.head_dim, (128, 256))
    # each layer's rotation by hand in float64: the first half of each head's dims turned by position x frequency
    theta = torch.arange(train_gpt.context_length(args), dtype=torch.float64)[:, None] * freq.double()
    probe = torch.randn(1, theta.size(0), 2, args.head_dim, dtype=torch.float64)
    (x1, x2), cos, sin = probe.chunk(2, dim=-1), theta.cos()[None, :, None], theta.sin()[None, :, None]
    rotated = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
    rotaries = [m for m in model.modules() if isinstance(m, train_gpt.Rotary)]
    assert len(rotaries) == sum(block.attn is not None for block in model.blocks)
    for rotary in rotaries:
        # (fp32 angles of up to 255 rad are 1.5e-5 off, on values of up to ~4)
        q_turned, k_turned = rotary(probe.float(), -probe.float())  # (k: the probe negated, so a swap shows)
        torch.testing.assert_close(q_turned.double(), rotated, rtol=0, atol=2e-4)
        torch.testing.assert_close(k_turned.double(), -rotated, rtol=0, atol=2e-4)
        assert rotary.attention_scale.item() == pytest.approx(scale, rel=1e-6) and scale > 0.1 * 1.13
    assert (after - before).abs().max() > 1e-3 * (before - before.mean()).abs().max()
    seq_len = train_gpt.context_length(args)
    attn, x = model.blocks[1].attn, torch.randn(1, seq_len, args.model_dim)  # (no key offset or pairs; no XSA given)
    mask = model.attention_masks(tokens[:-1], window)["S", 1]
    with torch.no_grad():
        q, k, v = attn.project(x)
        q, k = attn.rotary(norm(q), norm(k))
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             attn.values(v, None).transpose(1, 2), attn_mask=mask,
                                                             scale=scale)
        expected = attn.c_proj(attn.proj_scale * y.transpose(1, 2).reshape(1, seq_len, -1))
        torch.testing.assert_close(attn(x, None, mask), expected, rtol=1e-5, atol=1e-6)


def test_the_record_steps_each_layers_q_and_k_per_pair_of_heads():
    args = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    _, muon = train_gpt.build_optimizers(model, groups, args, torch.device("meta"), cuda_dtypes=False)
    blocked = {p for group in muon.param_groups if group["block_rows"] == 2 * 128 for p in group["params"]}
    assert blocked == {block.attn.qk.weight for block in model.blocks if block.attn is not None}
    assert len(blocked) == 10 and all(group["width"] == 768 for group in muon.param_groups)


def test_xsa_and_the_output_gate_change_each_heads_output_by_their_formulas():
    """#82's XSA and #85's output gate against float64 by hand: head h's output y_h loses tanh(a_h) (y_h . v_h) /
    |v_h|^2 of v_h, its own value, then is scaled by g_h, before the output projection."""
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(dim=32, num_heads=2, qk_dim=16).double()
    x = torch.randn(1, 256, 32, dtype=torch.float64)
    strength, gate = torch.randn(1, 256, 2, dtype=torch.float64), torch.rand(1, 256, 2, dtype=torch.float64)
    tokens = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    tokens[::50] = train_gpt.EOT_TOKEN
    mask = train_gpt.document_causal_masks(tokens, train_gpt.window_tensor((128, 128), torch.device("cpu")))[0].dense()
    with torch.no_grad():
        attn.c_proj.weight.copy_(torch.eye(32))  # the heads' outputs side by side
        plain = attn(x, None, mask).view(1, 256, 2, 16)
        v = 0.5 * (x @ attn.v.weight.T).view(1, 256, 2, 16)  # the values, at their 0.5
        along_v = (plain * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True)
        expected = (plain - torch.tanh(strength)[..., None] * along_v * v) * gate[..., None]
        out = attn(x, None, mask, strength, gate).view(1, 256, 2, 16)
    assert (out - expected).abs().max() <= 1e-12 * expected.abs().max()
    assert (expected - plain * gate[..., None]).abs().max() > 0.01 * expected.abs().max()  # XSA shows


def test_a_dense_layers_value_gate_gives_each_half_of_the_heads_its_lane():
    # #89's six heads: heads 0-2 take the first lane, 3-5 the second, by hand; the dense mix is added after
    config = train_gpt.ModelConfig(vocab_size=512, model_dim=48, num_heads=6, head_dim=8,
                                   layers=(train_gpt.LayerConfig(value_embed=True),), mudd=True)
    block = train_gpt.Block(config, 0)  # (the last layer: MUDD's dense one)
    assert block.value_gate is None and block.dense_coefficients["value_gate"] == (2, 2.0)
    draws = torch.Generator().manual_seed(5)
    ve, lanes, mix = (torch.randn(shape, generator=draws) for shape in ((7, 48), (1, 7, 2), (1, 7, 48)))
    gated = block.value_input(None, ve, dict(value_gate=lanes), mix)
    by_hand = torch.cat([lanes[0, :, 0, None] * ve[:, 8 * h:8 * h + 8] for h in range(3)] +
                        [lanes[0, :, 1, None] * ve[:, 8 * h:8 * h + 8] for h in range(3, 6)], dim=-1)
    assert torch.allclose(gated, by_hand + mix, rtol=1e-6, atol=1e-6)


def test_the_record_gate_networks_serve_record_89s_layers():
    """#89's two networks: at the embedding, for layers 0-3 (x0's and the bigram embedding's shares in each, XSA in 1
    and 3, output gates in 3), and at layer 4's input, for 4-10 (those shares in each layer with attention, the
    skip's gate into 6, XSA in 4 and 7, output gates in 10): by hand 4 x 2 + 2 x 6 + 6 = 26 coefficients, #89's, and
    5 x 2 + 1 + 2 x 6 + 6 + 2 x 6 = 41 with DC-MHA's two weights a head in 10; layer 10's two shares come from
    MUDD's network at its input, with its 14 (#89's), and the head's takes 5."""
    args = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    widths = {start: {int(layer): coefficients for layer, coefficients in network.widths.items()}
              for start, network in model.gate_networks.items()}
    shares = dict(x0=1, ngram=1)
    assert widths == {"0": {0: shares, 1: dict(**shares, xsa=6), 2: shares, 3: dict(**shares, xsa=6, output_gate=6)},
                      "4": {4: dict(**shares, xsa=6), 5: shares, 6: dict(skip=1), 7: dict(**shares, xsa=6),
                            8: shares, 9: shares, 10: dict(output_gate=6, dc_mix=6, dc_weight=6)}}
    assert [network.bias.numel() for network in model.gate_networks.values()] == [26, 41]
    assert [network.bias.numel() for network in model.dense_networks.values()] == [14, 5]  # #89's mudd_b2 rows
    assert list(model.dense_networks) == ["10", "head"]
    assert list(model.dense_networks["head"].widths["head"]) == ["first_input", "attended", "penultimate",
                                                                 "value_embed", "skip"]
    networks = [*model.gate_networks.values(), *model.dense_networks.values()]
    assert all(network.hidden.weight.shape == (64, 768) for network in networks)
    assert model.ngram.table.weight.shape == (377280, 768)  # #89's 50304 x 15 / 2 rows


def test_the_bigram_hash_is_record_89s_in_wrapping_int32():
    tokens = torch.tensor([50256, 7, 50303, 0, 1, 50256, 31000, 31000])
    for rows in (377280, 4096, 2):  # the record's (27191 x 377279 wraps int32), the tiny preset's, the fewest
        assert train_gpt.bigram_rows(tokens, rows).tolist() == bigram_rows_by_hand(tokens, rows)
    assert int32(27191 * 377279) != 27191 * 377279  # (what the record's second position wraps)


def trigram_rows_by_hand(tokens, rows):
    """#92's hash in Python integers: (17351 t_j xor 60961 t_(j-1) xor 45259 t_(j-2)) mod (rows - 1), in int32; the
    first two positions take the last row."""
    tokens, last = [int(t) for t in tokens], rows - 1
    return [last, last][:len(tokens)] + [(int32(17351 * t) ^ int32(60961 * p) ^ int32(45259 * q)) % last
                                         for q, p, t in zip(tokens, tokens[1:], tokens[2:])]


def test_the_trigram_hash_is_record_92s_in_wrapping_int32():
    tokens = torch.tensor([50256, 7, 50303, 0, 1, 50256, 31000, 31000])
    for rows in (42_301_440, 4096, 2):  # the record's half of its table, the tiny preset's, the fewest
        assert train_gpt.trigram_rows(tokens, rows).tolist() == trigram_rows_by_hand(tokens, rows)
        assert train_gpt.trigram_rows(tokens[:1], rows).tolist() == [rows - 1]
    assert int32(60961 * 50303) != 60961 * 50303  # (what the record's products wrap)


def test_92s_ngram_table_sums_each_positions_signed_pair_and_triple_rows():
    half = 4096
    table = train_gpt.NgramHashEmbedding(2 * half, 16, trigrams=True)
    torch.nn.init.normal_(table.table.weight.detach(), generator=torch.Generator().manual_seed(0))
    tokens = [50256, 7, 50303, 0, 1, 50256, 31000, 31000, 12]
    pair_rows = bigram_rows_by_hand(tokens, half)
    triple_rows = [half + row for row in trigram_rows_by_hand(tokens, half)]
    pair_signs = [0] + [(int32(30011 * p) ^ int32(48271 * t)) & 8191 for p, t in zip(tokens, tokens[1:])]
    triple_signs = [0, 0] + [(int32(26801 * q) ^ int32(39779 * p) ^ int32(58699 * t)) & 8191
                             for q, p, t in zip(tokens, tokens[1:], tokens[2:])]
    weight, signs = table.table.weight.detach(), table.signs
    expected = torch.stack([weight[a] * signs[b] + weight[c] * signs[d]
                            for a, b, c, d in zip(pair_rows, pair_signs, triple_rows, triple_signs)])
    with torch.no_grad():
        got = table(torch.tensor(tokens))[0]
    assert torch.equal(got, expected)
    assert len(set(triple_signs[2:])) > 1 and min(triple_rows) >= half  # (signs differ; triples in the second half)
    assert not torch.equal(got, weight[pair_rows] * signs[pair_signs])  # (the triples count)


def prefix_tokens_by_sorting(ranks, vocab_size):
    """Each token's longest proper prefix that is a token, another way: in sorted byte order every token follows its
    prefixes, so a stack of the tokens the current one extends holds its longest prefix on top."""
    table, stack = [-1] * vocab_size, []
    for word, token in sorted(ranks.items()):
        while stack and not word.startswith(stack[-1][0]):
            stack.pop()
        table[token] = stack[-1][1] if stack else -1
        stack.append((word, token))
    return table


def test_each_tokens_prefix_token_is_the_longest_proper_prefix_that_is_a_token(gpt2_ranks):
    encoding = train_gpt.gpt2_encoding()
    table = train_gpt.prefix_tokens(50304)
    assert table.tolist() == prefix_tokens_by_sorting(encoding._mergeable_ranks, 50304)
    # by hand: " the" (bytes " the") has " th"; a single byte has none; nor has the padding
    the, th = encoding.encode_single_token(b" the"), encoding.encode_single_token(b" th")
    assert table[the] == th and table[encoding.encode_single_token(b"a")] == -1 and (table[50257:] == -1).all()


def test_training_adds_the_later_tokens_and_the_prefix_tokens_losses_at_their_weights(gpt2_ranks):
    """#53's multi-token prediction and #88's prefix-token loss on the same logits: sum_k w_k CE(z_t, y_(t+k)) over
    the positions with a (t+k)th target, plus w_p CE(z_t, prefix(y_t)) where the next token has a prefix, in float64
    from the logits; evaluation scores the next token alone."""
    args = train_gpt.parse_args(["--preset", "tiny", "--prefix_loss", "true"], cuda=False)
    _, model = tiny_model_with_every_weight_nonzero()
    model.prefix_of = train_gpt.prefix_tokens(model.lm_head.weight.size(0))
    model.loss_weights = torch.tensor([1.0, 0.5, 0.25, 0.3])
    tokens = torch.randint(0, args.vocab_size, (train_gpt.context_length(args) + 1,),
                           generator=torch.Generator().manual_seed(5))
    inputs, targets = tokens[:-1], tokens[1:]
    window = train_gpt.window_tensor((128, 128), torch.device("cpu"))
    with torch.no_grad():
        log_p = model(inputs, None, window).double().log_softmax(-1)
        loss = model(inputs, targets, window)
        model.eval()
        val_loss = model(inputs, targets, window)
    n, prefix = len(targets), model.prefix_of[targets]
    expected = sum(-w * log_p[t, targets[t + k]] for k, w in enumerate((1.0, 0.5, 0.25)) for t in range(n - k))
    expected += sum(-0.3 * log_p[t, prefix[t]] for t in range(n) if prefix[t] >= 0)
    next_token = -log_p[torch.arange(n), targets].mean()
    assert 0 < (prefix >= 0).sum() < n  # (some next tokens have a prefix token, some have none)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert val_loss.item() == pytest.approx(next_token.item(), rel=1e-5)
    assert abs(loss.item() / n - next_token.item()) > 0.1  # (the added losses show)


def test_the_loss_weights_follow_record_89s_stages():
    """By hand, for 1770 steps of which the last 15 are the extension (thirds of 1755 ending at 585, 1170): [next,
    2nd, 3rd, prefix] from [1, 0.5, 0.25, 0.25] down to [1, 0.5, 0, 0.25] over the first third, to [1, 0, 0, 0] over
    the second, then [1, 0, 0, 0] through the third and the extension."""
    args = train_gpt.parse_args(["--preset", "record89", "--num_iterations", "1770"], cuda=False)
    expected = {0: [1, 0.5, 0.25, 0.25], 117: [1, 0.5, 0.2, 0.25], 585: [1, 0.5, 0, 0.25], 702: [1, 0.4, 0, 0.2],
                1170: [1, 0, 0, 0], 1769: [1, 0, 0, 0]}
    for step, weights in expected.items():
        assert train_gpt.loss_weights(step, args) == pytest.approx(weights, abs=1e-12), step
    no_mtp = train_gpt.parse_args(["--preset", "record89", "--num_iterations", "1770", "--mtp", "false"], cuda=False)
    assert train_gpt.loss_weights(702, no_mtp) == pytest.approx([1, 0.2])


@pytest.mark.parametrize("tokens", [40, 4])  # (4: fewer positions than the window)
def test_the_copy_pointer_mixes_each_next_token_probability_by_its_formula(tokens):
    """#379's kind: p(y_t) = a_sentinel p_head(y_t) + sum of a_s over the window's earlier positions s of t's
    document where y_s = y_t, with a = softmax over [sentinel(x_t) + start, q_t . k_s / sqrt(d)]; in float64,
    a position at a time."""
    torch.manual_seed(0)
    window, dim, key_dim = 6, 16, 8
    pointer = train_gpt.CopyPointer(dim, key_dim, window).double()
    with torch.no_grad():
        pointer.sentinel.weight.normal_()
    x = torch.randn(tokens, dim, dtype=torch.float64)
    inputs = torch.randint(0, 5, (tokens,))  # (few kinds of token: many copies)
    inputs[[0, tokens // 2]] = train_gpt.EOT_TOKEN
    targets = torch.cat([inputs[1:], torch.tensor([3])])
    head_log_probs = torch.randn(tokens, dtype=torch.float64).clamp_max(0) - 2
    mixed = pointer(x, inputs, targets, head_log_probs)
    q, k = x @ pointer.query.weight.T, x @ pointer.key.weight.T
    documents = torch.cumsum(inputs == train_gpt.EOT_TOKEN, 0)
    for t in range(tokens):
        earlier = [s for s in range(max(t - window, 0), t) if documents[s] == documents[t]]
        sentinel = (pointer.sentinel.weight @ x[t]).item() + pointer.SENTINEL_START
        shares = torch.tensor([sentinel] + [(q[t] @ k[s]).item() / key_dim ** 0.5 for s in earlier],
                              dtype=torch.float64).softmax(0)
        p = shares[0] * head_log_probs[t].exp() + sum(shares[1 + i] for i, s in enumerate(earlier)
                                                      if targets[s] == targets[t])
        assert mixed[t].item() == pytest.approx(math.log(p), rel=1e-12, abs=1e-12), t
    copied = mixed - head_log_probs
    assert (copied < 0).any() and copied.max() > (0.5 if tokens > window else 0)  # (copies raise some tokens'
    # probability, the sentinel's share lowers the others')
