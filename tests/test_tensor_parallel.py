"""Tensor parallelism (Megatron: heads, MLP width and vocabulary split) on gloo processes: the same training as
one process, alone and combined with data parallelism and ZeRO, and the layouts it refuses."""
import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_what_the_plan_predicts, assert_trains_like_one_process, train_steps
from synthetic import tiny_flags


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(tp=2, sp=True, async_tp=True)])
def test_two_tensor_parallel_ranks_train_the_one_process_model_holding_half(files, single, layout):
    # replicated activations (f/g all-reduces), sequence parallel (all-gather / reduce-scatter of sequence
    # shards), and asynchronous tensor parallelism (the column-parallel matmul overlapping the all-gather)
    ranks = run_on_ranks(train_steps, 2, files, 3, None, layout)
    assert_trains_like_one_process(ranks, single)
    assert_holds_what_the_plan_predicts(ranks, files, **layout)
    for rank in ranks:  # every matrix and embedding is split in two; only the scalars are whole on both ranks
        assert rank["held"]["parameters"] < 0.51 * single["held"]["parameters"]


def test_data_parallel_2_by_tensor_parallel_2_with_zero_3_trains_the_one_process_model(files, single):
    ranks = run_on_ranks(train_steps, 4, files, 3, None, dict(zero=3, tp=2), timeout=600)
    assert_trains_like_one_process(ranks, single)


def test_vocab_parallel_cross_entropy_equals_the_dense_one_on_one_rank_pair():
    # forward value and gradient of the split loss, against F.cross_entropy over the whole vocabulary
    torch.manual_seed(0)
    logits = torch.randn(50, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 12, (50,))
    expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    expected.backward()
    results = run_on_ranks(split_cross_entropy, 2, logits.detach(), targets)
    assert results[0][0] == pytest.approx(expected.item(), rel=1e-12) and results[1][0] == results[0][0]
    torch.testing.assert_close(torch.cat([torch.as_tensor(r[1]) for r in results], 1), logits.grad, rtol=1e-12,
                               atol=1e-12)


def split_cross_entropy(rank, world_size, logits, targets):
    tp = train_gpt.world_axis(rank, world_size)
    local = train_gpt.tp_shard(logits, 1, tp).requires_grad_()
    loss = train_gpt.vocab_parallel_cross_entropy(local, targets, tp)
    loss.backward()
    return loss.item(), local.grad


@pytest.mark.parametrize("world_size, flags, words", [
    (3, ["--tp", "2"], "--tp 2 x --pp 1 = 2 does not divide the world size 3"),
    (4, ["--tp", "4"], r"--tp 4 does not divide --num_heads \(2\)"),
    (2, ["--sp", "true"], "--sp shards the sequence over the tensor-parallel ranks: it needs --tp 2 or more"),
    (2, ["--tp", "2", "--async_tp", "true"], "--async_tp overlaps .* it needs --sp true"),
    (6, ["--tp", "2"], r"data-parallel size 3 \(world size 6 / \(--tp 2 x --pp 1\)\) does not divide --seqs_per_step 4"),
])
def test_layouts_that_do_not_fit_are_refused_by_name(files, world_size, flags, words):
    with pytest.raises(train_gpt.UserError, match=words):
        args = train_gpt.parse_args(tiny_flags(files) + flags, cuda=False)
        train_gpt.check_world_size(args, world_size)
