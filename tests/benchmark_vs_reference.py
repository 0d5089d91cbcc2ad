"""Side by side with a record's own trainer on one GPU, with the same work per step in both. Not a test.

    python tests/benchmark_vs_reference.py                 # against record #89, which the record89 preset ports
    python tests/benchmark_vs_reference.py --against 23    # against record #23 (2025-05-25)

#89: modded-nanogpt's train_gpt.py at f411b3d3, rebuilt from ../shared/head_cpu (its train_gpt.py with head.diff
undone, beside #89's own Triton kernel files). Both trainers run #89's schedule compressed to --steps steps (its three
stages and extension in #89's proportions), on one GPU as #89 runs there: 8 micro-batches a step, of 16K, 32K and 48K
tokens by stage. Two changes to #89, both because the device reaches no network: FlashAttention 3, which #89 fetches
from the Hugging Face hub at import, is torch's own varlen_attn (FlashAttention 2's kernels, so #89's attention is
slower here than on its record), and the GPT-2 ranks it reads at import come from data/.cache/gpt2.tiktoken (`python
data/gpt2_tokenizer.py --fetch`, then carry data/.cache to the device). It validates once, on one batch, at the end.

#23: ../shared/reference/train_gpt_2025-05-25.py (kept for timing only), patched as its README says (world size 1,
fewer steps, one validation sequence at the end); ours runs with --seqs_per_step 1 and 48K-token sequences in every
stage, #23's work per step.

Both read the same shards: FineWeb's when data/fineweb10B has them, synthetic ones of the same format otherwise. It
prints each one's ms per step over the steps after the first ten, their ratio (ours / reference) and each one's peak
memory.
"""
import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.nn.attention import varlen

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "data"))
import gpt2_tokenizer  # noqa: E402
import train_gpt  # noqa: E402
from benchmark_gpu import synthetic_shards  # noqa: E402
from gpu_session import HEAD_CPU_FILES  # noqa: E402
from head_weights import HEAD_CPU, scheduled_steps  # noqa: E402
from tool_inputs import need, need_at_least, need_files, run_tool  # noqa: E402

SKIPPED_STEPS = 10  # lazy initialisation and the first steps' compiles
REFERENCE_23 = REPO_ROOT.parent / "shared" / "reference" / "train_gpt_2025-05-25.py"
FINEWEB = REPO_ROOT / "data" / "fineweb10B"
STEP_TOKENS_89 = 24 * 2048 * 8  # #89's largest step (its last stage), tokens
VAL_BATCH_89 = 4 * 64 * 1024 * 8  # #89's validation batch, tokens (kept: it also sizes #89's rotary tables)
# #89's FlashAttention 3 call, answered by torch's varlen attention (FlashAttention 2 on CUDA)
TORCH_VARLEN_ATTENTION = """from torch.nn.attention.varlen import varlen_attn
class TorchVarlenAttention:  # benchmark_vs_reference.py: FA3 comes from the Hugging Face hub, out of the device's reach
    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, window_size):
        assert causal and window_size[1] == 0  # (the only use: causal, a window of past tokens)
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                           window_size=window_size)
flash_attn_interface = TorchVarlenAttention"""

# #89's GPT-2 tokenizer from the ranks file, as tiktoken builds its own (r50k_base's pattern; EOT 50256), in #89's
# process without importing this repository
GPT2_OFFLINE = """import tiktoken
import tiktoken.load
from tiktoken_ext import openai_public
_GPT2 = tiktoken.Encoding(name="gpt2", pat_str=openai_public.r50k_pat_str, special_tokens={{"<|endoftext|>": 50256}},
                          mergeable_ranks=tiktoken.load.load_tiktoken_bpe({ranks!r}))
tiktoken.get_encoding = lambda name: _GPT2  # benchmark_vs_reference.py: the device reaches no network"""


def edited(source: str, edits: list[tuple[str, str]], what: str) -> str:
    """source with each (line pattern, replacement) made once; an edit whose line is gone stops the benchmark."""
    for pattern, replacement in edits:
        source, n = re.subn(pattern, lambda _: replacement, source, count=1, flags=re.M)
        if n != 1:
            raise SystemExit(f"{what} no longer has a line matching {pattern!r}: update this script")
    return source


def patched_23(source: str, steps: int) -> str:
    """#23 with its README's changes for one GPU: no world-size assert, `steps` steps, one validation sequence,
    validation only at the end."""
    return edited(source, [(r"^assert world_size == 8.*$", "pass"),
                           (r"^    num_iterations = 1770 .*$", f"    num_iterations = {steps}"),
                           (r"^    val_tokens = 10485760 .*$", "    val_tokens = 262144"),
                           (r"^    val_loss_every = 125 .*$", "    val_loss_every = 0")], "the reference")


def undo_diff(text: str, diff: str, head_cpu: Path) -> str:
    """The file a unified diff was taken from, given the file it gives (text): each hunk's new lines put back as its
    old ones, last hunk first so that the line numbers hold."""
    lines = text.splitlines(keepends=True)
    for hunk in reversed(re.split(r"^(?=@@ )", diff, flags=re.M)[1:]):
        header, *body = hunk.splitlines(keepends=True)
        start = int(re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", header)[1]) - 1
        new, old = ([line[1:] for line in body if line[:1] in kept] for kept in (" +", " -"))
        if lines[start:start + len(new)] != new:
            raise SystemExit(f"{head_cpu / 'head.diff'}'s hunk {header.strip()} does not match its train_gpt.py: "
                             "head_cpu changed; update this script")
        lines[start:start + len(new)] = old
    return "".join(lines)


def patched_89(steps: int, head_cpu: Path) -> str:
    """#89's own file, from head_cpu, for one GPU without network: torch's varlen attention for FA3, the GPT-2 ranks
    from this repository, #89's schedule in `steps` steps, one validation batch at the end."""
    source = undo_diff((head_cpu / "train_gpt.py").read_text(), (head_cpu / "head.diff").read_text(), head_cpu)
    if "HEAD_CPU" in source:
        raise SystemExit("head_cpu's train_gpt.py with head.diff undone still mentions HEAD_CPU: update this script")
    scheduled = scheduled_steps(steps)
    return edited(source, [
        (r"^from kernels import get_kernel$", ""),
        (r"^flash_attn_interface = get_kernel\(.*$", TORCH_VARLEN_ATTENTION),
        (r"^import tiktoken$", GPT2_OFFLINE.format(ranks=str(gpt2_tokenizer.ranks_file()))),
        (r"^    num_scheduled_iterations: int = 1270 .*$", f"    num_scheduled_iterations: int = {scheduled}"),
        (r"^    num_extension_iterations: int = 15 .*$", f"    num_extension_iterations: int = {steps - scheduled}"),
        (r"^    val_tokens: int = 10485760 .*$", f"    val_tokens: int = {VAL_BATCH_89}"),
        (r"^    val_loss_every: int = 250 .*$", "    val_loss_every: int = 0")], "#89's train_gpt.py")


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
    parser.add_argument("--against", choices=("89", "23"), default="89", help="the record whose trainer to time")
    parser.add_argument("--steps", type=int, default=None, help="steps (default: 60 against #89, 40 against #23)")
    parser.add_argument("--head_cpu", type=Path, default=HEAD_CPU,
                        help="the head_cpu folder #89's file is rebuilt from (a copy travels to a GPU machine in "
                             ".carry/: tests/gpu_session.py --prepare)")
    parser.add_argument("--data_dir", type=Path, default=None,
                        help="the folder of fineweb_{train,val}_*.bin shards both read (default: data/fineweb10B, "
                             "or synthetic shards when it has none)")
    flags = parser.parse_args()
    steps = (60 if flags.against == "89" else 40) if flags.steps is None else flags.steps
    need_at_least("--steps", steps, SKIPPED_STEPS + 1, f"the first {SKIPPED_STEPS} are not timed")
    need(flags.data_dir is None or flags.data_dir.is_dir(), f"--data_dir {flags.data_dir} is not a folder: name the "
         "folder of the fineweb_*.bin shards, or leave the flag out")
    data_dir = flags.data_dir or FINEWEB
    if flags.against == "23":
        need(REFERENCE_23.is_file(), f"--against 23: record #23's file {REFERENCE_23} is missing; it sits beside the "
             "repository in ../shared/reference")
    if flags.against == "89":
        need_files("--head_cpu", flags.head_cpu, HEAD_CPU_FILES, "record #89's trainer")
        if gpt2_tokenizer.ranks_file() is None:
            raise SystemExit(f"#89 reads GPT-2's ranks at import: fetch them with `{gpt2_tokenizer.FETCH_COMMAND}` "
                             "(and carry data/.cache to a device)")
        if "window_size" not in inspect.signature(varlen.varlen_attn).parameters:
            raise SystemExit(f"torch {torch.__version__}'s varlen_attn takes no window_size (torch 2.10 and later "
                             "do), so #89's sliding windows cannot run on it here")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        data = scratch / "data" / "fineweb10B"
        data.mkdir(parents=True)
        fineweb = sorted(data_dir.glob("fineweb_*.bin"))
        if fineweb:
            for shard in fineweb:
                (data / shard.name).symlink_to(shard)
            source = f"the shards in {data_dir}"
        else:
            # #89 warms up on 14 of its steps and validates on each, from the same files, which it does not cycle
            files = (synthetic_shards(data, (steps + 50) * STEP_TOKENS_89 + 1, val_tokens=20 * VAL_BATCH_89 // 8)
                     if flags.against == "89" else synthetic_shards(data, (steps + 2) * 48 * 1024 + 1))
            for name in Path(files["train_files"]).parent.glob("synthetic_*.bin"):
                name.rename(data / name.name.replace("synthetic_", "fineweb_"))
            source = "synthetic shards"
        if flags.against == "89":
            for kernels in ("triton_kernels.py", "dc_triton_kernels.py"):
                (scratch / kernels).write_text((flags.head_cpu / kernels).read_text())
            (scratch / "train_gpt.py").write_text(patched_89(steps, flags.head_cpu))
            work = ["--num_iterations", str(steps),
                    "--extension_steps", str(steps - scheduled_steps(steps))]
        else:
            (scratch / "train_gpt.py").write_text(patched_23(REFERENCE_23.read_text(), steps))
            work = ["--seqs_per_step", "1", "--num_iterations", str(steps), "--train_seq_len", "49152",
                    "--doc_max_tokens", "2048"]
        reference = subprocess.run(torchrun + ["train_gpt.py"], cwd=scratch, capture_output=True, text=True)
        if reference.returncode:
            raise SystemExit(f"the reference failed:\n{reference.stdout[-3000:]}\n{reference.stderr[-3000:]}")
        ours = subprocess.run(torchrun + [str(REPO_ROOT / "train_gpt.py"), *work,
                                          "--val_loss_every", "0", "--val_tokens", "262144",
                                          "--train_files", str(data / "fineweb_train_*.bin"),
                                          "--val_files", str(data / "fineweb_val_*.bin"),
                                          "--log_dir", str(scratch / "ours"), "--run_id", "ours"],
                              cwd=scratch, capture_output=True, text=True, env=dict(os.environ))
        if ours.returncode:
            raise SystemExit(f"ours failed:\n{ours.stdout[-3000:]}\n{ours.stderr[-3000:]}")
        reference_ms, reference_memory = timed(reference.stdout, steps)
        ours_ms, ours_memory = timed(ours.stdout, steps)
    work_per_step = ("#89's: 8 micro-batches of 16K/32K/48K tokens by stage, its schedule in "
                     f"{steps} steps" if flags.against == "89" else "one 48K-token sequence")
    print(f"one GPU, against #{flags.against}, {work_per_step} ({source}), ms per step over steps "
          f"{SKIPPED_STEPS + 1}-{steps}:")
    print(f"  reference: {reference_ms:8.2f} ms   {reference_memory}")
    print(f"  ours:      {ours_ms:8.2f} ms   {ours_memory}")
    print(f"  ratio ours / reference: {ours_ms / reference_ms:.3f} (the goal: at most 1.00)")


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
