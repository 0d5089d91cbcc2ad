"""Data parallelism: bucketed async all-reduce with gradient accumulation equals one process."""
import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from synthetic import tiny_flags, write_synthetic_shards


def full(t, p, ctx):
    """A tensor-parallel slice t of parameter p gathered into the one-process tensor."""
    return train_gpt.tp_gather(t, p.tp_dim, p.tp_full, ctx.tp) if train_gpt.is_tensor_parallel(p) else t


def train_steps(rank, world_size, files, steps, sum_dtype=None, zero=0, tp=1):
    """Gradients after the first step's backward, losses and parameters after `steps` steps (all as full
    one-process tensors), and the bytes of parameters, gradients and optimizer state this rank holds."""
    args = train_gpt.parse_args(tiny_flags(files, zero=zero, tp=tp), cuda=False)
    grad_accum_steps = train_gpt.check_world_size(args, world_size)
    ctx = train_gpt.build_parallel_context(rank, world_size, torch.device("cpu"), tp)
    torch.manual_seed(ctx.dp.rank)  # different across dp (the broadcast from dp rank 0 must make them equal)
    model = train_gpt.build_model(args, ctx.device, ctx.tp)
    train_gpt.broadcast_parameters(model, ctx.dp)
    optimizers = train_gpt.build_optimizers(model, args, ctx)
    layout = train_gpt.Zero.build(zero, train_gpt.optimizer_param_groups(model), ctx.dp) if zero else None
    buckets = (train_gpt.GradientBuckets(model.parameters(), sum_dtype=sum_dtype, dp=ctx.dp,
                                         owner_of=layout.gradient_owners() if layout else None)
               if world_size > 1 or sum_dtype else None)
    shards = train_gpt.ShardedParameters(model, layout) if zero >= 3 else None
    batches = train_gpt.DistributedDataLoader(args.train_files, args.train_seq_len, args.seqs_per_step,
                                              ctx.dp.rank, ctx.dp.size, ctx.device)
    first_grads, losses, held = None, [], {}
    for step in range(steps):
        window = train_gpt.window_tensor(train_gpt.window_size_blocks(step, args), ctx.device)
        loss = train_gpt.accumulate_gradients(model, buckets, batches, window, grad_accum_steps)
        losses.append(train_gpt.all_reduce_mean(loss / (grad_accum_steps * args.train_seq_len)).item())
        if first_grads is None:  # (under ZeRO 2 and up, only the gradients this rank owns)
            owned = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            held["gradients"] = sum(train_gpt.nbytes(p.grad) for _, p in owned)
            first_grads = {n: full(p.grad, p, ctx) for n, p in owned}
        train_gpt.optimizer_step(model, optimizers, step, args, layout)
        if step == 0:
            held["optimizer_states"] = sum(train_gpt.nbytes(t) for opt in optimizers for state in opt.state.values()
                                           for t in state.values())
            held["parameters"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
    if shards is not None:
        shards.gather_all()  # full parameters to compare
    return dict(grads=first_grads, losses=losses, held=held,
                params={n: full(p.detach(), p, ctx) for n, p in model.named_parameters()},
                num_buckets=len(buckets.buckets) if buckets else 0)


def test_two_ranks_with_buckets_match_one_rank_after_three_steps(tmp_path):
    files = write_synthetic_shards(tmp_path)
    torch.manual_seed(0)
    single = train_steps(0, 1, files, steps=3)
    results = run_on_ranks(train_steps, 2, files, 3)
    assert results[0]["num_buckets"] > 1  # the tiny model's ~64 MB of gradients span several 25 MB buckets
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
