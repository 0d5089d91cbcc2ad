"""Data parallelism: bucketed async all-reduce with gradient accumulation equals one process."""
import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_what_the_plan_predicts, train_steps
from synthetic import write_synthetic_shards


def test_two_ranks_with_buckets_match_one_rank_after_three_steps(tmp_path):
    files = write_synthetic_shards(tmp_path)
    torch.manual_seed(0)
    single = train_steps(0, 1, files, steps=3)
    results = run_on_ranks(train_steps, 2, files, 3)
    assert results[0]["num_buckets"] > 1  # the tiny model's ~64 MB of gradients span several 25 MB buckets
    assert_holds_what_the_plan_predicts(results, files)
    for result in results:
        for name, grad in single["grads"].items():
            torch.testing.assert_close(torch.as_tensor(result["grads"][name]), grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"gradient of {name}: {m}")
        assert result["losses"] == pytest.approx(single["losses"], rel=1e-6)
        # parameters: Adam divides by sqrt(v) + 1e-10, so a gradient that is only rounding noise (summation order
        # differs between 1 and 2 ranks) can still move a weight by ~1e-5; 1e-4 is far below any real difference
        for name, param in single["params"].items():
            torch.testing.assert_close(torch.as_tensor(result["params"][name]), param.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"parameter {name}: {m}")


def test_float64_gradient_sums_make_two_ranks_bit_identical_to_one(tmp_path):
    files = write_synthetic_shards(tmp_path)
    single = train_steps(0, 1, files, 3, torch.float64)
    for result in run_on_ranks(train_steps, 2, files, 3, torch.float64):
        # the reported loss is summed in float32 per rank, so it may differ in the last bit; the model may not
        assert result["losses"] == pytest.approx(single["losses"], rel=1e-6)
        for kind in ("grads", "params"):
            for name, value in single[kind].items():
                assert torch.equal(torch.as_tensor(result[kind][name]), value.detach()), (kind, name)


def test_world_size_that_does_not_divide_the_batch_is_refused():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    assert train_gpt.check_world_size(args, 4) == 2
    with pytest.raises(train_gpt.UserError, match=r"world size 3 does not divide --seqs_per_step 8.*\[1, 2, 4, 8\]"):
        train_gpt.check_world_size(args, 3)
