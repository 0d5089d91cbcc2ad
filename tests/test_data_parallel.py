"""Data parallelism: bucketed async all-reduce with gradient accumulation equals one process."""
import pytest
import torch

import train_gpt
from layouts import LAYOUT_TEST_FLAGS, assert_holds_and_sends_what_the_plan_predicts, assert_trains_like_one_process, \
    beside_its_plan
from synthetic import tiny_flags, write_synthetic_shards
from train_gpt import run_on_ranks


def test_two_ranks_with_buckets_match_one_rank_after_three_steps(tmp_path):
    # float32 gradient sums: 1 and 2 ranks add in another order, within the layout check's tolerance (the noise
    # floor measured below); the tiny model's ~64 MB of gradients span several 25 MB buckets
    files = write_synthetic_shards(tmp_path)
    flags = tiny_flags(files, **LAYOUT_TEST_FLAGS, fp64_grad_sum=False)
    model = train_gpt.build_model(train_gpt.parse_args(flags, cuda=False), torch.device("cpu"))
    assert len(train_gpt.GradientBuckets(model.parameters()).buckets) > 1
    [single], [jittered] = train_gpt.run_together((train_gpt.train_steps, 1, flags, 3),
                                                  (train_gpt.train_steps, 1, flags, 3, "cpu", train_gpt.ROUNDING_JITTER))
    results, plan = beside_its_plan(lambda: run_on_ranks(train_gpt.train_steps, 2, flags, 3), flags, 2)
    assert train_gpt.worst_difference(results[0]["state"], single["state"])[0] > 0  # not float64 sums: not exact
    assert_trains_like_one_process(results, single, train_gpt.noise_floors(jittered, single))
    assert_holds_and_sends_what_the_plan_predicts(results, plan, files, fp64_grad_sum=False)


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


def table_gradient(rank, rows, lookups):
    """Rank `rank`'s gradient of a (rows, 4) table that `lookups` tokens looked up: whole numbers, whose float64 sums
    are exact in any order."""
    draws = torch.Generator().manual_seed(rank)
    grad = torch.zeros(rows, 4, dtype=torch.float64)
    found = torch.randint(0, rows, (lookups,), generator=draws)
    return grad.index_add_(0, found, torch.randint(-9, 10, (lookups, 4), generator=draws, dtype=torch.float64))


def average_rows_on_rank(rank, world_size, cases):
    """Each case's table gradient averaged by GradientBuckets.average_rows on this rank, and the bytes it sent."""
    results = []
    for rows, lookups, keeper in cases:
        table = torch.nn.Parameter(torch.zeros(rows, 4, dtype=torch.float64))
        buckets = train_gpt.GradientBuckets([table], dp=train_gpt.world_axis(rank, world_size),
                                            owner_of=None if keeper is None else {table: keeper},
                                            reduce_to_owner=keeper is not None, tables={table: None})
        train_gpt.comm_bytes.clear()
        grad = table_gradient(rank, rows, lookups)
        kept = buckets.average_rows(grad, table)  # (each rank's rows: returned; else in place)
        results.append((grad if kept is None else kept, dict(train_gpt.comm_bytes)))
    return results


def test_an_embedding_tables_gradient_travels_as_the_rows_the_ranks_looked_up():
    # three ranks, so that the shares of rows each rank sums differ in size (34, 33, 33 of 100 rows); averaged on the
    # keeper (every rank, the owner of ZeRO, or each rank its rows j, j + 3, ...: ROW_OWNERS), equal to the average
    # of the three ranks' gradients summed here (whole numbers: exact in any order). A few rows each: the rows
    # travel, in well under the dense bytes; every row looked up: an all-reduce (a reduce, a reduce-scatter) of the
    # table, which sends less; more ranks than rows: some shares empty
    rows_kept = train_gpt.ROW_OWNERS
    cases = [(100, 5, None), (100, 5, 1), (100, 5, rows_kept), (100, 400, None), (100, 400, 2), (100, 400, rows_kept),
             (2, 1, None), (2, 1, 0), (2, 1, rows_kept)]
    results = run_on_ranks(average_rows_on_rank, 3, cases)
    for case, (rows, lookups, keeper) in enumerate(cases):
        expected = sum(table_gradient(rank, rows, lookups) for rank in range(3)) / 3
        assert expected.ne(0).any(1).sum() >= min(rows, lookups)  # (rows of each rank's own, in each share)
        for rank in range(3) if keeper in (None, rows_kept) else [keeper]:
            grad, sent = results[rank][case]
            if keeper == rows_kept:  # (rank j's rows j, j + 3, ..., a row of zeros after where it has fewer)
                own = expected[rank::3]
                expected_here = torch.cat([own, own.new_zeros(-(-rows // 3) - len(own), 4)])
            assert torch.equal(torch.as_tensor(grad), expected if keeper != rows_kept else expected_here), (case, rank)
            dense_bytes = rows * 4 * torch.float64.itemsize
            if lookups == 5:
                assert set(sent) == {"table_all_gather_single", "table_all_to_all"} | (
                    {"table_all_gather"} if keeper is None else set())
                assert sum(sent.values()) < dense_bytes / (2 if keeper != rows_kept else 4)
            elif lookups == 400:
                dense = {None: "table_all_reduce", rows_kept: "table_reduce_scatter_single"}.get(keeper, "table_reduce")
                padded_rows = 3 * 34 if keeper == rows_kept else rows
                assert sent == {"table_all_gather_single": 9 * 8, dense: padded_rows * 4 * torch.float64.itemsize}


def trained_after_warmup(rank, world_size, files, zero, warmup_steps):
    """The parameters before and after 6 steps (ZeRO stage `zero`), with that many compile warm-up steps before them."""
    args = train_gpt.parse_args(tiny_flags(files, zero=zero, num_iterations=6), cuda=False)
    cpu = torch.device("cpu")
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(rank, world_size, cpu))
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    if warmup_steps:
        train_gpt.warmup_and_restore(trainer, warmup_steps)
    batches = train_gpt.DistributedDataLoader(args.train_files, train_gpt.context_length(args), args.seqs_per_step,
                                              rank, world_size, cpu)
    for step in range(args.num_iterations):
        train_gpt.forward_backward(trainer, batches, step)
        train_gpt.optimizer_step(trainer, step)
    return {name: (initial[name], p.detach().clone()) for name, p in trainer.model.named_parameters()}


def test_a_compile_warmup_leaves_data_parallel_training_as_it_was(tmp_path):
    # undoing the warm-up must reach all the state data parallelism adds: Muon's groups, whose learning rate and
    # momentum the schedules set each step, and (ZeRO 1) the rows of the embedding tables each rank steps
    files = write_synthetic_shards(tmp_path)
    warmed, fresh = (run_on_ranks(trained_after_warmup, 2, files, 1, steps)[0] for steps in (6, 0))
    assert all(not torch.equal(*map(torch.as_tensor, before_after)) for before_after in fresh.values())  # all moved
    for name, (_, trained) in fresh.items():
        assert torch.equal(torch.as_tensor(warmed[name][1]), torch.as_tensor(trained)), name
