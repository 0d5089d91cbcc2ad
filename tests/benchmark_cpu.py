"""Benchmark (not a test) of a cpu-preset training step and evaluation, this train_gpt.py against an earlier one.

    python tests/benchmark_cpu.py [--against REV] [--steps 10] [--rounds 2] [--eval_tokens 131072]

Each version runs in its own process, in turn (`--rounds` times, alternating, on an otherwise idle machine), the
same steps of this file's cpu preset (its values are passed to both as flags, since presets change) from the same
seed; the figures are each version's best round. It prints tokens/s,
where a step's time goes (data, forward, backward, float64 gradient sums, gradient norm, optimizer), the CPU time
spent in the kernel (allocation churn shows there), the evaluation time of --eval_tokens validation tokens in
256-token sequences, and the ratios old / new. The losses of both must be identical, bit for bit.
"""
import argparse
import dataclasses
import functools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tool_inputs import need, need_at_least, run_tool

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINE = "03330e0"  # the last train_gpt.py before the CPU track's same-math speed-up
EVAL_SEQ_LEN = 256


def measure(source_dir: str, steps: int, eval_tokens: int, preset_flags: list[str]) -> dict:
    """In this process: the train_gpt.py in source_dir, `steps` timed steps after two untimed, then an evaluation."""
    sys.path.insert(0, source_dir)
    import torch
    import train_gpt
    getattr(train_gpt, "keep_freed_memory_for_reuse", lambda: None)()  # what its main() sets up, where it does
    # a flag the version lacks is left out: the version has that behaviour built in (for one older than the flag,
    # the preset's value is what it does)
    known = {field.name for field in dataclasses.fields(train_gpt.Hyperparameters)}
    preset_flags = [text for name, value in zip(preset_flags[::2], preset_flags[1::2]) if name[2:] in known
                    for text in (name, value)]
    args = train_gpt.parse_args(["--preset", "cpu", *preset_flags, "--val_seq_len", str(EVAL_SEQ_LEN),
                                 "--val_tokens", str(eval_tokens)], cuda=False)
    ctx = train_gpt.build_parallel_context(0, 1, torch.device("cpu"))
    # the cpu preset's one length (a file with a stage table gives it there, an older one in its flag, or an int), and
    # whether it samples #92's softmax (the loader then draws its candidates)
    seq_len = train_gpt.stage_seq_lens(args)[0] if hasattr(train_gpt, "stage_table") else \
        int(str(args.train_seq_len).split(",")[0])
    samples = train_gpt.candidate_counts(args) if hasattr(train_gpt, "stage_table") else \
        getattr(args, "sampled_softmax", "")
    sampled = dict(candidates=train_gpt.next_multiple_of_n(args.vocab_size, n=128)) if samples else {}
    batches = train_gpt.DistributedDataLoader(args.train_files, seq_len, args.seqs_per_step, 0, 1, torch.device("cpu"),
                                              **sampled)
    phases = dict.fromkeys(("data", "forward", "backward", "  of which float64 sums", "gradient norm",
                            "optimizer"), 0.0)

    def timed(phase, fn):
        def wrapped(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[phase] += time.perf_counter() - start
        return wrapped
    if hasattr(train_gpt, "build_trainer"):  # this file's functions
        trainer = train_gpt.build_trainer(args, ctx)
        trainer.model.forward = timed("forward", trainer.model.forward)
        forward_backward = timed("backward", train_gpt.forward_backward)  # (less the forward and the data, below)
        optimizer_step = timed("optimizer", train_gpt.optimizer_step)
        layout = getattr(trainer, "layout", trainer)  # (the buckets and the norm: on the trainer before its layout)
        layout.gradient_squares = timed("gradient norm", layout.gradient_squares)
        gradients = layout.gradients

        def train_step(data, step):
            loss = forward_backward(trainer, data, step)
            layout.gradient_squares()
            optimizer_step(trainer, step)
            return loss
        evaluate = functools.partial(train_gpt.evaluate, trainer)
    else:  # the baseline's one Run object
        run = train_gpt.build_run(args, ctx)
        run.compiled = timed("forward", run.compiled)
        run.accumulate = timed("backward", run.accumulate)
        run.gradient_squares = timed("gradient norm", run.gradient_squares)
        run.optimizer_step = timed("optimizer", run.optimizer_step)
        gradients, evaluate = run.gradients, run.evaluate

        def train_step(data, step):
            return run.train_step(data, step)[0]
    for name in ("_add_to_sum", "_take_sum"):
        if hasattr(gradients, name):
            setattr(gradients, name, timed("  of which float64 sums", getattr(gradients, name)))

    class TimedBatches:
        __next__ = staticmethod(timed("data", lambda: next(batches)))
        set_shape = staticmethod(lambda *shape: batches.set_shape(*shape))
        candidates = property(lambda self: getattr(batches, "candidates", None))
    data = TimedBatches()
    losses = [train_step(data, step).item() for step in range(2)]
    for phase in phases:
        phases[phase] = 0.0
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    losses += [train_step(data, step).item() for step in range(2, 2 + steps)]
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    phases["backward"] -= phases["forward"] + phases["data"]
    start = time.perf_counter()
    val_loss = evaluate(0)
    return dict(step_ms=1000 * wall / steps, tokens_per_s=steps * args.seqs_per_step * seq_len / wall,
                phases_ms={k: 1000 * v / steps for k, v in phases.items()},
                user_s=(after.ru_utime - before.ru_utime) / steps, sys_s=(after.ru_stime - before.ru_stime) / steps,
                eval_s=time.perf_counter() - start, val_loss=val_loss, losses=losses,
                threads=torch.get_num_threads(), tokens_per_step=args.seqs_per_step * seq_len)


def cpu_preset_flags() -> list[str]:
    """This train_gpt.py's cpu preset's flag values, for a version whose own preset may differ (its layer stack and
    stages: each version's own cpu preset's, the same model and schedule since the tables replaced their flags)."""
    sys.path.insert(0, str(REPO_ROOT))
    import train_gpt
    return [text for name, value in train_gpt.PRESETS["cpu"].flags.items() for text in (f"--{name}", str(value))]


def need_eval_tokens_in_a_shard(eval_tokens: int) -> None:
    """The evaluation reads its tokens (and one more, the last target) from one of the cpu preset's validation
    shards."""
    import train_gpt  # (imported by cpu_preset_flags)
    held = max(train_gpt.read_shard_header(f) for f in REPO_ROOT.glob(train_gpt.PRESETS["cpu"].flags["val_files"]))
    most = (held - 1) // EVAL_SEQ_LEN * EVAL_SEQ_LEN
    need(eval_tokens <= most, f"--eval_tokens {eval_tokens}: the cpu preset's validation shard holds {held:,} tokens; "
         f"give at most {most}")


def run_version(source_dir: str, steps: int, eval_tokens: int, preset_flags: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", source_dir, "--steps", str(steps),
                          "--eval_tokens", str(eval_tokens), "--preset_flags", json.dumps(preset_flags)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    if out.returncode:
        raise SystemExit(f"measuring {source_dir} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=BASELINE, help="the git revision whose train_gpt.py is 'old'")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eval_tokens", type=int, default=131072)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--preset_flags", help=argparse.SUPPRESS)
    flags = parser.parse_args()
    if flags.measure:
        print(json.dumps(measure(flags.measure, flags.steps, flags.eval_tokens, json.loads(flags.preset_flags))))
        return
    need_at_least("--steps", flags.steps, 1, "timed steps, after two untimed ones")
    need_at_least("--rounds", flags.rounds, 1, "rounds of each version")
    need(flags.eval_tokens > 0 and flags.eval_tokens % EVAL_SEQ_LEN == 0, f"--eval_tokens {flags.eval_tokens}: give "
         f"a positive multiple of {EVAL_SEQ_LEN} (the evaluation's sequences are {EVAL_SEQ_LEN} tokens)")
    has_file = subprocess.run(["git", "cat-file", "-e", f"{flags.against}:train_gpt.py"], cwd=REPO_ROOT,
                              capture_output=True).returncode == 0
    need(has_file, f"--against {flags.against}: no git revision of {REPO_ROOT} by that name has a train_gpt.py; give "
         "one that does (git log --oneline -- train_gpt.py)")
    preset_flags = cpu_preset_flags()
    need_eval_tokens_in_a_shard(flags.eval_tokens)
    with tempfile.TemporaryDirectory() as old_dir:
        source = subprocess.run(["git", "show", f"{flags.against}:train_gpt.py"], capture_output=True, text=True,
                                cwd=REPO_ROOT, check=True).stdout
        (Path(old_dir) / "train_gpt.py").write_text(source)
        rounds = {"old": [], "new": []}
        for _ in range(flags.rounds):
            for name, directory in (("old", old_dir), ("new", str(REPO_ROOT))):
                rounds[name].append(run_version(directory, flags.steps, flags.eval_tokens, preset_flags))
    old, new = (min(rounds[name], key=lambda r: r["step_ms"]) for name in ("old", "new"))
    eval_old, eval_new = (min(r["eval_s"] for r in rounds[name]) for name in ("old", "new"))
    print(f"cpu preset, {flags.steps} steps of {new['tokens_per_step']} tokens, best of {flags.rounds} rounds; "
          f"old = {flags.against}, {new['threads']} threads")
    print(f"{'':24}{'old':>10}{'new':>10}{'old/new':>10}")
    print(f"{'ms per step':24}{old['step_ms']:10.0f}{new['step_ms']:10.0f}{old['step_ms'] / new['step_ms']:10.2f}")
    print(f"{'tokens/s':24}{old['tokens_per_s']:10.0f}{new['tokens_per_s']:10.0f}"
          f"{new['tokens_per_s'] / old['tokens_per_s']:10.2f}  (new / old)")
    for phase in old["phases_ms"]:
        print(f"{'  ' + phase + ' ms':24}{old['phases_ms'][phase]:10.1f}{new['phases_ms'][phase]:10.1f}")
    print(f"{'CPU s per step: user':24}{old['user_s']:10.2f}{new['user_s']:10.2f}")
    print(f"{'               kernel':24}{old['sys_s']:10.2f}{new['sys_s']:10.2f}")
    print(f"{'evaluation s':24}{eval_old:10.1f}{eval_new:10.1f}{eval_old / eval_new:10.2f}  "
          f"({flags.eval_tokens} tokens; val loss {old['val_loss']:.6f} / {new['val_loss']:.6f})")
    same = old["losses"] == new["losses"] and old["val_loss"] == new["val_loss"]
    print(f"losses of the {len(new['losses'])} steps and the evaluation: " + ("identical" if same else
                                                                               f"DIFFERENT: {old['losses']} vs {new['losses']}"))


if __name__ == "__main__":
    run_tool(main)
