"""Data parallelism: bucketed async all-reduce with gradient accumulation equals one process."""
import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_and_sends_what_the_plan_predicts, assert_trains_like_one_process, train_steps
from synthetic import write_synthetic_shards


def test_two_ranks_with_buckets_match_one_rank_after_three_steps(tmp_path):
    # float32 gradient sums: 1 and 2 ranks add in another order, so gradients after two updates agree to 1.2e-5
    # of their norm and parameters to 4e-6 (measured)
    files = write_synthetic_shards(tmp_path)
    layout = dict(fp64_grad_sum=False)
    single = train_steps(0, 1, files, 3, layout)
    results = run_on_ranks(train_steps, 2, files, 3, layout)
    assert results[0]["num_buckets"] > 1  # the tiny model's ~64 MB of gradients span several 25 MB buckets
    assert_trains_like_one_process(results, single, gradient_tolerance=1e-4)
    assert_holds_and_sends_what_the_plan_predicts(results, files, **layout)


def test_float64_gradient_sums_make_two_ranks_bit_identical_to_one(layout_runs):
    single = layout_runs("one process")
    for result in layout_runs("dp2"):
        for kind in ("grads", "params"):
            for name, value in single[kind].items():
                assert torch.equal(torch.as_tensor(result[kind][name]), value), (kind, name)


def test_world_size_that_does_not_divide_the_batch_is_refused():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    assert train_gpt.check_world_size(args, 4) == 2
    with pytest.raises(train_gpt.UserError, match=r"world size 3 does not divide --seqs_per_step 8.*\[1, 2, 4, 8\]"):
        train_gpt.check_world_size(args, 3)
