"""Record #89's trained weights in this file's model, and the forward of both on the same batches.

    python tests/head_weights.py                # head_cpu's seed-0 run: its step-5 state, step 6's batches (+ step 1)
    python tests/head_weights.py --out DIR      # keep head_cpu's states and losses in DIR (reused when present)

../shared/head_cpu/ runs #89's own trainer on a CPU at a tiny size. This module maps its parameter banks onto this
file's parameters (port_state_from_head), gives this file's flags for its configuration (port_hyperparameters), and
computes this file's plain next-token loss on the micro-batches #89's stream loader feeds a step
(port_forward_losses), which main() prints against the `ntp_loss` head_cpu recorded for that step (the same
forward's next-token cross-entropy, from the weights before that step's update). It then runs #89's forward itself
with every bf16 and FP8 rounding taken out (head_forward_fp32) against this file's in fp32, per token and sublayer by
sublayer (compare_fp32). Imported by benchmark_vs_head.py; no tests here.

What the comparisons show (head_cpu's seed 0): against head_cpu's recorded losses (bf16, FP8 head and MLP), this
file's next-token loss with its FP8 head is within 2.6e-4 (relative) at steps 1, 6, 20 and 21 (per token the two
differ by ~0.03 rms: #89's bf16 and FP8 roundings, which average out). In fp32 both forwards agree to fp32's rounding
at steps 6 and 21: per-token losses within 4e-6, every norm() input within 1.2e-6 (q and k compared normed: #89's
are sa_lambda0 times this file's).

How #89's tensors become this file's (H heads of D dims, width W = H x D, L = 11 layers; a = the attention layer's
index among those with attention, i - (i > 6)). Heads keep #89's order: in a paired layer, #89's view of q and k as
(T, H/2, 2D) for its rotary and back as (2T, H/2, D) puts head h at place 2t + h // (H/2) as head h mod H/2, rotated at
2t + h mod 2, as this file does.

#89's tensor -> this file's: how
- embed.weight (V', W) -> embed.weight: as is (V' = the vocabulary padded to 128; while tied, #89 keeps it = lm_head.T)
- lm_head.weight (W, V'; CastedLinearT holds in x out) -> lm_head.weight (V', W): transposed
- value_embeds (5 V', W) -> value_embeds.{1,2,8,9,10}.weight (V, W): the k-th table's first V rows
- bigram_embed.weight, buffer bigram_sign_table -> ngram.table.weight, buffer ngram.signs: as is (the signs are
  non-persistent here: load_head_weights copies them)
- smear_gate.weight; scalars[2L]; scalars[2L + 1] -> smear.gate.weight; smear.scale; blocks.6.skip_gate: as is
- qk_bank[6a:6a+6] (rows: q heads, then k heads) -> blocks.i.attn.qk.weight (2, W, W): as is (#89's sa_lambda0 on q
  and k is undone by the QK-norm), each head's rows permuted for the rotary (rotary_permutation)
- vo_bank[2a]; scalars[2i] -> blocks.i.attn.v.weight; attn.value_scale: as is
- vo_bank[2a + 1]; scalars[2i + 1] -> blocks.i.attn.c_proj.weight; attn.proj_scale: as is
- mlp_bank[i, 0]; mlp_bank[i, 1] (4W, W) -> blocks.i.mlp.c_fc.weight; blocks.i.mlp.c_proj.weight (W, 4W): as is;
  transposed
- resid_lambdas[i], post_lambdas[i] ([:, 0] attention, [:, 1] MLP) -> blocks.i.attn_scales.residual, .output,
  blocks.i.mlp_scales.residual, .output
- ve_gate_bank[0..3] -> blocks.{1,2,8,9}.value_gate.weight: as is
- mudd_gate_w1[g], mudd_gate_w2[g], mudd_gate_b2[g], _mudd_gate_scale (g = 0: pre, 1: post) ->
  gate_networks.{0,4}.hidden.weight, .out.weight, .bias, and the first's .scale: the out rows and bias in this
  file's order (GATE_LAYOUT)
- mudd_w1[m], mudd_w2[m], mudd_b2[m] (m = 0: layer 10, 1: post-loop) -> dense_networks.{10,head}.hidden.weight,
  .out.weight, .bias: rows in this file's order (DENSE_LAYOUT)

What #89 holds that this file has no place for, and why nothing is lost (UNUSED_BY_HEAD_FORWARD): the attention-free
layer 6's sa_lambdas and attention resid/post lambdas, the dense layer 10's resid/post lambdas (per-token MUDD
coefficients there) and its ve_gate_bank[4] (MUDD's lanes gate its value embedding), mlp_bank[11] (padding to 12
layers), the value tables' rows past the vocabulary, mudd_gate_w2/b2[0] rows 26-40 (the pre gate uses 26 of 41),
mudd_w2/b2[1] rows 5-13 (the post-loop uses 5 of 14), and the buffers of #89's FP8 MLP (this file has none) and its
rotary tables and prefix table (built here). #89's one _mudd_gate_scale is both gate networks' scale, as this file's
`gate_networks.0.scale` is (the first network's, handed to the second).
"""
import argparse
import glob
import json
import math
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import train_gpt  # noqa: E402
from tool_inputs import need, need_at_least, need_out_folder, open_own, run_tool  # noqa: E402

HEAD_CPU = REPO_ROOT.parent / "shared" / "head_cpu"
GPT2_RANKS = REPO_ROOT / "data" / ".cache" / "gpt2.tiktoken"

# #89's hard-wired shape and schedule (head_cpu keeps these and scales the rest)
HEAD_STEPS, HEAD_SCHEDULED = 1285, 1270
HEAD_WINDOW_BLOCKS = ((1, 3), (3, 7), (5, 11), (6, 13))  # short, long per stage, in head_cpu's --block_size blocks
HEAD_FINAL_WINDOW_BLOCKS = 20
PAD_LAYER = 6  # #89's layer without attention (its banks skip it)
VALUE_EMBED_LAYERS = (1, 2, 8, 9, 10)  # the layer each of #89's five value tables feeds, in table order

# #89's gate networks' outputs (unpack_pre_mudd_gate / unpack_post_mudd_gate): (layer, coefficient) -> first
# index, width; by this file's names (output_gate = #89's attn gate, dc_mix / dc_weight = its DC w1 / w2)
GATE_LAYOUT = {
    "0": {(1, "xsa"): (0, 6), (3, "xsa"): (6, 6), (3, "output_gate"): (12, 6),
          **{(l, name): (18 + 2 * j + k, 1) for j, l in enumerate((0, 1, 2, 3))
             for k, name in enumerate(("x0", "ngram"))}},
    "4": {(4, "xsa"): (0, 6), (7, "xsa"): (6, 6), (10, "output_gate"): (12, 6),
          **{(l, name): (18 + 2 * j + k, 1) for j, l in enumerate((4, 5, 7, 8, 9))
             for k, name in enumerate(("x0", "ngram"))},
          (6, "skip"): (28, 1), (10, "dc_mix"): (29, 6), (10, "dc_weight"): (35, 6)},
}
# #89's MUDD coefficients (init_mudd's docstring): mudd block 0 -> the last layer, 1 -> the post-loop (head), whose
# five take in cache[0] (the first layer's input), cache[7] (the attended output), cache[9] (the output before the
# last layer), the first value embedding and cache[3] (the skip's source)
DENSE_LAYOUT = {
    "10": {(10, "dense_value"): (0, 3), (10, "dense"): (3, 3), (10, "value_gate"): (6, 2),
           (10, "attn_scales"): (8, 2), (10, "x0"): (10, 1), (10, "ngram"): (11, 1), (10, "mlp_scales"): (12, 2)},
    "head": {("head", name): (j, 1) for j, name in enumerate(("first_input", "attended", "penultimate",
                                                               "value_embed", "skip"))},
}
UNUSED_BY_HEAD_FORWARD = [
    "scalars[12:14] (layer 6's sa_lambdas)", "resid_lambdas[6, 0], post_lambdas[6, 0] (layer 6: no attention)",
    "resid_lambdas[10], post_lambdas[10] (MUDD's per-token coefficients instead)",
    "ve_gate_bank[4] (layer 10's value gate: MUDD's lanes)", "mlp_bank[11] (padding)",
    "value_embeds rows past the vocabulary in each table", "mudd_gate_w2[0, 26:], mudd_gate_b2[0, 26:]",
    "mudd_w2[1, 5:], mudd_b2[1, 5:]", "buffers _mlp_down_* (FP8 MLP scales), prefix_table, yarn tables",
]


# ----------------------------------------------------------------------------------------------------
# flags


def _window_blocks(blocks: int, block_size: int) -> str:
    """head_cpu's blocks of block_size tokens as this file's 128-token blocks (exact: a binary fraction)."""
    return repr(blocks * block_size / train_gpt.ATTENTION_BLOCK_SIZE)


def scheduled_steps(steps: int) -> int:
    """Of `steps` steps, those #89's schedule spends in its three stages (the rest: the extension), as head_cpu
    compresses its 1270 + 15."""
    return max(3, round(steps * HEAD_SCHEDULED / HEAD_STEPS))


def port_hyperparameters(head_config: dict) -> train_gpt.Hyperparameters:
    """This file's flags for head_cpu's configuration (its run_head_cpu.py flags, as a state's or a dump's
    "config"): #89's model (the record89 preset) at head_cpu's width, bigram table, batches, windows and step count;
    the Shakespeare shards read as one stream (head_cpu's default loader)."""
    c = head_config
    if c.get("loader", "stream") != "stream":
        raise ValueError("only head_cpu's stream loader (--loader stream) reads the shards as this file's "
                         "doc_max_tokens 0 does; its aligned loader is #89's training loader, not ported here")
    head_dim, block, steps = int(c.get("head_dim", 16)), int(c.get("block_size", 16)), int(c.get("steps", 60))
    scheduled = scheduled_steps(steps)
    growth = [int(g) for g in str(c.get("batch_growth", "1,2,3")).split(",")]
    seq_len = int(c.get("seq_len", 128))
    scale = steps / HEAD_STEPS
    windows = ",".join(f"{_window_blocks(s, block)}:{_window_blocks(l, block)}" for s, l in HEAD_WINDOW_BLOCKS)
    flags = dict(
        preset="record89", head_dim=head_dim, model_dim=6 * head_dim, ngram_rows=int(c.get("bigram_vocab", 16384)),
        window_blocks=windows, final_window_blocks=_window_blocks(HEAD_FINAL_WINDOW_BLOCKS, block),
        train_seq_len=",".join(str(seq_len * g) for g in growth + growth[-1:]), doc_max_tokens="0",
        seqs_per_step=8, num_iterations=steps, extension_steps=steps - scheduled,
        muon_momentum_warmup_steps=max(1, round(300 * scale)), muon_momentum_cooldown_steps=max(1, round(50 * scale)),
        fp8_head=c.get("fp8", "emulate") != "off",
        train_files=c.get("train_files", "data/shakespeare/shakespeare_train_*.bin"),
        val_files=c.get("val_files", "data/shakespeare/shakespeare_val_*.bin"),
        val_seq_len=int(c.get("val_seq_len", 512)), val_tokens=int(c.get("val_tokens", 4096)),
        val_loss_every=int(c.get("val_every", 0)), seed=int(c.get("seed", 0)), compile=False, warmup_steps=0,
        canonical_mask=False)  # (#89 validates without #91's mask)
    return train_gpt.parse_args([f"--{k}={v}" for k, v in flags.items()], cuda=False)


# ----------------------------------------------------------------------------------------------------
# weights


def rotary_permutation(head_dim: int) -> Tensor:
    """Row p of one head's q or k here = row perm[p] of #89's. #89 rotates dims (2i, 2i + 1) at frequency i
    (i < D/4) and leaves [D/2, D) unrotated; this file rotates (d, d + D/2) at frequency d (d < D/4) and leaves
    [D/4, D/2) and [3D/4, D) unrotated. Both rotate a pair (x, y) to (x cos + y sin, y cos - x sin)."""
    q = head_dim // 4
    pairs = torch.arange(q)
    return torch.cat([2 * pairs, 2 * q + pairs, 2 * pairs + 1, 3 * q + pairs])


def _network_rows(widths: dict, layout: dict) -> list[int]:
    """#89's output rows in the order a gate network of this file emits its coefficients."""
    rows = []
    for layer, coefficients in widths.items():
        for name, width in coefficients.items():
            start, head_width = layout[(layer, name)]
            assert head_width == width, (layer, name, width, head_width)
            rows += range(start, start + width)
    return rows


def port_state_from_head(head_weights: dict[str, Tensor], model: train_gpt.GPT) -> dict[str, Tensor]:
    """#89's tensors (a head_cpu state's "model": its bf16 weights, or fp32 masters) by this file's names: every
    entry of model.state_dict(), plus the non-persistent ngram.signs (load_head_weights copies it). fp32."""
    h = {name: t.float() for name, t in head_weights.items()}
    blocks = model.blocks
    num_layers, width = len(blocks), model.embed.weight.shape[1]
    head_dim = next(b.attn for b in blocks if b.attn is not None).qk_dim
    num_heads = width // head_dim
    vocab, padded = model.value_embeds["1"].weight.shape[0], h["embed.weight"].shape[0]
    scalars = h["scalars"]
    out = {
        "embed.weight": h["embed.weight"],
        "lm_head.weight": h["lm_head.weight"].T,
        "smear.scale": scalars[2 * num_layers],
        "smear.gate.weight": h["smear_gate.weight"],
        "ngram.table.weight": h["bigram_embed.weight"],
        "ngram.signs": h["bigram_sign_table"],
        f"blocks.{PAD_LAYER}.skip_gate": scalars[2 * num_layers + 1],
    }
    tables = h["value_embeds"].view(len(VALUE_EMBED_LAYERS), padded, width)
    out.update({f"value_embeds.{layer}.weight": tables[k, :vocab] for k, layer in enumerate(VALUE_EMBED_LAYERS)})
    # value gates: #89's bank holds one per value-embedding layer; the dense layer's (the last) goes unused there
    gated = [layer for layer in VALUE_EMBED_LAYERS if blocks[layer].value_gate is not None]
    out.update({f"blocks.{layer}.value_gate.weight": h["ve_gate_bank"][k] for k, layer in enumerate(gated)})
    perm = rotary_permutation(head_dim)
    rows = (torch.arange(num_heads)[:, None] * head_dim + perm).flatten()  # the permutation within every head
    qk_per_layer = 2 * (num_heads // 2)  # #89's row groups (2 heads' q or k each) per attention layer
    for i, block in enumerate(blocks):
        p = f"blocks.{i}."
        out[p + "mlp.c_fc.weight"] = h["mlp_bank"][i, 0]
        out[p + "mlp.c_proj.weight"] = h["mlp_bank"][i, 1].T  # #89 multiplies relu(x W1^T)^2 @ W2, W2 (4W, W)
        if block.mlp_scales is not None:
            out[p + "mlp_scales.residual"], out[p + "mlp_scales.output"] = h["resid_lambdas"][i, 1], \
                h["post_lambdas"][i, 1]
        if block.attn is None:
            continue
        a = i - (i > PAD_LAYER)
        lambda_in, lambda_out = scalars[2 * i], scalars[2 * i + 1]
        qk = h["qk_bank"][qk_per_layer * a:qk_per_layer * (a + 1)].reshape(2, num_heads * head_dim, width)
        # #89 scales q, k and v by sa_lambda0; q and k are normed next, so they take #89's weights unscaled: the
        # same forward, and Muon's steps the same share of the weights (scaled, the port's would be 1 / sa_lambda0
        # times #89's); v takes the scale as value_scale
        out[p + "attn.qk.weight"] = qk[:, rows]
        out[p + "attn.v.weight"] = h["vo_bank"][2 * a]
        out[p + "attn.value_scale"] = lambda_in
        out[p + "attn.proj_scale"] = lambda_out
        out[p + "attn.c_proj.weight"] = h["vo_bank"][2 * a + 1]
        if block.attn_scales is not None:
            out[p + "attn_scales.residual"], out[p + "attn_scales.output"] = h["resid_lambdas"][i, 0], \
                h["post_lambdas"][i, 0]
    for g, (name, network) in enumerate(model.gate_networks.items()):
        rows_ = _network_rows(network.widths, GATE_LAYOUT[name])
        out.update({f"gate_networks.{name}.hidden.weight": h["mudd_gate_w1"][g],
                    f"gate_networks.{name}.out.weight": h["mudd_gate_w2"][g, rows_],
                    f"gate_networks.{name}.bias": h["mudd_gate_b2"][g, rows_],
                    **({f"gate_networks.{name}.scale": h["_mudd_gate_scale"]} if g == 0 else {})})  # (one, shared)
    for m, (name, network) in enumerate(model.dense_networks.items()):
        rows_ = _network_rows(network.widths, DENSE_LAYOUT[name])
        out.update({f"dense_networks.{name}.hidden.weight": h["mudd_w1"][m],
                    f"dense_networks.{name}.out.weight": h["mudd_w2"][m, rows_],
                    f"dense_networks.{name}.bias": h["mudd_b2"][m, rows_]})
    return {name: t.contiguous().clone() for name, t in out.items()}


NON_PERSISTENT = ("ngram.signs",)  # buffers a state_dict leaves out, which #89's forward has its own of


def load_head_weights(model: train_gpt.GPT, head_weights: dict[str, Tensor]) -> None:
    """#89's tensors into the model (strict: every entry of its state_dict), and #89's bigram signs."""
    state = port_state_from_head(head_weights, model)
    buffers = {name: state.pop(name) for name in NON_PERSISTENT if name in state}
    like = model.state_dict()
    model.load_state_dict({name: t.to(like[name].dtype) for name, t in state.items()}, strict=True)
    with torch.no_grad():
        for name, t in buffers.items():
            model.get_buffer(name).copy_(t)


def port_names(head_weights: dict[str, Tensor], like: dict[str, Tensor]) -> dict[str, Tensor]:
    """#89's tensors by this file's parameter names, those in `like` (e.g. named_parameters of a model built from
    port_hyperparameters)."""
    args = port_hyperparameters(dict(head_dim=head_weights["qk_bank"].shape[1] // 2,
                                     bigram_vocab=head_weights["bigram_embed.weight"].shape[0]))
    model = train_gpt.build_model(args, torch.device("meta"))  # (its structure only)
    state = port_state_from_head(head_weights, model)
    return {name: state[name] for name in like}


# ----------------------------------------------------------------------------------------------------
# batches and the forward


def head_batches(head_config: dict, step: int) -> list[tuple[Tensor, Tensor]]:
    """The (inputs, targets) micro-batches of head_cpu's step `step` (from 1), as #89's distributed_data_generator
    (align_to_bos False, world size 1, 8 micro-batches a step; head_cpu cycles the shards) yields them: each reads the
    next n + 1 tokens of the stream (n: the stage's micro-batch size) and moves on n, opening the next shard where
    fewer than n + 2 are left; a new stage's size applies from its first step's first micro-batch."""
    args = port_hyperparameters(head_config)
    files = sorted(glob.glob(args.train_files))
    shard, tokens, pos = 0, train_gpt.load_data_shard(files[0]), 0
    for s in range(step):
        n = train_gpt.batch_shape(s, args)[0]  # = head_cpu's seq_len x the stage's growth
        batches = []
        for _ in range(8):
            if pos + n + 1 >= len(tokens):
                shard, pos = shard + 1, 0
                tokens = train_gpt.load_data_shard(files[shard % len(files)])
            buf = tokens[pos:pos + n + 1]
            batches.append((buf[:-1].to(torch.int32), buf[1:].to(torch.int64)))
            pos += n
    return batches


def port_batches(args: train_gpt.Hyperparameters, step: int) -> list[tuple[Tensor, Tensor]]:
    """The micro-batches this file's own loader gives step `step` (from 1), the stage's shape set each step as
    forward_backward does."""
    loader = train_gpt.DistributedDataLoader(args.train_files, train_gpt.stage_seq_lens(args)[0], args.seqs_per_step,
                                             0, 1, torch.device("cpu"))
    for s in range(step):
        loader.set_shape(*train_gpt.batch_shape(s, args))
        batches = [next(loader) for _ in range(args.seqs_per_step)]
    return batches


def port_logits(model: train_gpt.GPT, args: train_gpt.Hyperparameters, inputs: Tensor, step: int) -> Tensor:
    """This file's training-forward logits (soft-capped, fp32) for one micro-batch of step `step` (from 1)."""
    model.train()
    model.stretch_rotary(train_gpt.windows_so_far(step - 1, args))
    return model(inputs, None, train_gpt.window_tensor(train_gpt.window_tokens(step - 1, args),
                                                      torch.device("cpu"))).float()


@torch.no_grad()
def port_forward_losses(model: train_gpt.GPT, head_config: dict, step: int) -> list[float]:
    """This file's plain next-token cross-entropy (mean per token) on each micro-batch of head_cpu's step `step`
    (from 1): the training forward (its FP8 head where the model has one: what #89's ntp_loss comes from), with the
    windows and YaRN stretch that forward_backward sets for step - 1; its soft-capped logits (the forward without
    targets) scored here, since with targets training returns #89's weighted sum of losses."""
    args = port_hyperparameters(head_config)
    return [F.cross_entropy(port_logits(model, args, inputs, step), targets).item()
            for inputs, targets in head_batches(head_config, step)]


# ----------------------------------------------------------------------------------------------------
# the comparison


def head_cpu_command(steps: int, flags: list[str], log_dir: Path) -> list[str]:
    """head_cpu's trainer at its tiny configuration from seed 0 (one thread), #89's schedules scaled to `steps`."""
    return [sys.executable, str(HEAD_CPU / "run_head_cpu.py"), "--steps", str(steps), "--seed", "0", *flags,
            "--gpt2_ranks", str(GPT2_RANKS), "--log_dir", str(log_dir)]


def run_head(out: Path, name: str, flags: list[str], steps: int) -> None:
    """head_cpu with `flags`, its output to out/name.log, unless out/name.json exists."""
    if (out / f"{name}.json").exists():
        return
    cmd = head_cpu_command(steps, [*flags, "--dump_losses", str(out / f"{name}.json")], out)
    print("running", " ".join(cmd[1:]), flush=True)
    with open_own(out / f"{name}.log") as log:
        if subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"head_cpu failed: {out / f'{name}.log'}")


def load_tensors(path: Path) -> dict:
    """A file of tensors in plain containers (head_cpu's states, this module's fp32 forward), loaded with torch's
    weights_only unpickler: a file holding anything else (a crafted pickle runs code when unpickled in full) is
    refused by name."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise train_gpt.UserError(f"{path} is not a file of tensors in plain containers ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:200]}): delete it, or give another --out") from None
    if not isinstance(state, dict):
        raise train_gpt.UserError(f"{path} holds a {type(state).__name__}, not a dict of tensors: delete it, or give "
                                  "another --out")
    return state


def fp32_masters(state: dict) -> dict[str, Tensor]:
    """A head_cpu state's weights with NorMuon's banks as fp32 masters (bf16 high half + the 16-bit mantissa)."""
    masters = dict(state["model"])
    for name, st in state["optimizer"].items():
        if "mantissa" in st:
            high = masters[name].view(torch.int16).to(torch.int32) << 16
            low = st["mantissa"].view(masters[name].shape).to(torch.int32) & 0xFFFF
            masters[name] = (high | low).view(torch.float32)
    return masters


def compare(state_path: Path, losses_path: Path) -> None:
    """This file's next-token loss on the batches of the step after a head_cpu state, against the one head_cpu
    recorded for that step: #89's bf16 weights (what its forward reads) or the fp32 masters, this file's FP8 head or
    not."""
    state = load_tensors(state_path)
    config, step, h = state["config"], state["step"] + 1, state["model"]
    recorded = json.loads(losses_path.read_text())["steps"][step - 1]
    assert recorded["step"] == step
    tie = (h["embed.weight"].float() - h["lm_head.weight"].float().T).abs().max().item()
    args = port_hyperparameters(config)
    same = all(torch.equal(a, c) and torch.equal(b, d)
               for (a, b), (c, d) in zip(head_batches(config, step), port_batches(args, step)))
    print(f"\n#89 (head_cpu --fp8 {config['fp8']}) after step {step - 1}, step {step}'s batches: recorded ntp_loss "
          f"{recorded['ntp_loss']:.6f}; tied {not state['split_embed']}, max |embed - lm_head.T| {tie:.3g}; this "
          f"file's loader gives the same micro-batches: {same}")
    for fp8_head, weights, label in ((True, h, "bf16 weights"), (True, fp32_masters(state), "fp32 masters"),
                                     (False, h, "bf16 weights")):
        args.fp8_head = fp8_head
        model = train_gpt.build_model(args, torch.device("cpu"))
        load_head_weights(model, weights)
        losses = port_forward_losses(model, config, step)
        ours, theirs = sum(losses) / len(losses), recorded["ntp_loss"]
        print(f"  port, fp8_head {str(fp8_head):5s}, {label}: ntp_loss {ours:.6f}  rel diff "
              f"{(ours - theirs) / theirs:+.2e}", flush=True)


# ----------------------------------------------------------------------------------------------------
# #89's forward without bf16 and FP8 roundings, against this file's in fp32: equal up to fp32's rounding


def head_forward_fp32(state_path: str, step: int, out_path: str) -> None:
    """(In a process of its own: run_head_cpu patches torch.compile and the working directory.) #89's own forward
    (head_cpu's train_gpt.py) from a state, on step `step`'s micro-batches from its own loader, with every rounding
    to bf16 or FP8 taken out: the model in fp32, fp32 rotary tables, and fp32 stand-ins for the kernels that round
    (the ReLU^2 MLP, the head's soft-capped cross-entropy, the DC-MHA correction). Saves the per-token next-token
    loss and, for the first micro-batch, every input of norm() in call order (the residual stream before each
    sublayer, q and k before the QK-norm)."""
    sys.path.insert(0, str(HEAD_CPU))
    import run_head_cpu
    saved = {}

    def fp32_rotary(yarn):  # #89's Yarn tables, from its (fp32) frequencies without the bf16 rounding
        t = torch.arange(2 * yarn.max_seq_len, dtype=torch.float32)
        places = (2 * t, 2 * t + 1) if yarn.paired else (t,)
        angles = torch.cat([torch.outer(p, yarn.angular_freq.float()) for p in places], dim=-1)
        sin = angles.sin()
        sin[..., 1::2] *= -1
        yarn.factor1, yarn.factor2 = angles.cos(), sin

    def mlp(x, w_up, w_down, *_fp8_args):
        return F.relu(x @ w_up.T).square() @ w_down

    def dc_correction(y, q, k, v, dc_weights, _lse, scaling, window, seq_lens, **_):
        mix, weight = (w[0].float() for w in dc_weights)
        T = q.size(1)
        doc = torch.searchsorted(seq_lens.long(), torch.arange(T), right=True)
        gap = torch.arange(T)[:, None] - torch.arange(T)
        seen = (gap >= 0) & (gap < window) & (doc[:, None] == doc)
        probs = (torch.einsum("thd,shd->hts", q[0], k[0]) * scaling).masked_fill(~seen, -math.inf).softmax(-1)
        mixed = torch.einsum("th,hts->ts", mix, probs)
        return y + torch.einsum("th,ts,shd->thd", weight, mixed, v[0]).view_as(y)

    class NextTokenLoss:  # in place of the fused soft-capped CE: the plain next-token CE of the fp32 logits
        @staticmethod
        def apply(x, targets, _mtp, _prefix, _prefix_weight, lm_head_weight, *_):
            logits = 23 * torch.sigmoid((x.float() @ lm_head_weight.float() + 5) / 7.5)
            loss = F.cross_entropy(logits, targets, reduction="none")
            saved.setdefault("per_token", []).append(loss.double())
            return loss

    def before_training(harness, model, manager):
        load(harness, model, manager)  # (--load_state)
        g = model.forward.__globals__  # train_gpt.py's namespace
        g.update(ReLUSqrdMLP=mlp, dc_attention_postonly_nodd_correction_add_base_triton=dc_correction,
                 FusedSoftcappedCrossEntropy=NextTokenLoss)
        model.float()
        loader = g["distributed_data_generator"](g["args"].train_files, g["TRAINING_STAGES"][0].batch_size,
                                                 g["TRAINING_STAGES"][0].train_max_seq_len, grad_accum_steps=8)
        for s in range(step):  # the schedule (windows, YaRN, batch size) and the batches, as the training loop
            manager.advance_schedule(s)
            batches = [next(loader) if s == i == 0 else loader.send(manager.train_loader_send_args)
                       for i in range(8)]
        fp32_rotary(model.yarn)
        fp32_rotary(model.yarn_paired_head)
        norm, norm_inputs = g["norm"], []
        model.train()
        with torch.no_grad():
            for i, (inputs, targets, cu_seqlens, bigram_inputs, _) in enumerate(batches):
                g["norm"] = (lambda x: norm_inputs.append(x.clone()) or norm(x)) if i == 0 else norm
                model(inputs, targets, cu_seqlens, bigram_inputs, manager.get_forward_args())
        g["norm"] = norm
        saved.update(per_token=torch.cat(saved["per_token"]), norm_inputs=norm_inputs,
                     inputs=[batch[0] for batch in batches])
        raise run_head_cpu.StopRun()

    load, run_head_cpu.Harness.before_training = run_head_cpu.Harness.before_training, before_training
    run_head_cpu.main(["--fp8", "off", "--load_state", state_path, "--gpt2_ranks", str(GPT2_RANKS),
                       "--log_dir", str(Path(out_path).parent)])
    with open_own(out_path, "wb") as f:
        torch.save(saved, f)


@torch.no_grad()
def compare_fp32(state_path: Path, out: Path) -> None:
    """#89's forward in fp32 (head_forward_fp32) against this file's (fp32, no FP8 head, #89's bf16 cast of its
    residual and output scales), per token and sublayer by sublayer."""
    state = load_tensors(state_path)
    config, step = state["config"], state["step"] + 1
    theirs_path = out / f"head_fp32_step{step}.pt"
    if not theirs_path.exists():
        subprocess.run([sys.executable, __file__, "--head_fp32", str(state_path), str(step), str(theirs_path)],
                       cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    theirs = load_tensors(theirs_path)
    args = port_hyperparameters(config)
    args.fp8_head = False
    model = train_gpt.build_model(args, torch.device("cpu"))
    load_head_weights(model, state["model"])
    for name, p in model.named_parameters():
        if "_scales." in name:  # #89's forward reads resid_ and post_lambdas as bf16
            p.copy_(p.bfloat16())
    head_dim = args.head_dim
    perm = rotary_permutation(head_dim)
    norm, norm_inputs = train_gpt.norm, []
    losses = []
    for i, ((inputs, targets), theirs_inputs) in enumerate(zip(head_batches(config, step), theirs["inputs"])):
        assert torch.equal(inputs, theirs_inputs)
        train_gpt.norm = (lambda x: norm_inputs.append(x.clone()) or norm(x)) if i == 0 else norm
        try:
            logits = port_logits(model, args, inputs, step)
        finally:
            train_gpt.norm = norm
        losses.append(F.cross_entropy(logits, targets, reduction="none").double())
    diff = torch.cat(losses) - theirs["per_token"]
    worst = []
    for ours_x, theirs_x in zip(norm_inputs, theirs["norm_inputs"], strict=True):
        if theirs_x.dim() == 4:  # q or k (B, T, H, D): #89's dims in this file's rotary order, both normed (#89's
            # are sa_lambda0 times this file's, which takes #89's q and k weights without it: the QK-norm removes it)
            ours_x, theirs_x = F.rms_norm(ours_x, (head_dim,)), F.rms_norm(theirs_x[..., perm], (head_dim,))
        worst.append(((ours_x - theirs_x).norm() / theirs_x.norm()).item())
    print(f"\n#89's forward in fp32 against this file's, after step {step - 1} on step {step}'s batches: per-token "
          f"next-token loss: max |port - #89| {diff.abs().max():.2e}, mean {diff.mean():+.2e}; the {len(worst)} "
          f"norm() inputs of micro-batch 0: largest ||port - #89|| / ||#89|| {max(worst):.2e} (the "
          f"{worst.index(max(worst)) + 1}th)")


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["--head_fp32"]:  # (the child process of compare_fp32)
        torch.set_num_threads(1)
        return head_forward_fp32(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="folder for head_cpu's states and losses (reused when present)")
    parser.add_argument("--steps", type=int, default=60, help="head_cpu's --steps (the schedules' length)")
    parser.add_argument("--step", type=int, default=6, help="compare on this step's batches, from the state before")
    parser.add_argument("--no_step1", action="store_true", help="skip the step-1 comparison (initial weights)")
    parser.add_argument("--no_fp32", action="store_true", help="skip #89's fp32 forward against this file's")
    a = parser.parse_args(argv)
    need_at_least("--steps", a.steps, 2, "head_cpu's schedule, of which --step is one")
    need(1 <= a.step <= a.steps, f"--step {a.step}: give a step of head_cpu's run, 1 to --steps {a.steps} (its state "
         "before that step is compared)")
    if a.out:
        need_out_folder("--out", Path(a.out))
    if not (HEAD_CPU / "run_head_cpu.py").is_file():
        print(f"skipped: {HEAD_CPU} is missing (record #89's trainer on a CPU; it sits beside the repository in "
              "../shared)")
        return
    torch.set_num_threads(1)
    if not GPT2_RANKS.exists():
        subprocess.run([sys.executable, str(REPO_ROOT / "data" / "gpt2_tokenizer.py"), "--fetch"], check=True)
    out = Path(a.out or tempfile.mkdtemp(prefix="head_weights_"))
    out.mkdir(parents=True, exist_ok=True)
    for state_step in ([] if a.no_step1 else [0]) + [a.step - 1]:
        name = f"head_step{state_step + 1}"
        run_head(out, name, ["--stop_after", str(state_step + 1), "--save_step", str(state_step),
                             "--save_state", str(out / f"{name}.pt")], a.steps)
        compare(out / f"{name}.pt", out / f"{name}.json")
    if not a.no_fp32:
        compare_fp32(out / f"head_step{a.step}.pt", out)


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
