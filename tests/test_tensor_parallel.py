"""Tensor parallelism (Megatron: heads, MLP width and vocabulary split) on gloo processes: what each rank holds,
the vocabulary-parallel loss, and the layouts it refuses. (tests/test_layouts.py: the same training as one
process.)"""
import pytest
import torch

import train_gpt
from train_gpt import run_on_ranks
from synthetic import tiny_flags


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "tp2_sp_async"])
def test_two_tensor_parallel_ranks_hold_half_of_the_one_process_model(layout_runs, name):
    single = layout_runs("one process")["accounted"]
    for rank in layout_runs(name):  # every matrix and embedding is split in two; only the scalars are whole on both
        assert rank["accounted"]["parameters"] < 0.51 * single["parameters"]


def statistics_loss(stats, weights):
    return train_gpt.summed_loss(stats.log_probs(), stats.found, weights)


def test_the_loss_of_vocab_parallel_statistics_equals_the_dense_one_on_one_rank_pair():
    # forward value and gradient of the loss built from the split's statistics, against F.cross_entropy over the whole
    # vocabulary; and with weighted columns of targets (multi-token prediction, a prefix token; -1 for none), against the weighted sum of
    # each column's cross-entropy written out in float64
    torch.manual_seed(0)
    logits = torch.randn(50, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 12, (50,))
    columns = torch.stack([targets, torch.randint(-1, 12, (50,)), torch.randint(-1, 12, (50,))], dim=1)
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    expected = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    log_p = logits.detach().log_softmax(-1)
    weighted = sum(-weights[j] * log_p[t, columns[t, j]] for t in range(50) for j in range(3) if columns[t, j] >= 0)
    assert (columns == -1).any() and abs(weighted - expected.item()) > 1  # (the weighted loss is another)
    expected.backward()
    for cols, w, value, grad in ((targets[:, None], None, expected.item(), logits.grad),
                                 (columns, weights, weighted, None)):
        results = run_on_ranks(split_statistics_loss, 2, logits.detach(), cols, w)
        assert results[0][0] == pytest.approx(float(value), rel=1e-12) and results[1][0] == results[0][0]
        dense = statistics_loss(train_gpt.VocabularyStatistics()(logits, cols), w)  # the one-device module's
        assert dense.item() == pytest.approx(float(value), rel=1e-12)
        if grad is None:
            grad = torch.autograd.grad(dense, logits)[0]
        torch.testing.assert_close(torch.cat([torch.as_tensor(r[1]) for r in results], 1), grad, rtol=1e-12,
                                   atol=1e-12)


def split_statistics_loss(rank, world_size, logits, targets, weights, candidates=None):
    """The loss of the statistics of this rank's part of the logits (of its candidates among its rows, where given)
    and its gradient."""
    tp = train_gpt.world_axis(rank, world_size)
    local = train_gpt.TensorParallelSlice(1, logits.size(1), tp).cut(logits)
    rows, columns = local.size(1), None
    if candidates is not None:
        columns = train_gpt.own_candidates(candidates, tp, rows)
        local = local[:, columns]
    local.requires_grad_()
    loss = statistics_loss(train_gpt.vocab_parallel_statistics(local, targets, columns, tp, rows), weights)
    loss.backward()
    return loss.item(), local.grad


def test_vocab_parallel_statistics_over_candidates_spanning_the_ranks_equals_float64_restricted_to_them():
    # #92's sampled softmax under tensor parallelism: each rank scores the candidates among its half of the 12
    # entries; against each target column's log-softmax over the candidates written out in float64, a target outside
    # them (the prefix column's, as #92's) or -1 counting nothing; and the gradient, rank by rank
    torch.manual_seed(1)
    logits = torch.randn(50, 12, dtype=torch.float64, requires_grad=True)
    candidates = torch.tensor([0, 2, 3, 5, 7, 8, 11])  # 4 on rank 0 (of 0..5), 3 on rank 1 (of 6..11)
    targets = candidates[torch.randint(0, 7, (50,))]
    columns = torch.stack([targets, torch.where(torch.rand(50) < 0.3, -1, candidates[torch.randint(0, 7, (50,))]),
                           torch.randint(0, 12, (50,))], dim=1)
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    log_p = logits[:, candidates].log_softmax(-1)
    at = {int(c): i for i, c in enumerate(candidates)}
    expected = sum(-weights[j] * log_p[t, at[int(columns[t, j])]] for t in range(50) for j in range(3)
                   if int(columns[t, j]) in at)
    assert not torch.isin(columns[:, 2], candidates).all()  # some prefix targets outside the candidates
    assert abs(expected.item() + (weights * logits.detach().log_softmax(-1).gather(1, columns.clamp_min(0))
                                  * (columns >= 0)).sum().item()) > 1  # (the whole vocabulary's loss is another)
    grad = torch.autograd.grad(expected, logits)[0]
    results = run_on_ranks(split_statistics_loss, 2, logits.detach(), columns, weights, candidates)
    assert results[0][0] == pytest.approx(expected.item(), rel=1e-12) and results[1][0] == results[0][0]
    torch.testing.assert_close(torch.cat([torch.as_tensor(r[1]) for r in results], 1), grad[:, candidates],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size, flags, words", [
    (3, ["--tp", "2"], "--tp 2 x --pp 1 = 2 does not divide the world size 3"),
    (3, ["--tp", "3"], r"--tp 3 does not divide --num_heads \(4\)"),
    (2, ["--sp", "true"], "--sp shards the sequence over the tensor-parallel ranks: it needs --tp 2 or more"),
    (2, ["--tp", "2", "--async_tp", "true"], "--async_tp overlaps .* it needs --sp true"),
    (6, ["--tp", "2"], r"data-parallel size 3 \(world size 6 / \(--tp 2 x --pp 1\)\) does not divide --seqs_per_step 4"),
])
def test_layouts_that_do_not_fit_are_refused_by_name(files, world_size, flags, words):
    with pytest.raises(train_gpt.UserError, match=words):
        args = train_gpt.parse_args(tiny_flags(files) + flags, cuda=False)
        train_gpt.check_world_size(args, world_size)


def test_paired_heads_that_do_not_halve_evenly_train_under_two_ranks_padded_with_heads_of_zeros(layout_files):
    # the record's 6 heads attend in 3 pairs (h with h + 3), which 2 ranks cannot share evenly: each rank holds 2
    # heads of each half, rank 1 one of them zeros, which stay zero. The tiny model with 6 heads trains as one
    # process does, within the noise floor measured by jittering that process's gradients
    from layouts import LAYOUT_TEST_FLAGS, assert_trains_like_one_process, edited_train_steps
    flags = tiny_flags(layout_files, **LAYOUT_TEST_FLAGS, num_heads=6, model_dim=48)
    single, jittered = (run_on_ranks(edited_train_steps, 1, None, flags, 3, jitter)[0]
                        for jitter in (0.0, train_gpt.ROUNDING_JITTER))
    ranks = run_on_ranks(edited_train_steps, 2, None, flags + ["--tp=2"], 3)
    assert_trains_like_one_process(ranks, single, train_gpt.noise_floors(jittered, single))
    args = train_gpt.parse_args(flags + ["--tp=2"], cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    paired = [i for i, block in enumerate(model.blocks) if getattr(getattr(block, "attn", None), "head_groups", 1) > 1]
    ctx = train_gpt.build_parallel_context(1, 2, torch.device("meta"), tp=2)
    with train_gpt.simulated_rank(1, 2):
        layout = train_gpt.apply_layout(model, args, ctx)
    for i in paired:  # (a paired layer's q and k: 2 x 4 heads of 8, half of them zeros on rank 1)
        assert tuple(layout.model.blocks[i].attn.qk.weight.shape) == (2, 4 * 8, 48), i
    assert paired
