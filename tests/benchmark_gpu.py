"""Benchmark (not a test) of the record config on the GPUs present: a short run after a few untimed steps of the
same shape (the compile), on the FineWeb shards or, where they are missing, on synthetic shards of the same format.

    torchrun --standalone --nproc_per_node=$(nvidia-smi -L | wc -l) tests/benchmark_gpu.py [--steps 30] [flags]

Further flags go to train_gpt.py's parser (the record preset, #92's, is the base: its whole n-gram table, whose rows
the GPUs here cannot hold wait in a host tier as the run's plan sets it, unless --table_host_fraction is given). It
prints ms per step, tokens per second per GPU, MFU (model FLOPs counted as below, against the GPU's dense bf16 peak),
peak memory, the bytes the host tier moved a step, and the step split into forward+backward, the gradient wait (the
compute stream waiting for the last gradient reduction) and the optimizer. The steps are taken at the middle of the
schedule (--at_step), where the sliding window is half grown.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
import train_gpt  # noqa: E402
from tool_inputs import need, need_at_least, run_tool  # noqa: E402

# dense bf16 tensor-core peak, FLOP/s, by what torch.cuda.get_device_name contains (first match wins)
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12),
             ("L40S", 362e12), ("A10", 125e12), ("RTX 4090", 165e12)]


def model_flops_per_token(args: train_gpt.Hyperparameters, windows: tuple[int, int], seq_len: int) -> float:
    """Forward and backward FLOPs per token: 6 per weight of every matmul (q, k, v, the attention output, the MLP,
    the head over the padded vocabulary; embedding lookups are free), and for attention 12 per query, key and
    head dimension, counting each query's keys as its sliding window (short, long: windows[0] or windows[1] as the
    layer's, in places: paired heads' sequence has two a token; documents end it sooner, so this is an upper
    bound)."""
    d, hdim = args.model_dim, args.num_heads * args.head_dim
    attention_layers = [row for row in train_gpt.layer_stack(args) if row.attention]
    matmul_weights = (len(attention_layers) * 4 * hdim * d + args.num_layers * 8 * d * d
                      + train_gpt.next_multiple_of_n(args.vocab_size, n=128) * d)
    keys = sum(min(windows["SL".index(row.window)], seq_len * (1 + row.paired_head)) for row in attention_layers)
    return 6 * matmul_weights + 12 * keys * hdim


def synthetic_shards(directory: Path, train_tokens: int, seed: int = 0, val_tokens: int = 2 * 262144) -> dict:
    """Random tokens below the GPT-2 vocabulary with a document start (EOT) every 200 to 1,800 tokens, 1,000 on
    average (FineWeb's documents are about as long; #89's loader sizes its document table for over 300)."""
    rng = np.random.default_rng(seed)
    for name, n in (("train", train_tokens), ("val", val_tokens)):
        tokens = rng.integers(0, train_gpt.EOT_TOKEN, n)
        starts = np.cumsum(rng.integers(200, 1800, n // 200 + 1))
        tokens[starts[starts < n]] = train_gpt.EOT_TOKEN
        tokens[0] = train_gpt.EOT_TOKEN
        train_gpt.write_data_shard(directory / f"synthetic_{name}_000000.bin", tokens)
    return dict(train_files=str(directory / "synthetic_train_*.bin"), val_files=str(directory / "synthetic_val_*.bin"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    parser.add_argument("--at_step", type=int, default=None, help="schedule step to time at (default: the middle)")
    parser.add_argument("--untimed_steps", type=int, default=3,
                        help="steps before the timed ones, at their shape (the compile; the trainer's own warm-up "
                             "compiles every stage's shape, which a benchmark of one stage need not wait for)")
    ours, rest = parser.parse_known_args()
    need_at_least("--steps", ours.steps, 1, "timed steps")
    need_at_least("--untimed_steps", ours.untimed_steps, 0, "steps before the timed ones")
    train_gpt.keep_freed_memory_for_reuse()  # the trainer's allocator settings, before CUDA's first allocation
    args = train_gpt.parse_args(["--preset", "record", *rest])
    for name in ("train_files", "val_files"):  # (left out, synthetic shards stand in for FineWeb's where it is missing)
        need(name not in args.given or train_gpt.glob.glob(getattr(args, name)), f"--{name} {getattr(args, name)} "
             "matches no file: name existing shards, or leave the flag out")
    at_step = args.num_iterations // 2 if ours.at_step is None else ours.at_step
    need(0 <= at_step < args.num_iterations, f"--at_step {at_step}: give a step of the schedule, 0 to "
         f"{args.num_iterations - 1} (--num_iterations {args.num_iterations})")
    tier = host_tier_as_planned(args)
    ctx = train_gpt.setup_distributed(args.tp, args.pp)
    if args.compile is None:
        args.compile = train_gpt.compiles_by_default(args, ctx.device)
    if tier and ctx.is_master:
        print(tier, flush=True)
    step_tokens = args.seqs_per_step * train_gpt.batch_shape(at_step, args)[0]
    with tempfile.TemporaryDirectory() as scratch:
        if not train_gpt.glob.glob(args.train_files):
            files = [None]
            if ctx.is_master:
                files[0] = synthetic_shards(Path(scratch), (ours.steps + ours.untimed_steps + 2) * step_tokens + 1)
            if dist.is_initialized():
                dist.broadcast_object_list(files, 0)
            args.train_files, args.val_files = files[0]["train_files"], files[0]["val_files"]
            source = "synthetic shards (no FineWeb in " + str(Path(train_gpt.Hyperparameters.train_files).parent) + ")"
        else:
            source = args.train_files
        trainer = train_gpt.build_trainer(args, ctx)
        batches = train_gpt.train_batches(trainer)
        if ours.untimed_steps:  # the compile, and the allocator's first blocks, at the timed steps' shape only
            started = time.perf_counter()
            if ctx.is_master:
                print(f"{ours.untimed_steps} untimed steps at step {at_step} (compile {args.compile})", flush=True)
            time_steps(trainer, batches, at_step, ours.untimed_steps, ctx.device)
            if ctx.is_master:
                print(f"untimed steps: {time.perf_counter() - started:.0f} s", flush=True)
        phases = time_steps(trainer, batches, at_step, ours.steps, ctx.device)
    report(args, ctx, source, at_step, ours.steps, phases)
    if dist.is_initialized():
        dist.destroy_process_group()


def host_tier_as_planned(args) -> str | None:
    """Where the run's plan does not fit the GPUs here, the least host tier that makes it fit, set in args (unless
    --table_host_fraction is given); a line saying so, or None. Each rank plans alike: by the GPU's whole memory
    (its free memory differs from rank to rank), before the process group (a plan runs in one process)."""
    if not torch.cuda.is_available() or "table_host_fraction" in args.given:
        return None
    world_size = int(train_gpt.os.environ.get("WORLD_SIZE", "1"))
    needed = train_gpt.planned_peak(args, world_size)
    room = train_gpt.MEMORY_HEADROOM * torch.cuda.mem_get_info()[1]
    tier = train_gpt.host_tier(args, world_size, needed, room) if needed > room else None
    if tier is None:
        return None
    change, host = tier
    for name, value in change.items():
        setattr(args, name, value)
    return (f"host tier: --table_host_fraction {args.table_host_fraction} ({host / 1e9:.1f} GB of the table's rows a "
            f"GPU in pinned host memory), as the plan sets it: {needed / 1e9:.1f} GB a GPU without, "
            f"{room / 1e9:.1f} GB of the GPU's memory")


class Marks:
    """Points on the device's timeline (CUDA events, not waited for until the end), or host clock times on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda, self.points = device.type == "cuda", []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append((name, event))
        else:
            self.points.append((name, time.perf_counter()))

    def durations_ms(self) -> list[tuple[str, float]]:
        """(name of the phase that ends at a mark, its milliseconds), for each mark after the first."""
        if self.cuda:
            torch.cuda.synchronize()
            return [(name, start.elapsed_time(end)) for (_, start), (name, end) in zip(self.points, self.points[1:])]
        return [(name, 1000 * (end - start)) for (_, start), (name, end) in zip(self.points, self.points[1:])]


def time_steps(trainer, batches, at_step: int, steps: int, device: torch.device) -> dict:
    """Train `steps` steps as train() does, marking where backward ends, the gradients arrive and the optimizer
    step ends; returns the wall time and each phase's total, in ms."""
    marks = Marks(device)
    gradients_wait = trainer.layout.gradients.wait

    def marked_wait():
        marks.mark("forward+backward")
        gradients_wait()
        marks.mark("gradient wait")
    trainer.layout.gradients.wait = marked_wait
    train_gpt.device_synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start, moved = time.perf_counter(), dict(train_gpt.HOST_TIER_BYTES)
    pending = None
    for step in range(at_step, at_step + steps):
        marks.mark("start")
        loss = train_gpt.forward_backward(trainer, batches, step)
        grad_squares = trainer.layout.gradient_squares()
        train_gpt.optimizer_step(trainer, step)
        marks.mark("optimizer")
        stats = train_gpt.start_copy_to_host(trainer.layout.step_stats(loss, grad_squares, stop=False))
        if pending is not None:
            pending()  # read a step late, as the trainer does
        pending = stats
    pending()
    train_gpt.device_synchronize(device)
    wall_ms = 1000 * (time.perf_counter() - start)
    totals = {}
    for name, ms in marks.durations_ms():
        if name != "start":
            totals[name] = totals.get(name, 0.0) + ms
    host = {kind: train_gpt.HOST_TIER_BYTES[kind] - moved.get(kind, 0) for kind in ("read", "written")}
    return dict(wall_ms=wall_ms, host=host, **totals)


def report(args, ctx, source: str, at_step: int, steps: int, phases: dict) -> None:
    ms = phases["wall_ms"] / steps
    seq_len = train_gpt.batch_shape(at_step, args)[0]
    tokens_per_gpu = args.seqs_per_step * seq_len / ctx.world_size
    window = train_gpt.window_tokens(at_step, args)
    flops_per_gpu = model_flops_per_token(args, window, seq_len) * tokens_per_gpu
    peak = next((flops for name, flops in PEAK_BF16 if name in torch.cuda.get_device_name(ctx.device)), None) \
        if ctx.device.type == "cuda" else None
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else \
        train_gpt.device_description(ctx.device)
    lines = [f"benchmark: {ctx.world_size} x {device}, preset {args.preset}, {steps} steps at step {at_step} (windows "
             f"{window} tokens), data: {source}",
             f"ms per step: {ms:.2f}   tokens/s per GPU: {tokens_per_gpu / ms * 1000:,.0f}",
             f"model FLOPs per step per GPU: {flops_per_gpu / 1e12:.2f} TFLOP (6 per matmul weight and token, 12 per "
             f"query, key and head dim of attention)   MFU: "
             + (f"{flops_per_gpu / (ms / 1000) / peak:.1%} of {peak / 1e12:.0f} TFLOP/s dense bf16" if peak
                else "unknown peak for this device"),
             train_gpt.peak_memory_line(ctx.device),
             f"host tier per step and GPU: {phases['host']['read'] / steps / 1e6:,.1f} MB read to the GPU, "
             f"{phases['host']['written'] / steps / 1e6:,.1f} MB written back",
             "per step: " + ", ".join(f"{name} {phases[name] / steps:.2f} ms" for name in
                                      ("forward+backward", "gradient wait", "optimizer") if name in phases)]
    if ctx.is_master:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
