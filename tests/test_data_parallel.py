"""Data parallelism: bucketed async all-reduce with gradient accumulation equals one process."""
import pytest
import torch

import train_gpt
from layouts import LAYOUT_TEST_FLAGS, assert_holds_and_sends_what_the_plan_predicts, assert_trains_like_one_process
from synthetic import tiny_flags, write_synthetic_shards
from train_gpt import run_on_ranks


def test_two_ranks_with_buckets_match_one_rank_after_three_steps(tmp_path):
    # float32 gradient sums: 1 and 2 ranks add in another order, within the layout check's tolerance (the noise
    # floor measured below); the tiny model's ~64 MB of gradients span several 25 MB buckets
    files = write_synthetic_shards(tmp_path)
    flags = tiny_flags(files, **LAYOUT_TEST_FLAGS, fp64_grad_sum=False)
    model = train_gpt.build_model(train_gpt.parse_args(flags, cuda=False), torch.device("cpu"))
    assert len(train_gpt.GradientBuckets(model.parameters()).buckets) > 1
    single = run_on_ranks(train_gpt.train_steps, 1, flags, 3)[0]
    jittered = run_on_ranks(train_gpt.train_steps, 1, flags, 3, "cpu", train_gpt.ROUNDING_JITTER)[0]
    results = run_on_ranks(train_gpt.train_steps, 2, flags, 3)
    assert train_gpt.worst_difference(results[0]["state"], single["state"])[0] > 0  # not float64 sums: not exact
    assert_trains_like_one_process(results, single, train_gpt.noise_floors(jittered, single))
    assert_holds_and_sends_what_the_plan_predicts(results, files, fp64_grad_sum=False)


def test_float64_gradient_sums_make_two_ranks_bit_identical_to_one(layout_runs):
    single = train_gpt.flat_state(layout_runs("one process")["state"])
    for name, value in train_gpt.flat_state(layout_runs("dp2")[0]["state"]).items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(single[name])), name


def test_world_size_that_does_not_divide_the_batch_is_refused():
    args = train_gpt.parse_args(["--preset", "tiny"], cuda=False)
    assert train_gpt.check_world_size(args, 4) == 2
    with pytest.raises(train_gpt.UserError, match=r"world size 3 does not divide --seqs_per_step 8.*\[1, 2, 4, 8\]"):
        train_gpt.check_world_size(args, 3)


def test_one_process_without_float64_sums_trains_a_model_with_a_parameter_no_step_uses(tmp_path, monkeypatch):
    # the buckets do nothing on one rank: a fork's parameter that gets no gradient is Adam's to skip, as in a plain
    # PyTorch loop, not a bucket that is never reduced
    class GPTWithUnusedGain(train_gpt.GPT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unused_gain = torch.nn.Parameter(torch.ones(()))
    monkeypatch.setattr(train_gpt, "GPT", GPTWithUnusedGain)
    files = write_synthetic_shards(tmp_path)
    args = train_gpt.parse_args(tiny_flags(files, fp64_grad_sum=False), cuda=False)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))
    batches = train_gpt.DistributedDataLoader(args.train_files, train_gpt.context_length(args), args.seqs_per_step, 0, 1,
                                              torch.device("cpu"))
    for step in range(2):
        loss = train_gpt.forward_backward(trainer, batches, step)
        assert trainer.model.unused_gain.grad is None and trainer.model.lm_head.weight.grad.norm() > 0
        train_gpt.optimizer_step(trainer, step)
    assert torch.isfinite(loss) and trainer.model.unused_gain.item() == 1.0
