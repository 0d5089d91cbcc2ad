"""Side by side with the record's reference design (modded-nanogpt's train_gpt.py of 2025-05-25, kept in
../shared/reference for timing only) on one GPU, with the same work per step: one 48K-token sequence. Not a test.

    python tests/benchmark_vs_reference.py [--steps 40] [--reference ../shared/reference/train_gpt_2025-05-25.py]

The reference runs from a scratch copy patched as its README says (world size 1, fewer steps, one validation
sequence at the end); ours runs with --seqs_per_step 1 and 48K-token sequences in every stage (no staged batch).
Both read the same shards: FineWeb's when data/fineweb10B has them, synthetic ones of the same format otherwise. It
prints each one's ms per step over the steps after the first ten, their ratio (ours / reference) and each one's peak
memory.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from benchmark_gpu import synthetic_shards  # noqa: E402

SKIPPED_STEPS = 10  # lazy initialisation and the first steps' compiles


def patched_reference(source: str, steps: int) -> str:
    """The reference with its README's changes for one GPU: no world-size assert, `steps` steps, one validation
    sequence, validation only at the end."""
    edits = [(r"^assert world_size == 8.*$", "pass"),
             (r"^    num_iterations = 1770 .*$", f"    num_iterations = {steps}"),
             (r"^    val_tokens = 10485760 .*$", "    val_tokens = 262144"),
             (r"^    val_loss_every = 125 .*$", "    val_loss_every = 0")]
    for pattern, replacement in edits:
        source, n = re.subn(pattern, replacement, source, count=1, flags=re.M)
        if n != 1:
            raise SystemExit(f"the reference no longer has a line matching {pattern!r}: update this script")
    return source


def timed(log: str, steps: int) -> tuple[float, str]:
    """ms per step after the first SKIPPED_STEPS (from the step lines' cumulative train_time), and the peak memory
    line."""
    times = {int(m[1]): float(m[2]) for m in re.finditer(r"^step:(\d+)/\d+ (?:train_loss:\S+ )?train_time:(\d+)ms",
                                                          log, flags=re.M)}
    if SKIPPED_STEPS not in times or steps not in times:
        raise SystemExit(f"no step lines for steps {SKIPPED_STEPS} and {steps} in the log:\n{log[-2000:]}")
    memory = re.search(r"^peak memory allocated: .*$", log, flags=re.M)
    return (times[steps] - times[SKIPPED_STEPS]) / (steps - SKIPPED_STEPS), memory[0] if memory else "(no peak line)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reference", default=str(REPO_ROOT.parent / "shared/reference/train_gpt_2025-05-25.py"))
    flags = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        data = scratch / "data" / "fineweb10B"
        data.mkdir(parents=True)
        fineweb = sorted((REPO_ROOT / "data" / "fineweb10B").glob("fineweb_*.bin"))
        if fineweb:
            for shard in fineweb:
                (data / shard.name).symlink_to(shard)
            source = "FineWeb"
        else:
            files = synthetic_shards(data, (flags.steps + 2) * 48 * 1024 + 1)
            for name in Path(files["train_files"]).parent.glob("synthetic_*.bin"):
                name.rename(data / name.name.replace("synthetic_", "fineweb_"))
            source = "synthetic shards"
        (scratch / "train_gpt.py").write_text(patched_reference(Path(flags.reference).read_text(), flags.steps))
        reference = subprocess.run(torchrun + ["train_gpt.py"], cwd=scratch, capture_output=True, text=True)
        if reference.returncode:
            raise SystemExit(f"the reference failed:\n{reference.stdout[-3000:]}\n{reference.stderr[-3000:]}")
        ours = subprocess.run(torchrun + [str(REPO_ROOT / "train_gpt.py"), "--seqs_per_step", "1", "--num_iterations",
                                          str(flags.steps), "--train_seq_len", "49152", "--doc_max_tokens", "2048",
                                          "--val_loss_every", "0", "--val_tokens", "262144",
                                          "--train_files", str(data / "fineweb_train_*.bin"),
                                          "--val_files", str(data / "fineweb_val_*.bin"),
                                          "--log_dir", str(scratch / "ours"), "--run_id", "ours"],
                              cwd=scratch, capture_output=True, text=True, env=dict(os.environ))
        if ours.returncode:
            raise SystemExit(f"ours failed:\n{ours.stdout[-3000:]}\n{ours.stderr[-3000:]}")
        reference_ms, reference_memory = timed(reference.stdout, flags.steps)
        ours_ms, ours_memory = timed(ours.stdout, flags.steps)
    print(f"one GPU, one 48K-token sequence a step, {flags.steps} steps ({source}), ms per step over steps "
          f"{SKIPPED_STEPS + 1}-{flags.steps}:")
    print(f"  reference: {reference_ms:8.2f} ms   {reference_memory}")
    print(f"  ours:      {ours_ms:8.2f} ms   {ours_memory}")
    print(f"  ratio ours / reference: {ours_ms / reference_ms:.3f} (the goal: at most 1.00)")


if __name__ == "__main__":
    main()
