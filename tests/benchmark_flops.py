"""Benchmark (not a test) of the training FLOPs of the record presets' models: a step of record #89's configuration
(the record89 preset) against one of record #92's (the record preset: its model, sampled softmax and optimizer, on
#92's schedule),
counted by torch's FLOP counter on the meta device (seconds, no memory), and their ratio: the step cost that #92's
configuration should save on a GPU.

    python tests/benchmark_flops.py

A rank's step is the forward and backward of one sequence (#46's staged batch: a rank holds one a step), counted once
for each distinct (tokens, windows, sampled-softmax rows) of the run and multiplied by the steps that have it. The
counter counts matrix products only (element-wise ops, norms and softmaxes not, as MFU counts), and the tables
(token, value and n-gram embeddings) are lookups. Attention is added by hand: the counter would score every pair of
the sequence, where FlexAttention skips the blocks outside the sliding window. So while counting, `attention` is a
stand-in without a matrix product, and each attention layer adds 2 x pairs x (Dqk + Dv) FLOPs a head forward, three
times that forward and backward, where pairs are those the window allows on a sequence of T tokens (each query t the
keys t - w..t) ignoring documents: an upper bound, as document boundaries cut more. Paired heads attend over 2T places,
the window counted in places, with half the heads. Beside it, the pairs of FlexAttention's 128 x 128 blocks that the
window touches: what its kernels compute. The head multiplies in FP8 (--fp8_head): the same FLOPs, counted as bf16's.
"""
import argparse
import contextlib
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import train_gpt  # noqa: E402
from tool_inputs import run_tool  # noqa: E402

BLOCK = train_gpt.ATTENTION_BLOCK_SIZE


def window_pairs(places: int, window: int) -> int:
    """The (query, key) pairs of a sliding window over `places` positions, ignoring documents: query t sees the keys
    t - window..t, min(t, window) + 1 of them."""
    if window >= places - 1:
        return places * (places + 1) // 2
    return window * (window + 1) // 2 + (places - window) * (window + 1)


def block_pairs(places: int, window: int) -> int:
    """The pairs of the 128 x 128 blocks that a sliding window touches (FlexAttention's full and partial blocks,
    ignoring documents): query block i reaches back to the key block (window + 127) // 128 before it."""
    return BLOCK * BLOCK * window_pairs(places // BLOCK, (window + BLOCK - 1) // BLOCK)


def check_pairs_against_masks() -> None:
    """The two counts above against this file's own masks of one document (CPU, small)."""
    tokens = torch.zeros(1024, dtype=torch.int64)
    for windows in ((128, 384), (200, 700)):
        for places in (1, 2):
            for mask, window in zip(train_gpt.document_causal_masks(tokens, torch.tensor(windows), places), windows):
                found = (int(mask.dense().sum()), BLOCK * BLOCK * int(mask.full_num.sum() + mask.partial_num.sum()))
                counted = (window_pairs(len(tokens) * places, window), block_pairs(len(tokens) * places, window))
                if found != counted:
                    raise RuntimeError(f"window {window}, {places} place(s) a token: the masks allow {found} pairs "
                                       f"(exact, in blocks), this file counts {counted}")


def attention_flops(model: train_gpt.GPT, tokens: int, windows: tuple[int, int]) -> tuple[int, int]:
    """Forward and backward FLOPs of every attention layer's scores and weighted values for one sequence: of the
    pairs the windows allow, and of the blocks FlexAttention computes."""
    c, exact, blocks = model.config, 0, 0
    for block, layer in zip(model.blocks, c.layers):
        if block.attn is None:
            continue
        groups = block.attn.head_groups  # paired heads: 2T places, half the heads
        window, places, heads = windows["SL".index(layer.window)], groups * tokens, c.num_heads // groups
        per_pair = 3 * 2 * heads * (block.attn.qk_dim + block.attn.v_dim)  # QK^T and PV, backward twice forward
        exact += per_pair * window_pairs(places, window)
        blocks += per_pair * block_pairs(places, window)
    return exact, blocks


@contextlib.contextmanager
def attention_stand_in(calls: list):
    """train_gpt.attention as an output of its shape, (B, H, T, Dv), reading q, k and v without a matrix product;
    each call recorded."""
    real = train_gpt.attention

    def stand_in(q, k, v, mask, scale):
        calls.append(q.shape)
        return (q.sum(-1, keepdim=True) + k.sum(-1, keepdim=True)) * v
    train_gpt.attention = stand_in
    try:
        yield
    finally:
        train_gpt.attention = real


def count_step(model: train_gpt.GPT, args, step: int, tokens: int, windows: tuple[int, int], rows: int) -> dict:
    """FLOPs of one sequence's forward and backward: attention (by hand, exact and in blocks), the head (its input
    to the loss, counted on its own) and the rest of the model (counted whole, less the head)."""
    meta = torch.device("meta")
    seq = torch.zeros(tokens, dtype=torch.int64, device=meta)
    candidates = torch.arange(rows, device=meta) if rows else None
    if model.loss_weights is not None:  # as forward_backward sets them (a copy on meta writes nothing)
        model.loss_weights.copy_(torch.tensor(train_gpt.loss_weights(step, args)))
    calls = []
    with attention_stand_in(calls), FlopCounterMode(display=False) as whole:
        model(seq, seq, train_gpt.window_tensor(windows, meta), candidates=candidates).backward()
    attention_layers = sum(block.attn is not None for block in model.blocks)
    if len(calls) != attention_layers:
        raise RuntimeError(f"the attention stand-in ran {len(calls)} times for {attention_layers} attention layers: "
                           "GPT.forward no longer reaches train_gpt.attention, and this count would be wrong")
    # the head alone, from its input to the loss (the counter's module breakdown files its backward elsewhere)
    head_input = torch.zeros(tokens, args.model_dim, device=meta, requires_grad=True)
    targets = model.training_targets(seq) if model.loss_weights is not None else seq[:, None]
    with FlopCounterMode(display=False) as head:
        stats = model.lm_head(head_input, targets, candidates=candidates)
        train_gpt.summed_loss(stats.log_probs(), stats.found, model.loss_weights).backward()
    exact, blocks = attention_flops(model, tokens, windows)
    return dict(attention=exact, attention_blocks=blocks, head=head.get_total_flops(),
                rest=whole.get_total_flops() - head.get_total_flops())


def build(args) -> train_gpt.GPT:
    model = train_gpt.build_model(args, torch.device("meta"))
    model.train()
    # the counter does not know the FP8 matmul op; the head's bf16 twin has the same FLOPs
    model.lm_head.use_fp8 = False
    return model


def step_shapes(args) -> dict:
    """(tokens, windows, rows) -> the steps of the run's schedule that have it."""
    shapes = {}
    for step in range(args.num_iterations):
        key = (train_gpt.batch_shape(step, args)[0], train_gpt.window_tokens(step, args),
               train_gpt.candidate_count(step, args))
        shapes.setdefault(key, []).append(step)
    return shapes


def matrix_weights(model: train_gpt.GPT, head_rows: int) -> int:
    """The weights in matrix products: every linear map's (the head: the rows it scores), no table's."""
    linears = [m for m in model.modules() if isinstance(m, (train_gpt.CastedLinear, train_gpt.Gate))]
    return sum(m.weight.numel() for m in linears if m is not model.lm_head) + head_rows * model.lm_head.weight.size(1)


def report(name: str, model: train_gpt.GPT, args, shapes: dict) -> dict:
    """Print the configuration's shapes and totals; its run's FLOPs a rank by kind."""
    vocab_rows = model.lm_head.weight.size(0)
    steps = sum(len(s) for s in shapes.values())
    print(f"{name}: {steps} steps")
    print(f"  {'steps':>15s} {'tokens':>7s} {'windows':>10s} {'head rows':>9s}   {'GFLOPs a sequence:':<18s} "
          f"{'attention':>9s} {'(blocks)':>9s} {'head':>8s} {'rest':>8s} {'total':>8s}")
    run, check = dict(attention=0, attention_blocks=0, head=0, rest=0), None
    for (tokens, windows, rows), on in shapes.items():
        flops = count_step(model, args, on[0], tokens, windows, rows)
        for kind in run:
            run[kind] += len(on) * flops[kind]
        total = flops["attention"] + flops["head"] + flops["rest"]
        span = f"{on[0]}-{on[-1]} ({len(on)})"
        print(f"  {span:>15s} {tokens:7,d} {'%d/%d' % windows:>10s} {rows or vocab_rows:9,d}   {'':18s} "
              f"{flops['attention'] / 1e9:9,.0f} {flops['attention_blocks'] / 1e9:9,.0f} {flops['head'] / 1e9:8,.0f} "
              f"{flops['rest'] / 1e9:8,.0f} {total / 1e9:8,.0f}")
        if check is None:  # (the first shape's)
            check = (on[0], tokens, flops["head"] + flops["rest"], matrix_weights(model, rows or vocab_rows))
    total = run["attention"] + run["head"] + run["rest"]
    print(f"  run, a rank: {total / 1e12:,.1f} TFLOPs (attention {run['attention'] / 1e12:,.1f}, in blocks "
          f"{run['attention_blocks'] / 1e12:,.1f}; head {run['head'] / 1e12:,.1f}; rest {run['rest'] / 1e12:,.1f}); "
          f"mean a step {total / steps / 1e9:,.0f} GFLOPs")
    step, tokens, counted, weights = check
    print(f"  check, step {step}: matrix products counted {counted / 1e9:,.0f} GFLOPs; 6 x {weights / 1e6:.1f}M matrix "
          f"weights (the head's scored rows) x {tokens:,d} tokens = {6 * weights * tokens / 1e9:,.0f} GFLOPs")
    return dict(run, steps=steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    start = time.perf_counter()
    check_pairs_against_masks()
    args_89 = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    args_92 = train_gpt.parse_args(["--preset", "record"], cuda=False)
    print("FLOPs of a rank's training step, the forward and backward of one sequence: matrix products (torch's "
          "FLOP counter, meta device)\nand attention by hand (the pairs its sliding window allows, ignoring documents: "
          "an upper bound; 'blocks': the 128 x 128 blocks\nit touches, what FlexAttention computes). Head: its input "
          "to the loss, on the rows it scores (FP8 on a GPU, counted as bf16).\n")
    old = report("record #89 (the record89 preset)", build(args_89), args_89, step_shapes(args_89))
    print()
    new = report("record #92 (the record preset)", build(args_92), args_92,
                 step_shapes(args_92))
    print()

    def total(run: dict, attention: str = "attention", head_cost: float = 1.0) -> float:
        return run[attention] + head_cost * run["head"] + run["rest"]
    print(f"#92 / #89: a step {total(new) / new['steps'] / (total(old) / old['steps']):.3f} (mean FLOPs), a run "
          f"{total(new) / total(old):.3f}; steps {new['steps']} / {old['steps']} = {new['steps'] / old['steps']:.3f}")
    print(f"  with attention's blocks: a step "
          f"{total(new, 'attention_blocks') / new['steps'] / (total(old, 'attention_blocks') / old['steps']):.3f}, "
          f"a run {total(new, 'attention_blocks') / total(old, 'attention_blocks'):.3f}")
    print(f"  were the head's FP8 FLOPs half a bf16 FLOP's cost (an H100's peaks): a step "
          f"{total(new, head_cost=0.5) / new['steps'] / (total(old, head_cost=0.5) / old['steps']):.3f}, "
          f"a run {total(new, head_cost=0.5) / total(old, head_cost=0.5):.3f}")
    print(f"counted in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
