"""A few training steps under any layout (data, tensor and pipeline parallel, ZeRO), reporting what tests compare
with a one-process run: full gradients and parameters, losses, and the bytes each rank holds."""
import pytest
import torch

import train_gpt
from synthetic import tiny_flags


def full(t, p, ctx):
    """A tensor-parallel slice t of parameter p gathered into the one-process tensor."""
    return train_gpt.tp_gather(t, p.tp_dim, p.tp_full, ctx.tp) if train_gpt.is_tensor_parallel(p) else t


def train_steps(rank, world_size, files, steps, sum_dtype=None, layout=None):
    """Gradients after the first step's backward, losses and parameters after `steps` steps (all as full
    one-process tensors; a pipeline stage has its own parameters only), and the bytes of parameters, gradients
    and optimizer state this rank holds. layout: flags such as dict(tp=2, zero=1)."""
    layout = layout or {}
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    zero = args.zero
    grad_accum_steps = train_gpt.check_world_size(args, world_size)
    ctx = train_gpt.build_parallel_context(rank, world_size, torch.device("cpu"), args.tp, args.pp)
    torch.manual_seed(ctx.dp.rank)  # different across dp (the broadcast from dp rank 0 must make them equal)
    model = train_gpt.build_model(args, ctx.device, ctx.tp, ctx.pp)
    train_gpt.broadcast_parameters(model, ctx.dp)
    optimizers = train_gpt.build_optimizers(model, args, ctx)
    sharding = train_gpt.Zero.build(zero, train_gpt.optimizer_param_groups(model), ctx.dp) if zero else None
    buckets = (train_gpt.GradientBuckets(model.parameters(), sum_dtype=sum_dtype, dp=ctx.dp,
                                         owner_of=sharding.gradient_owners() if sharding else None)
               if world_size > 1 or sum_dtype else None)
    shards = train_gpt.ShardedParameters(model, sharding) if zero >= 3 else None
    stage = train_gpt.PipelineStage(model, ctx.pp, args.pp_schedule)
    batches = train_gpt.DistributedDataLoader(args.train_files, args.train_seq_len, args.seqs_per_step,
                                              ctx.dp.rank, ctx.dp.size, ctx.device)
    first_grads, losses, held = None, [], {}
    for step in range(steps):
        window = train_gpt.window_tensor(train_gpt.window_size_blocks(step, args), ctx.device)
        loss = train_gpt.accumulate_gradients(model, buckets, batches, window, grad_accum_steps, stage)
        loss = train_gpt.from_last_stage(loss / (grad_accum_steps * args.train_seq_len), ctx.pp)
        losses.append(train_gpt.all_reduce_mean(loss).item())
        if first_grads is None:  # (under ZeRO 2 and up, only the gradients this rank owns)
            owned = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            held["gradients"] = sum(train_gpt.nbytes(p.grad) for _, p in owned)
            first_grads = {n: full(p.grad, p, ctx) for n, p in owned}
        train_gpt.optimizer_step(model, optimizers, step, args, sharding)
        if step == 0:
            held["optimizer_states"] = sum(train_gpt.nbytes(t) for opt in optimizers for state in opt.state.values()
                                           for t in state.values())
            held["parameters"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
    if shards is not None:
        shards.gather_all()  # full parameters to compare
    return dict(grads=first_grads, losses=losses, held=held,
                params={n: full(p.detach(), p, ctx) for n, p in model.named_parameters()},
                num_buckets=len(buckets.buckets) if buckets else 0)


def assert_trains_like_one_process(ranks, single):
    """Each rank's gradients (after the first step), losses and parameters (after the last) equal the one-process
    run's, and together the ranks hold every one of them."""
    for rank in ranks:
        assert rank["grads"].keys() <= single["grads"].keys()
        for name, grad in rank["grads"].items():  # gradients directly: Adam would hide a constant factor
            torch.testing.assert_close(torch.as_tensor(grad), single["grads"][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"gradient of {name}: {m}")
        assert rank["losses"] == pytest.approx(single["losses"], rel=1e-6)
        # parameters in norm: Adam (eps 1e-10) turns summation-order rounding in a rare token's tiny gradient into
        # a visible step for that one embedding row (measured 1.6e-4 on 3 of 1.6M elements), while every tensor as
        # a whole agrees to within 2e-5 of its norm (measured; Muon's Newton-Schulz carries the rounding on)
        for name, param in rank["params"].items():
            got, expected = torch.as_tensor(param).double(), single["params"][name].detach().double()
            assert (got - expected).norm() <= 1e-4 * expected.norm(), (name, (got - expected).norm().item())
    assert set().union(*(rank["grads"] for rank in ranks)) == single["grads"].keys()
    assert set().union(*(rank["params"] for rank in ranks)) == single["params"].keys()


def assert_holds_what_the_plan_predicts(ranks, files, **layout):
    """Parameter, gradient and optimizer-state bytes each rank held after the first step, against --plan."""
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    plan = train_gpt.plan_layout(args, len(ranks), cuda=False)
    for rank, predicted in zip(ranks, plan["ranks"]):
        for kind in ("parameters", "gradients", "optimizer_states"):
            assert rank["held"][kind] == pytest.approx(predicted[kind], rel=0.1), kind
