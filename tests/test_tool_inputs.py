"""The command-line tools in tests/ refuse a bad flag as train_gpt.py does: before any work, one line `error: ...` on
stderr naming the flag (or file) and its value, exit status 2, no traceback. Each tool runs as a user runs it."""
import concurrent.futures
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# (tool, its arguments, what the one line must name); {file}, {link}, {empty}, {holds_link} and {bad_shard} are
# paths made below.
# The tools that import train_gpt (seconds each) are asked one or two kinds each: the checks they share are
# tool_inputs.py's, asked of the fast tools in full
CASES = [
    ("benchmark_cpu", ["--steps", "0"], "--steps 0"),
    ("benchmark_cpu", ["--rounds", "-1"], "--rounds -1"),
    ("benchmark_cpu", ["--eval_tokens", "100"], "--eval_tokens 100"),  # less than one 256-token sequence
    ("benchmark_cpu", ["--against", "no-such-revision"], "--against no-such-revision"),
    ("benchmark_cpu", ["--eval_tokens", "1073741824"], "--eval_tokens 1073741824: the cpu preset's validation shard"),
    ("benchmark_gpu", ["--steps", "0"], "--steps 0"),
    ("benchmark_gpu", ["--train_files", "{empty}/none_*.bin"], "--train_files {empty}/none_*.bin"),
    ("benchmark_tables", ["--zero", "-1"], "--zero -1"),
    ("benchmark_tables", ["--ranks", "1000"], "--ranks 1000"),  # more than the Shakespeare shard holds
    ("benchmark_tables", ["--shard", "{bad_shard}"], "{bad_shard}"),  # train_gpt's check of a shard names the file
    ("benchmark_vs_reference", ["--data_dir", "{file}"], "--data_dir {file}"),
    ("benchmark_vs_reference", ["--head_cpu", "{empty}"], "--head_cpu {empty}"),
    ("gpu_session", ["--out", "{file}"], "--out {file}"),
    ("gpu_session", ["--out", "{file}/report"], "--out {file}/report"),
    ("gpu_session", ["--out", "{link}"], "--out {link}"),
    ("gpu_session", ["--out", "{holds_link}"], "--out {holds_link} holds 1 symbolic link(s): gpu_report.txt (to"),
    ("head_weights", ["--out", "{holds_link}"], "--out {holds_link} holds 1 symbolic link(s)"),
    ("head_weights", ["--step", "0"], "--step 0: give a step of head_cpu's run, 1 to --steps 60"),
    ("head_weights", ["--out", "/proc/1/head"], "--out /proc/1/head: the tool cannot write there"),
    ("benchmark_vs_head", ["--out", "/proc/1/head"], "--out /proc/1/head: the tool cannot write there"),
    ("gpu_session", ["--out", "/proc/1/report"], "--out /proc/1/report: the tool cannot write there"),
    ("benchmark_vs_head", ["--out", "{holds_link}"], "--out {holds_link} holds 1 symbolic link(s)"),
    ("gpu_session", ["--only", "tests,bench"], "--only tests,bench"),
    ("gpu_session", ["--tests_budget", "0"], "--tests_budget 0"),
    ("gpu_session", ["--test_time_limit", "-1"], "--test_time_limit -1"),
    ("gpu_session", ["--prepare", "--head_cpu", "{empty}"], "--head_cpu {empty}"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every case's finished process, by index: all run at once, as many at a time as there are cores (the tools that
    import train_gpt spend seconds on the import before refusing)."""
    folder = tmp_path_factory.mktemp("tool_inputs")
    paths = dict(file=folder / "file", link=folder / "link", empty=folder / "empty", bad_shard=folder / "bad.bin",
                 holds_link=folder / "holds_link")
    paths["file"].write_text("not a folder")
    paths["holds_link"].mkdir()
    (paths["holds_link"] / "gpu_report.txt").symlink_to(paths["file"])  # where a tool's report or log would go
    paths["bad_shard"].write_bytes(b"not a shard")
    paths["empty"].mkdir()
    paths["link"].symlink_to(paths["empty"])

    def run(case):
        tool, argv, _ = case
        return subprocess.run([sys.executable, f"tests/{tool}.py", *(arg.format(**paths) for arg in argv)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "OUT"})  # (gpu_session reads $OUT)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        done = list(pool.map(run, CASES))
    yield paths, done
    assert list(paths["empty"].iterdir()) == []  # nothing was written through the links
    assert paths["file"].read_text() == "not a folder"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{tool}{' '.join(['', *argv])}" for tool, argv, _ in CASES])
def test_a_bad_flag_is_refused_in_one_line_naming_it_with_exit_status_2(refusals, index):
    paths, done = refusals
    named, result = CASES[index][2].format(**paths), done[index]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr[-2000:]
    assert named in result.stderr and result.stdout == "", (result.stderr, result.stdout)


def test_a_link_made_at_a_tools_file_after_its_folder_was_checked_is_refused_not_followed(tmp_path):
    """open_own, through which the tools write their logs, reports and saved tensors: O_NOFOLLOW."""
    from tool_inputs import FlagError, open_own
    precious, link = tmp_path / "precious.txt", tmp_path / "out" / "gpu_report.txt"
    precious.write_text("another run's report")
    link.parent.mkdir()
    link.symlink_to(precious)
    with pytest.raises(FlagError, match=f"^{link} is a symbolic link \\(to {precious}\\)"):
        open_own(link)
    assert precious.read_text() == "another run's report" and link.is_symlink()
    with open_own(link.parent / "own.txt") as f:  # a name of its own is written, truncating what was there
        f.write("first, longer")
    with open_own(link.parent / "own.txt") as f:
        f.write("second")
    assert (link.parent / "own.txt").read_text() == "second"
