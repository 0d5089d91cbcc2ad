"""Tensor parallelism (Megatron: heads, MLP width and vocabulary split) on gloo processes: the same training as
one process, alone and combined with data parallelism and ZeRO, and the layouts it refuses."""
import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_what_the_plan_predicts, assert_trains_like_one_process, train_steps
from synthetic import tiny_flags


def test_two_tensor_parallel_ranks_train_the_one_process_model_holding_half(files, single):
    ranks = run_on_ranks(train_steps, 2, files, 3, None, dict(tp=2))
    assert_trains_like_one_process(ranks, single)
    assert_holds_what_the_plan_predicts(ranks, files, tp=2)
    for rank in ranks:  # every matrix and embedding is split in two; only the scalars are whole on both ranks
        assert rank["held"]["parameters"] < 0.51 * single["held"]["parameters"]


@pytest.mark.parametrize("zero", [0, 3])
def test_data_parallel_2_by_tensor_parallel_2_trains_the_one_process_model(files, single, zero):
    assert_trains_like_one_process(run_on_ranks(train_steps, 4, files, 3, None, dict(zero=zero, tp=2), timeout=600), single)


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
    loss = train_gpt.vocab_parallel_cross_entropy(local, targets, tp, "sum")
    loss.backward()
    return loss.item(), local.grad


@pytest.mark.parametrize("world_size, flags, words", [
    (3, ["--tp", "2"], "--tp 2 does not divide the world size 3"),
    (4, ["--tp", "4"], r"--tp 4 does not divide --num_heads \(2\)"),
    (6, ["--tp", "2"], r"data-parallel size 3 \(world size / --tp 2\) does not divide --seqs_per_step 4"),
])
def test_layouts_that_do_not_fit_are_refused_by_name(files, world_size, flags, words):
    args = train_gpt.parse_args(tiny_flags(files) + flags, cuda=False)
    with pytest.raises(train_gpt.UserError, match=words):
        train_gpt.check_world_size(args, world_size)
