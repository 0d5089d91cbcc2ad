"""tests/gpu_session.py rehearsed on the CPU: its dry run, a hung check cut at its budget, a hung test cut at its
limit, and a missing input named at the start."""
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train_gpt

import gpu_session
from gpu_session import Check, check_lines, run_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's dry run (a GPU machine runs the checks)")
def test_the_dry_run_writes_a_report_with_every_gpu_check_not_run_for_want_of_cuda_within_8_minutes(tmp_path):
    start = time.monotonic()
    assert gpu_session.main(["--dry_run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "gpu_report.txt").read_text()
    for name in ("tests", "benchmark", "reference"):
        assert f"[not run] {name}: no CUDA: torch {torch.__version__} sees no GPU" in report
    assert "data: synthetic shards in FineWeb's format" in report and "missing:" not in report
    assert "[passed] CPU rehearsal" in report and "    ms per step: " in report  # benchmark_gpu.py's own code ran
    assert "0 of 4 checks failed" in report
    # the checks' default budgets within the 8 minutes a lent machine gives, less 20 s for the session's own work
    # (the shards, the report), which here (with the CPU rehearsal, on 2 cores where the GPU machine has 16) takes
    # well under a minute: bounded apart, so that a busy CI machine does not fail the budgets' sum
    assert sum(gpu_session.BUDGETS_S.values()) <= 8 * 60 - 20 and time.monotonic() - start < 60


def test_the_flat_collectives_fall_back_to_their_torch_2_11_names():
    # torch 2.11 (the lent GPU machines') has all_gather_into_tensor and reduce_scatter_tensor only
    run = subprocess.run([sys.executable, "-c", """
import torch, torch.distributed as dist
del dist.all_gather_single, dist.reduce_scatter_single
import train_gpt
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out = torch.zeros(3)
train_gpt.all_gather_single(out, torch.arange(3.0))
train_gpt.reduce_scatter_single(mine := torch.zeros(3), torch.arange(3.0) + 1)
print(out.tolist(), mine.tolist())
"""], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split("\n")[-2] == "[0.0, 1.0, 2.0] [1.0, 2.0, 3.0]", run.stderr[-2000:]


def test_a_missing_input_is_named_at_the_start_and_fails_the_session(tmp_path):
    empty = tmp_path / "head_cpu"
    empty.mkdir()
    assert gpu_session.main(["--dry_run", "--out", str(tmp_path / "out"), "--head_cpu", str(empty),
                             "--only", "reference"]) == 1
    report = (tmp_path / "out" / "gpu_report.txt").read_text().splitlines()
    missing = next(i for i, line in enumerate(report) if line.startswith("missing: no record #89 trainer"))
    assert missing < next(i for i, line in enumerate(report) if line.startswith("[")), report  # before any check
    assert "carry .carry" in report[missing] and "[not run] reference: no record #89 trainer" in "\n".join(report)


def test_a_check_that_hangs_is_cut_at_its_budget_with_its_whole_process_group(tmp_path):
    # the check starts a child of its own (as torchrun does) and sleeps; both must be gone when the check returns
    hang = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); print('child', child.pid, flush=True); time.sleep(120)")
    start = time.monotonic()
    check = run_check(Check("sleeper", [sys.executable, "-c", hang], r"^child", budget_s=3), tmp_path / "s.log")
    assert time.monotonic() - start < 20
    assert check.status == "CUT" and "budget of 3 s" in check.reason
    child = int(check.log.split()[1])
    deadline = time.monotonic() + 2  # (SIGKILL was sent; its delivery takes a moment)
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)
    assert check_lines(check)[0].startswith("[CUT] sleeper") and any("child" in line for line in check_lines(check))


def running(pid: int) -> bool:
    """Whether the process is alive: neither gone nor a zombie (an orphan that this sandbox's init may not reap)."""
    try:
        return " Z " not in open(f"/proc/{pid}/stat").read().split(")")[-1][:4]
    except FileNotFoundError:
        return False


def test_a_failing_check_reports_its_exit_status_and_last_lines(tmp_path):
    check = run_check(Check("failing", [sys.executable, "-c", "print('ms per step: 1.0'); raise SystemExit('boom')"],
                            r"^ms per step", budget_s=30), tmp_path / "f.log")
    lines = check_lines(check)
    assert lines[0].startswith("[FAILED] failing") and "exit status 1" in lines[0]
    assert "    ms per step: 1.0" in lines and "    | boom" in lines


def test_a_test_past_its_time_limit_fails_without_holding_the_session(tmp_path):
    (tmp_path / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(60)\n")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "--time_limit_per_test=1",
                          "-p", "no:cacheprovider", str(tmp_path / "test_sleeps.py")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert time.monotonic() - start < 30
    assert run.returncode == 1 and "ran past its limit of 1 s" in run.stdout, run.stdout[-2000:]


def test_the_synthetic_shards_documents_are_as_long_as_89s_loader_allows(tmp_path):
    # #89's loader holds at most (tokens // 300) documents a batch; FineWeb's average about 1,000 tokens
    from benchmark_gpu import synthetic_shards
    from benchmark_vs_reference import VAL_BATCH_89
    files = synthetic_shards(tmp_path, 10, val_tokens=4 * VAL_BATCH_89 // 8)
    tokens = np.fromfile(files["val_files"].replace("*", "000000"), dtype=np.uint16, offset=256 * 4)
    starts = np.flatnonzero(tokens == train_gpt.EOT_TOKEN)
    assert 900 < len(tokens) / len(starts) < 1100
    batch = VAL_BATCH_89 // 8
    assert max(np.count_nonzero((starts >= i) & (starts < i + batch)) for i in range(0, len(tokens), batch)) \
        <= batch // 300
