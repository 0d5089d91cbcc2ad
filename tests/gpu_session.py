"""Every GPU check in one call, for a lent GPU machine: no install, no network, the machine's own python3 and PyTorch
(2.11 on the lent machines, where the project pins 2.13), one report.

    python tests/gpu_session.py --prepare      # here, before: copy what cannot travel into .carry/, fetch the ranks
    python3 tests/gpu_session.py               # there, from the repository root (carry .carry and data/.cache)
    python tests/gpu_session.py --dry_run      # any machine: every step that needs no GPU, the checks "not run"

It prints the machine, then says in one line each what is missing from what the checks read (GPT-2's ranks in
data/.cache, record #89's trainer in .carry/head_cpu, Triton), makes FineWeb-format synthetic shards when
data/fineweb10B has none, and runs each check in a process of its own under a time budget (a flag each; the defaults
sum to 7.7 minutes): tests/test_cuda.py with a time limit per test, tests/benchmark_gpu.py (the record preset, #92's,
on the GPUs here), and tests/benchmark_vs_reference.py (the same GPU, this file against #89's own trainer). A check
that outlives its budget is stopped, its process group killed, and reported as cut. The report (gpu_report.txt: the
machine, each check's result, figures and first lines of each failure) and each check's full log go to $OUT when
it is set, else to logs/gpu_session/<time>/. The exit status is 1 when a check failed or was cut, or something a
check needs is missing, else 0; a dry run's checks are "not run", which is no failure.
"""
import argparse
import contextlib
import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
from tool_inputs import need, need_at_least, need_files, need_out_folder, open_own, run_tool  # noqa: E402

CARRY = REPO_ROOT / ".carry"
SHARED_HEAD_CPU = REPO_ROOT.parent / "shared" / "head_cpu"
HEAD_CPU_FILES = ("train_gpt.py", "head.diff", "triton_kernels.py", "dc_triton_kernels.py")
RANKS = REPO_ROOT / "data" / ".cache" / "gpt2.tiktoken"
FINEWEB = REPO_ROOT / "data" / "fineweb10B"
REFERENCE_STEPS = 30  # #89's schedule compressed to 30 steps: 20 timed after the 10 that compile
BENCHMARK_STEPS = 20
TEST_TIME_LIMIT_S = 120  # one test of tests/test_cuda.py (the record-shape step compiles the record model)
# seconds for each check, by default: 7.7 minutes with the report's own ~10 s, inside a lent machine's 8
BUDGETS_S = {"tests": 200, "benchmark": 130, "reference": 130}
RUN_TOOL_CALL = 'run(command="python3 tests/gpu_session.py", carry=[".carry", "data/.cache"], timeout_s=540)'


@dataclass
class Check:
    """One GPU check: its command, the report's figure lines (a regex over its log), its budget in seconds."""
    name: str
    command: list[str]
    figures: str
    budget_s: float
    env: dict = field(default_factory=dict)
    status: str = "not run"
    reason: str = ""
    seconds: float = 0.0
    log: str = ""


def run_check(check: Check, log_path: Path) -> Check:
    """Run the check's command in a process group of its own, its output into log_path; past its budget the group
    is terminated (then killed), and the check reported as cut."""
    start = time.monotonic()
    with open_own(log_path) as log:
        process = subprocess.Popen(check.command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **check.env})
        try:
            rc = process.wait(timeout=check.budget_s)
            check.status, check.reason = ("passed", "") if rc == 0 else ("FAILED", f"exit status {rc}")
        except subprocess.TimeoutExpired:
            stop_group(process)
            check.status, check.reason = "CUT", f"still running at its budget of {check.budget_s:g} s: stopped"
    check.seconds = time.monotonic() - start
    check.log = log_path.read_text(errors="replace")
    return check


def stop_group(process: subprocess.Popen) -> None:
    """SIGINT to the process's group (pytest then prints what failed so far, as on Ctrl-C), SIGTERM 10 s later if
    it still runs; then SIGKILL to whatever is left of the group (a child that outlived its parent included)."""
    for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def check_lines(check: Check) -> list[str]:
    """The report's lines for one check: its result, its figures, and on failure the first lines of what failed."""
    took = f", {check.seconds:.0f} s of {check.budget_s:g}" if check.status != "not run" else ""
    lines = [f"[{check.status}] {check.name}{took}" + (f": {check.reason}" if check.reason else "")]
    lines += ["    " + line for line in check.log.splitlines() if re.search(check.figures, line)]
    if check.status in ("FAILED", "CUT"):
        tail = [line for line in check.log.splitlines() if line.strip()][-30:]
        lines += ["    | " + line for line in tail]
    return lines


def machine_lines(torch) -> list[str]:
    """The GPU (name, memory, driver) and the versions of Python, torch, CUDA and Triton."""
    lines = []
    smi = shutil.which("nvidia-smi")
    if smi:
        query = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        lines += [f"GPU: {gpu.strip()}" for gpu in query.stdout.splitlines()] or [f"nvidia-smi: {query.stderr}"]
    else:
        lines.append("GPU: none (no nvidia-smi)")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    pinned = next(line.split("==")[1].strip() for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    lines.append(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
                 f"{torch.cuda.device_count()} GPU(s) visible; the project pins {pinned}, used as found), "
                 f"Triton {triton_version}")
    return lines


def missing_inputs(torch, head_cpu: Path) -> dict[str, str]:
    """What a check needs that is not here, by check name: one line saying what to carry or do."""
    missing = {}
    if not RANKS.is_file():
        for name in ("benchmark", "reference"):
            missing[name] = (f"no GPT-2 ranks at {RANKS.relative_to(REPO_ROOT)} (the record's prefix loss reads "
                             "them): run `python tests/gpu_session.py --prepare` here and carry data/.cache")
    absent = [name for name in HEAD_CPU_FILES if not (head_cpu / name).is_file()]
    if absent:
        missing["reference"] = (f"no record #89 trainer at {head_cpu} ({', '.join(absent)} missing): run "
                                "`python tests/gpu_session.py --prepare` here and carry .carry")
    else:
        from benchmark_vs_reference import patched_89
        try:  # #89's file rebuilt and parsed now, not after the other checks' minutes
            compile(patched_89(REFERENCE_STEPS, head_cpu), "train_gpt.py", "exec")
        except (SystemExit, SyntaxError) as e:
            missing["reference"] = f"record #89's file cannot be rebuilt from {head_cpu}: {e}"
    try:
        import triton  # noqa: F401
    except ImportError:
        if torch.cuda.is_available():  # (a CPU's dry run compiles nothing)
            for name in ("reference", "benchmark"):
                missing.setdefault(name, f"Triton is not installed with torch {torch.__version__} (#89's kernels "
                                         "and the compiled model need it)")
    from torch.nn.attention import varlen
    import inspect
    if "window_size" not in inspect.signature(varlen.varlen_attn).parameters:
        missing.setdefault("reference", f"torch {torch.__version__}'s varlen_attn takes no window_size: #89's "
                                        "sliding windows cannot run on it")
    return missing


def shards(scratch: Path, scale: float = 1.0) -> tuple[Path, str]:
    """The folder of FineWeb-named shards both benchmarks read: data/fineweb10B's, else synthetic ones in scratch,
    sized for the longer of the two runs (#89 in its last stage, plus its validation), times scale."""
    if sorted(FINEWEB.glob("fineweb_train_*.bin")) and sorted(FINEWEB.glob("fineweb_val_*.bin")):
        return FINEWEB, f"FineWeb ({FINEWEB})"
    from benchmark_gpu import synthetic_shards
    from benchmark_vs_reference import STEP_TOKENS_89, VAL_BATCH_89
    folder = scratch / "fineweb10B"
    folder.mkdir(parents=True, exist_ok=True)
    files = synthetic_shards(folder, int(scale * (REFERENCE_STEPS + 50) * STEP_TOKENS_89) + 1,
                             val_tokens=int(scale * 20 * VAL_BATCH_89 // 8))
    for name in ("train_files", "val_files"):
        for path in map(Path, sorted(folder.glob(Path(files[name]).name))):
            path.rename(folder / path.name.replace("synthetic_", "fineweb_"))
    return folder, f"synthetic shards in FineWeb's format ({folder})"


def planned_checks(flags, data: Path, head_cpu: Path, gpus: int) -> list[Check]:
    python = sys.executable
    return [
        Check("tests", [python, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider",
                        f"--time_limit_per_test={flags.test_time_limit}", "tests/test_cuda.py"],
              r"^(FAILED|ERROR|SKIPPED) |\d+ (passed|failed|skipped|errors?)\b", flags.tests_budget),
        Check("benchmark", [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max(gpus, 1)}",
                            "tests/benchmark_gpu.py", "--steps", str(BENCHMARK_STEPS),
                            "--train_files", str(data / "fineweb_train_*.bin"),
                            "--val_files", str(data / "fineweb_val_*.bin")],
              r"^(benchmark:|host tier|ms per step|model FLOPs|peak memory|per step:)", flags.benchmark_budget),
        Check("reference", [python, "tests/benchmark_vs_reference.py", "--steps", str(REFERENCE_STEPS),
                            "--data_dir", str(data), "--head_cpu", str(head_cpu)],
              r"^(one GPU|  reference:|  ours:|  ratio)", flags.reference_budget),
    ]


def prepare(head_cpu_source: Path) -> int:
    """Here, before a GPU is lent: #89's trainer copied into .carry/head_cpu, GPT-2's ranks fetched into
    data/.cache; prints the device call that carries both."""
    need_files("--head_cpu", head_cpu_source, HEAD_CPU_FILES, "record #89's trainer")
    target = CARRY / "head_cpu"
    target.mkdir(parents=True, exist_ok=True)
    for name in HEAD_CPU_FILES:
        shutil.copyfile(head_cpu_source / name, target / name)
    if not RANKS.is_file():
        if subprocess.run([sys.executable, "data/gpt2_tokenizer.py", "--fetch"], cwd=REPO_ROOT).returncode:
            print("gpu_session: fetching GPT-2's ranks failed (above); the checks need them", file=sys.stderr)
            return 1
    print(f"ready: {target.relative_to(REPO_ROOT)} and {RANKS.relative_to(REPO_ROOT)}; on the GPU machine: "
          f"{RUN_TOOL_CALL}")
    return 0


def report_folder(flags) -> Path:
    for flag, folder in (("--out", flags.out), ("$OUT", os.environ.get("OUT"))):
        if folder:
            need_out_folder(flag, Path(folder))
            return Path(folder)
    return REPO_ROOT / "logs" / "gpu_session" / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="copy what cannot travel into .carry/, then stop")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="every step but the GPU checks")
    parser.add_argument("--only", default="tests,benchmark,reference", help="the checks to run, comma-separated")
    parser.add_argument("--head_cpu", type=Path, default=None,
                        help="record #89's trainer (default: .carry/head_cpu, else ../shared/head_cpu)")
    parser.add_argument("--out", default=None, help="the report's folder (default: $OUT, else logs/gpu_session/)")
    parser.add_argument("--tests_budget", type=float, default=BUDGETS_S["tests"], help="seconds for tests/test_cuda.py")
    parser.add_argument("--test_time_limit", type=float, default=TEST_TIME_LIMIT_S, help="seconds for one test")
    parser.add_argument("--benchmark_budget", type=float, default=BUDGETS_S["benchmark"],
                        help="seconds for tests/benchmark_gpu.py")
    parser.add_argument("--reference_budget", type=float, default=BUDGETS_S["reference"],
                        help="seconds for tests/benchmark_vs_reference.py (both trainers, each compiled; #89's "
                             "warm-up compiles 14 steps' shapes: give it more where the lease allows)")
    flags = parser.parse_args(argv)
    for name in ("tests_budget", "test_time_limit", "benchmark_budget", "reference_budget"):
        need_at_least(f"--{name}", getattr(flags, name), 1, "seconds, after which the check or test is stopped")
    head_cpu = flags.head_cpu or (CARRY / "head_cpu" if (CARRY / "head_cpu").is_dir() else SHARED_HEAD_CPU)
    if flags.prepare:
        return prepare(flags.head_cpu or SHARED_HEAD_CPU)
    only = set(flags.only.split(","))
    unknown = only - {"tests", "benchmark", "reference"}
    need(not unknown, f"--only {flags.only}: no check named {', '.join(sorted(unknown))}; name some of tests, "
         "benchmark, reference")

    out = report_folder(flags)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    import torch
    lines = [f"GPU session, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"commit {git_description()}", *machine_lines(torch)]
    print("\n".join(lines), flush=True)
    missing = missing_inputs(torch, head_cpu)
    for line in dict.fromkeys(missing.values()):
        print(f"missing: {line}", flush=True)
        lines.append(f"missing: {line}")
    cuda = torch.cuda.is_available() and not flags.dry_run
    no_gpu = ("dry run (--dry_run)" if torch.cuda.is_available()
              else f"no CUDA: torch {torch.__version__} sees no GPU")
    with tempfile.TemporaryDirectory(prefix="gpu_session_") as scratch:
        data, source = shards(Path(scratch), 1.0 if cuda else 0.01)  # (no GPU: the format, not the size)
        lines.append(f"data: {source}")
        print(lines[-1], flush=True)
        checks = planned_checks(flags, data, head_cpu, torch.cuda.device_count())
        if not cuda and "benchmark" in only:  # the benchmark's own code, rehearsed on this CPU at the tiny size
            checks.append(Check("CPU rehearsal", [sys.executable, "tests/benchmark_gpu.py", "--preset", "tiny",
                                                  "--steps", "2", "--untimed_steps", "1"],
                                r"^(benchmark:|ms per step)", budget_s=120))
        for check in checks:
            if check.name not in only | {"CPU rehearsal"}:  # (the rehearsal: only with the benchmark)
                check.reason = "not asked for (--only)"
            elif check.name in missing:
                check.reason = missing[check.name]
            elif not cuda and check.name != "CPU rehearsal":
                check.reason = no_gpu
            else:
                print(f"running {check.name} (budget {check.budget_s:g} s): {' '.join(check.command[1:])}",
                      flush=True)
                run_check(check, out / f"{check.name.replace(' ', '_')}.log")
            print("\n".join(check_lines(check)), flush=True)
            lines += check_lines(check)
    failed = [c.name for c in checks if c.status in ("FAILED", "CUT")
              or (c.status == "not run" and c.name in missing and c.name in only)]
    lines.append(f"{len(failed)} of {len(checks)} checks failed, were cut or lack an input" + (
        f" ({', '.join(failed)})" if failed else "") + f"; {time.monotonic() - start:.0f} s in all")
    with open_own(out / "gpu_report.txt") as report:
        report.write("\n".join(lines) + "\n")
    print(lines[-1], f"report: {out / 'gpu_report.txt'}", sep="\n", flush=True)
    return 1 if failed else 0


def git_description() -> str:
    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                               text=True)
    return described.stdout.strip() or "unknown (no git here)"


if __name__ == "__main__":
    run_tool(main)
