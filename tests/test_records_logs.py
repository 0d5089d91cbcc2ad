"""records/logs.py against the log-format contract: real and hand-written logs, statistics checked with scipy."""
import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from scipy import stats

REPO_ROOT = Path(__file__).resolve().parent.parent
SEPARATOR = "=" * 100
SOURCE = '"""A stand-in trainer."""\nlearning_rate = 0.1\nprint("train")\n'


def _import_logs():
    # by path: records/ is not a package, and a "records" or "logs" module elsewhere must not shadow it
    spec = importlib.util.spec_from_file_location("records_logs", REPO_ROOT / "records" / "logs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


logs = _import_logs()


def log_text(final_loss=5.0, final_time_ms=36000.0, source=SOURCE, num_iterations=4, val_loss_every=2,
             target=6.0, finished=True, **hyperparameters) -> str:
    """A log as the contract describes it; val loss falls linearly from 10 to final_loss, time grows linearly."""
    hyperparameters = dict(preset="cpu", num_iterations=num_iterations, val_loss_every=val_loss_every,
                           target_val_loss=target, seed=0, run_id="x", **hyperparameters)
    lines = [source.rstrip("\n"), SEPARATOR, "Running Python 3.11.7 (main) [GCC 12.2.0]",
             "Running PyTorch 2.13.0+cpu compiled for CUDA None", "CPU: Test CPU (2 cores)", SEPARATOR,
             "hyperparameters: " + json.dumps(hyperparameters), "run: id=x device=cpu world_size=1 grad_accum_steps=8"]

    def step_line(step, kind, loss):
        time_ms = final_time_ms * step / num_iterations
        return f"step:{step}/{num_iterations} {kind}:{loss:.4f} train_time:{time_ms:.0f}ms " \
               f"step_avg:{time_ms / max(step, 1):.2f}ms"

    for step in range(num_iterations + 1):
        if step == num_iterations or step % val_loss_every == 0:
            lines.append(step_line(step, "val_loss", 10 + (final_loss - 10) * step / num_iterations))
        if step < num_iterations:
            lines.append(step_line(step + 1, "train_loss", 10.0))
    if finished:
        lines.append("peak memory rss: 812 MiB")
    return "\n".join(lines) + "\n"


def write_logs(folder: Path, final_losses, final_times_ms, **kwargs) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (loss, time_ms) in enumerate(zip(final_losses, final_times_ms)):
        path = folder / f"run{i}.txt"
        path.write_text(log_text(loss, time_ms, **kwargs))
        paths.append(str(path))
    return paths


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = logs.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------------------
# Parsing: a hand-written log, the README's example, and a real run of the trainer

def test_handwritten_log_parses_to_known_values(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(log_text(final_loss=5.1234, final_time_ms=36000, num_iterations=4, val_loss_every=2))
    run = logs.read_log(path)
    assert run.problem is None
    assert run.source == SOURCE
    assert (run.final.step, run.final.loss, run.final.time_ms, run.final.step_avg_ms) == (4, 5.1234, 36000, 9000)
    assert [p.step for p in run.val] == [0, 2, 4] and [p.step for p in run.train] == [1, 2, 3, 4]
    assert (run.torch, run.device, run.peak_memory) == ("2.13.0+cpu", "CPU: Test CPU (2 cores), world_size 1",
                                                        "rss: 812 MiB")
    assert run.hyperparameters["target_val_loss"] == 6.0


def test_nvidia_smi_table_names_the_gpus(tmp_path):
    smi = ["+-----------------------------------------------------------------------------------------+",
           *[f"|   {i}  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |"
             for i in range(8)], ""]
    text = log_text().replace("CPU: Test CPU (2 cores)", "\n".join(smi)).replace("world_size=1", "world_size=8")
    path = tmp_path / "gpu.txt"
    path.write_text(text.replace("peak memory rss: 812 MiB", "peak memory allocated: 1234 MiB reserved: 2345 MiB"))
    run = logs.read_log(path)
    assert run.problem is None
    assert run.device == "8x NVIDIA H100 80GB HBM3, world_size 8"
    assert run.peak_memory == "allocated: 1234 MiB reserved: 2345 MiB"


def test_readme_example_log_parses(tmp_path):
    readme = (REPO_ROOT / "records" / "README.md").read_text()
    block = re.search(r"<!-- example-log:.*?-->\n```\n(.*?)```", readme, re.S)
    assert block, "records/README.md lost its example-log block"
    path = tmp_path / "example.txt"
    path.write_text(block[1])
    run = logs.read_log(path)
    assert run.problem is None
    assert (run.final.step, run.final.loss, run.final.time_ms, run.final.step_avg_ms) == (4, 9.3921, 485, 121.25)
    assert [p.step for p in run.val] == [0, 2, 4] and len(run.train) == 4
    assert run.source == '"""The source of train_gpt.py, verbatim."""\nprint("train")\n'
    assert run.hyperparameters["preset"] == "tiny" and run.peak_memory == "rss: 812 MiB"


@pytest.fixture(scope="module")
def real_log(tmp_path_factory) -> Path:
    """A 4-step run of the tiny preset, written by the trainer itself (of 2 sequences a step, not 8: the log is the
    point)."""
    log_dir = tmp_path_factory.mktemp("real_logs")
    result = subprocess.run([sys.executable, "train_gpt.py", "--preset", "tiny", "--num_iterations", "4",
                             "--val_loss_every", "2", "--seqs_per_step", "2", "--val_tokens", "512",
                             "--log_dir", str(log_dir), "--run_id", "real"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                            # one thread: on a shared 2-core machine, spinning OpenMP threads make it 4x slower
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"the trainer failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return log_dir / "real.txt"


def test_real_trainer_log_parses(real_log):
    run = logs.read_log(real_log)
    assert run.problem is None
    assert run.source == (REPO_ROOT / "train_gpt.py").read_text()
    assert [p.step for p in run.val] == [0, 2, 4] and [p.step for p in run.train] == [1, 2, 3, 4]
    assert run.hyperparameters["preset"] == "tiny" and run.num_iterations == 4
    assert math.isfinite(run.final.loss) and run.final.time_ms > 0
    # train_time is printed rounded to the ms, step_avg from the unrounded time
    assert run.final.step_avg_ms == pytest.approx(run.final.time_ms / 4, abs=0.5 / 4 + 0.005)
    assert run.torch != "unknown" and run.device.startswith("CPU: ") and run.peak_memory.startswith("rss: ")


def test_summary_of_a_real_log(real_log, capsys):
    code, out, _ = run_cli(capsys, "summary", real_log)
    assert code == 0
    assert f"{logs.read_log(real_log).final.loss:.4f}" in out and "p = n/a (p needs n >= 2)" in out


def test_diff_of_a_real_log_and_a_changed_copy(real_log, tmp_path, capsys):
    text = real_log.read_text()
    changed_source = text.replace("    seed: int = flag(0,", "    seed: int = flag(7,", 1)
    assert changed_source != text
    changed = tmp_path / "changed.txt"
    changed.write_text(changed_source.replace('"seed": 0', '"seed": 7'))
    code, out, _ = run_cli(capsys, "diff", real_log, changed)
    assert code == 0
    assert "-    seed: int = flag(0," in out and "+    seed: int = flag(7," in out
    assert re.search(r"^seed\s+0\s+->\s+7$", out, re.M)


def test_real_logs_of_stopped_and_resumed_runs(tmp_path, monkeypatch):
    """The trainer's fault lines (checkpoint:, stopped:, resumed:) between its step lines: a stopped run is
    reported as incomplete; the same run resumed counts, with the val losses of an uninterrupted run."""
    import train_gpt
    from synthetic import tiny_flags, write_synthetic_shards
    files, log_dir = write_synthetic_shards(tmp_path), tmp_path / "logs"

    def train(run_id, **flags):
        train_gpt.main(tiny_flags(files, log_dir=log_dir, run_id=run_id, num_iterations=4, val_loss_every=2,
                                  save_every=2, **flags))

    train("full")
    full = logs.read_log(log_dir / "full.txt")
    assert full.problem is None and "\ncheckpoint: " in (log_dir / "full.txt").read_text()

    real_step, calls = train_gpt.forward_backward, []
    monkeypatch.setattr(train_gpt, "forward_backward", lambda *args, **kwargs: (
        calls.append(1), len(calls) == 3 and (log_dir / "stopped.stop").touch(), real_step(*args, **kwargs))[-1])
    with pytest.raises(train_gpt.RunEnded):
        train("stopped")
    monkeypatch.undo()
    assert (log_dir / "stopped.txt").read_text().endswith("reason:kill switch " + str(log_dir / "stopped.stop") + "\n")
    stopped = logs.read_log(log_dir / "stopped.txt")
    assert stopped.problem == (f"stopped on request at step 3/4 (stopped: step:3/4 reason:kill switch "
                               f"{log_dir / 'stopped.stop'}); a checkpoint was saved, so it can be resumed")

    (log_dir / "stopped.stop").unlink()
    train("stopped", resume="latest")
    text = (log_dir / "stopped.txt").read_text()
    assert "\nresumed: step:3/4 from " in text and "\nstopped: " not in text  # the log was cut back, then continued
    resumed = logs.read_log(log_dir / "stopped.txt")
    assert resumed.problem is None
    assert [(p.step, p.loss) for p in resumed.val] == [(p.step, p.loss) for p in full.val]
    assert [p.step for p in resumed.train] == [1, 2, 3, 4]


def test_step_lines_counting_to_another_num_iterations_are_named(tmp_path):
    path = tmp_path / "extended.txt"
    path.write_text(log_text().replace("step:4/4 val_loss", "step:4/6 val_loss"))
    number = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith("step:4/6"))
    assert number == 17  # 3 source lines, 5 of environment, hyperparameters, run:, 7 step lines
    assert logs.read_log(path).problem == (f"step line {number} counts to 6 steps, but the run's num_iterations is 4 "
                                           "(its hyperparameters line, or its last resumed: line)")


def test_a_finished_run_resumed_with_fewer_iterations_counts_to_the_new_total(files, tmp_path, capsys):
    """The trainer accepts a lower --num_iterations on resume and logs it: the run's length is the last one logged."""
    import train_gpt
    from synthetic import tiny_flags
    log_dir = tmp_path / "logs"
    flags = dict(log_dir=log_dir, run_id="cut", val_loss_every=2, save_every=1)
    train_gpt.main(tiny_flags(files, num_iterations=3, **flags))
    train_gpt.main(tiny_flags(files, num_iterations=2, resume=log_dir / "cut" / "step000001.pt", **flags))
    path = log_dir / "cut.txt"
    text = path.read_text()
    assert "\nstep:1/3 train_loss:" in text and "\nresumed: step:1/2 from " in text
    assert "\nresumed with changed hyperparameters: num_iterations=2\n" in text
    run = logs.read_log(path)
    assert run.problem is None and run.num_iterations == 2
    assert [p.step for p in run.val] == [0, 2] and [p.step for p in run.train] == [1, 2]
    code, out, err = run_cli(capsys, "summary", path)
    assert code == 0 and "complete runs: 1 of 1" in out and err == ""
    path.write_text(text.replace("resumed: step:1/2 from ", "resumed: step:1/two from "))
    assert logs.read_log(path).problem.startswith("malformed resumed line")


# ----------------------------------------------------------------------------------------------------
# Statistics: the tool's own t distribution and tests against scipy

@pytest.mark.parametrize("df", [1, 2, 3.7, 9, 30, 250.5])
def test_t_cdf_matches_scipy(df):
    for t in [-40, -8, -2.5, -0.3, 0, 0.3, 2.5, 8, 40]:
        assert logs.t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), rel=1e-9, abs=1e-300)


def test_summary_mean_std_and_p_match_scipy(tmp_path, capsys):
    final_losses, times_ms = [5.91, 5.93, 5.85, 5.90, 5.92], [36000, 36500, 35500, 36200, 35900]
    paths = write_logs(tmp_path, final_losses, times_ms, target=6.0)
    code, out, _ = run_cli(capsys, "summary", *paths)
    assert code == 0
    expected_p = stats.ttest_1samp(final_losses, 6.0, alternative="less").pvalue
    assert logs.mean_below_target_p(final_losses, 6.0) == pytest.approx(expected_p, rel=1e-9)
    assert f"val loss:   {np.mean(final_losses):.4f} ± {np.std(final_losses, ddof=1):.4f} (n=5)" in out
    assert f"train time: {np.mean(times_ms) / 1000:.3f} s ± {np.std(times_ms, ddof=1) / 1000:.3f} s (n=5)" in out
    assert "target 6 (the logs' target_val_loss)" in out and f"p = {expected_p:.3g} (significant" in out


def test_summary_target_flag_and_disagreeing_logs(tmp_path, capsys):
    paths = write_logs(tmp_path / "a", [3.27, 3.26], [1000, 1000], target=3.3)
    paths += write_logs(tmp_path / "b", [3.25, 3.29], [1000, 1000], target=4.0)
    losses = [3.27, 3.26, 3.25, 3.29]
    _, out, _ = run_cli(capsys, "summary", *paths)
    assert "target 3.28 (the record target; the logs' target_val_loss values differ)" in out
    assert f"p = {stats.ttest_1samp(losses, 3.28, alternative='less').pvalue:.3g}" in out
    _, out, _ = run_cli(capsys, "summary", *paths, "--target", "3.3")
    assert f"p = {stats.ttest_1samp(losses, 3.3, alternative='less').pvalue:.3g}" in out


def test_summary_of_one_run_says_p_needs_two(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "summary", *write_logs(tmp_path, [5.5], [1234]))
    assert code == 0
    assert "val loss:   5.5000 (n=1: std needs n >= 2)" in out and "p = n/a (p needs n >= 2)" in out


def test_compare_welch_tests_match_scipy(tmp_path, capsys):
    base_losses, base_ms = [5.90, 5.92, 5.88], [36000, 36400, 35800]
    cand_losses, cand_ms = [5.93, 5.89, 5.95, 5.91], [30000, 31000, 30500, 29800]
    baseline = write_logs(tmp_path / "base", base_losses, base_ms)
    candidate = write_logs(tmp_path / "cand", cand_losses, cand_ms)
    code, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert code == 0
    time_p = stats.ttest_ind(np.array(cand_ms) / 1000, np.array(base_ms) / 1000, equal_var=False,
                             alternative="less").pvalue
    loss_p = stats.ttest_ind(cand_losses, base_losses, equal_var=False).pvalue
    assert p_after(out, "Welch one-sided p (candidate faster)") == pytest.approx(time_p, rel=1e-3)
    assert p_after(out, "Welch two-sided p") == pytest.approx(loss_p, rel=1e-3)
    assert p_after(out, "one-sided p (mean < target)") == pytest.approx(
        stats.ttest_1samp(cand_losses, 6.0, alternative="less").pvalue, rel=1e-3)
    time_change = np.mean(cand_ms) / 1000 - np.mean(base_ms) / 1000
    assert f"candidate - baseline = {time_change:+.3f} s" in out
    assert f"candidate - baseline = {np.mean(cand_losses) - np.mean(base_losses):+.4f}" in out
    assert out.rstrip().endswith("verdict: record")


def p_after(text: str, label: str) -> float:
    return float(re.search(re.escape(label) + r" = (\S+)", text)[1])


@pytest.mark.parametrize("cand_losses, cand_ms, expected", [
    ([5.50, 5.52, 5.49], [30000, 30200, 29900], "record"),
    ([5.50, 5.52, 5.49], [40000, 40200, 39900], "not faster"),  # slower
    ([5.50, 5.52, 5.49], [35900, 36100, 36000], "not faster"),  # same speed
    ([6.10, 6.12, 6.09], [30000, 30200, 29900], "loss not significant"),  # faster, above the target
    ([5.00, 6.90, 5.50], [30000, 30200, 29900], "loss not significant"),  # faster, mean below but too noisy
    ([6.10, 6.12, 6.09], [40000, 40200, 39900], "not faster"),  # both fail: speed is checked first
    ([5.50], [30000], "not faster"),  # one run: no p-value, so nothing is shown
])
def test_compare_verdicts_for_clear_cases(tmp_path, capsys, cand_losses, cand_ms, expected):
    baseline = write_logs(tmp_path / "base", [5.50, 5.51, 5.49], [36000, 36100, 35900])
    candidate = write_logs(tmp_path / "cand", cand_losses, cand_ms)
    _, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert out.rstrip().splitlines()[-1] == f"verdict: {expected}"


def test_diverged_run_counts_but_is_never_significant(tmp_path, capsys):
    baseline = write_logs(tmp_path / "base", [5.50, 5.51, 5.49], [36000, 36100, 35900])
    candidate = write_logs(tmp_path / "cand", [5.50, float("nan"), 5.49], [30000, 30200, 29900])
    code, out, _ = run_cli(capsys, "summary", *candidate)
    assert code == 0 and "val loss:   nan ± nan (n=3)" in out and "p = nan (not significant at 0.01)" in out
    _, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert out.rstrip().splitlines()[-1] == "verdict: loss not significant"


def test_identical_values_give_extreme_p():
    assert logs.mean_below_target_p([5.0, 5.0, 5.0], 6.0) == 0.0
    assert logs.mean_below_target_p([6.0, 6.0], 6.0) == 1.0
    assert logs.p_less(*logs.welch([2.0, 2.0], [1.0, 1.0])) == 0.0


# ----------------------------------------------------------------------------------------------------
# diff and plot

def test_diff_shows_code_change_hyperparameters_and_curves(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(log_text(5.5, 30000))
    b.write_text(log_text(5.4, 20000, source=SOURCE.replace("0.1", "0.2"), seed_shift=3))
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 0
    code_diff, hyperparameters, curves = out.split("# source diff (A -> B)\n")[1].split("\n\n# ")
    assert "-learning_rate = 0.1\n+learning_rate = 0.2" in code_diff
    assert hyperparameters.splitlines()[1:] == ["seed_shift  (absent)  ->  3"]
    assert curves.splitlines()[1].split() == ["step", "A", "val_loss", "A", "train_time", "B", "val_loss", "B",
                                              "train_time"]
    assert curves.splitlines()[-1].split() == ["4", "5.5000", "30.000", "s", "5.4000", "20.000", "s"]


def test_diff_of_identical_sources_says_so(tmp_path, capsys):
    paths = write_logs(tmp_path, [5.5, 5.4], [30000, 20000])
    _, out, _ = run_cli(capsys, "diff", *paths)
    assert "(the embedded sources are identical)" in out and "hyperparameters that differ (A -> B)\n(none)" in out


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures `plot` saves, kept for inspection."""
    made, make_figure = [], logs.make_figure
    monkeypatch.setattr(logs, "make_figure", lambda *args: made.append(make_figure(*args)) or made[-1])
    return made


def split_lines(axes) -> tuple[list, list]:
    """The axes' curves, and its target line(s)."""
    lines = axes.get_lines()
    return [x for x in lines if x.get_gid() != "target"], [x for x in lines if x.get_gid() == "target"]


def test_plot_writes_a_png_with_one_line_per_run(tmp_path, capsys, figures):
    paths = write_logs(tmp_path, [5.5, 5.4, 5.6], [30000, 31000, 29000])
    crashed = tmp_path / "crashed.txt"
    crashed.write_text(log_text(finished=False))
    out_png = tmp_path / "curves.png"
    code, out, _ = run_cli(capsys, "plot", *paths, crashed, "-o", out_png)
    assert code == 0 and out.strip() == f"wrote {out_png}: 4 line(s) and the target 6"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(out_png).shape == (500, 1300, 4)  # decodes, at the figure's size
    (figure,) = figures
    assert type(figure.canvas).__name__ == "FigureCanvasAgg"
    by_time, by_step = figure.axes
    for axes in (by_time, by_step):
        curves, targets = split_lines(axes)
        assert [c.get_label() for c in curves] == ["run0", "run1", "run2", "crashed (incomplete)"]
        assert [c.get_linestyle() for c in curves] == ["-", "-", "-", "--"]
        assert len(targets) == 1 and list(targets[0].get_ydata()) == [6.0, 6.0]
    assert list(by_step.get_lines()[0].get_xdata()) == [0, 2, 4]
    assert list(by_time.get_lines()[1].get_xdata()) == [0, 15.5, 31.0]
    assert list(by_time.get_lines()[2].get_ydata()) == [10.0, 7.8, 5.6]


def test_plot_groups_draw_one_mean_line_per_group(tmp_path, capsys, figures):
    base = write_logs(tmp_path / "base", [5.5, 5.7], [30000, 32000])
    cand = write_logs(tmp_path / "cand", [5.2, 5.4], [20000, 22000])
    code, out, _ = run_cli(capsys, "plot", *base, "--", *cand, "-o", tmp_path / "groups.png")
    assert code == 0 and "2 line(s)" in out
    curves, targets = split_lines(figures[0].axes[0])
    assert [c.get_label() for c in curves] == ["base (mean of 2)", "cand (mean of 2)"] and len(targets) == 1
    assert curves[0].get_xdata()[-1] == pytest.approx(31.0) and curves[0].get_ydata()[-1] == pytest.approx(5.6)


# ----------------------------------------------------------------------------------------------------
# Bad inputs: refused with one line naming the file, exit status 2; crashed runs never counted

def assert_refused(capsys, path, reason: str, command="summary"):
    code, out, err = run_cli(capsys, command, path)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and str(path) in err and reason in err, err


@pytest.mark.parametrize("content, reason", [
    (b"", "empty file"),
    (b"\n  \n", "empty file"),
    (b"just some notes\nabout nothing\n", "not a training log"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not UTF-8"),
    (SOURCE.encode() + SEPARATOR.encode() + b"\nRunning Python 3.11\n", "ends inside the environment block"),
])
def test_unusable_files_are_refused(tmp_path, capsys, content, reason):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    assert_refused(capsys, path, reason)


def test_log_cut_mid_line(tmp_path, capsys):
    text = log_text()
    cut_in_body = tmp_path / "cut_body.txt"
    cut_in_body.write_text(text[:text.index("step:3/4 train_loss") + 15])
    assert_refused(capsys, cut_in_body, "cut mid-line after step 2/4")
    cut_in_header = tmp_path / "cut_header.txt"
    cut_in_header.write_text(text[:text.index('"num_iterations"')])
    assert_refused(capsys, cut_in_header, "ends inside the hyperparameters line")
    cut_in_final_value = tmp_path / "cut_value.txt"  # "val_loss:5.00" parses as a number: only the newline tells
    cut_in_final_value.write_text(text[:text.index("step:4/4 val_loss:") + len("step:4/4 val_loss:5.0")])
    assert logs.read_log(cut_in_final_value).problem.startswith("cut mid-line")


def test_missing_file_is_refused(tmp_path, capsys):
    assert_refused(capsys, tmp_path / "nope.txt", "cannot read it")
    code, _, err = run_cli(capsys, "plot", *write_logs(tmp_path, [5.5], [1000]), "-o", tmp_path / "no" / "x.png")
    assert code == 2 and "x.png: cannot write it" in err


def test_crashed_run_is_reported_and_not_counted(tmp_path, capsys):
    paths = write_logs(tmp_path, [5.5, 5.7], [30000, 31000])
    crashed = tmp_path / "crashed.txt"
    crashed.write_text(log_text(final_loss=1.0, finished=False))
    stopped = tmp_path / "stopped.txt"
    stopped.write_text(log_text(final_loss=1.0).replace("step:4/4 val_loss", "stopped: kill switch\nignored:"))
    code, out, err = run_cli(capsys, "summary", *paths, crashed, stopped)
    assert code == 0
    assert "complete runs: 2 of 4" in out and f"val loss:   5.6000 ± {np.std([5.5, 5.7], ddof=1):.4f} (n=2)" in out
    assert re.search(r"crashed\.txt\s+incomplete\s+36\.000 s\s+9000\.00 ms\s+4/4\s+-", out)
    assert f"{crashed}: incomplete run, not counted: no 'peak memory' line" in err
    assert f"{stopped}: incomplete run, not counted: stopped on request at step 4/4 (stopped: kill switch)" in err
    assert_refused(capsys, crashed, "no complete run to count", command="summary")


def test_malformed_step_line_is_not_counted(tmp_path):
    path = tmp_path / "garbled.txt"
    path.write_text(log_text().replace("step:3/4 train_loss:10.0000", "step:3/4 train_loss:ten"))
    assert logs.read_log(path).problem.startswith("malformed step line")


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_not_read(tmp_path):
    """Reading a named pipe (as a log, or writing it as the plot) would block until another process opened it."""
    pipe, log = tmp_path / "pipe.png", tmp_path / "run.txt"  # .png: as plot's output only its kind refuses it
    os.mkfifo(pipe)
    log.write_text(log_text())
    before = sha256(log)
    script = str(REPO_ROOT / "records" / "logs.py")
    for argv, named in ((["summary", pipe], f"{pipe}: a named pipe"),
                        (["plot", log, "-o", pipe], f"-o {pipe}: a named pipe")):
        result = subprocess.run([sys.executable, script, *map(str, argv)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1 and named in result.stderr, result.stderr
    assert sha256(log) == before and sorted(tmp_path.iterdir()) == [pipe, log]


@pytest.mark.parametrize("output, reason", [
    ("curves.xyz", "the suffix .xyz names no format matplotlib writes; use one of "),
    ("run0.txt", "the suffix .txt names no format matplotlib writes; use one of "),  # one of the logs themselves
    ("curves", "the suffix (none) names no format matplotlib writes; use one of "),  # it would write curves.png
    ("folder", "a folder; the output must be a file path"),
])
def test_plot_refuses_an_output_it_cannot_write_before_reading_any_log(tmp_path, capsys, output, reason):
    paths = write_logs(tmp_path, [5.5], [1000])
    (tmp_path / "folder").mkdir()
    before = {path: sha256(path) for path in paths}
    # the missing log would be refused first if the output were checked only after reading the logs
    code, out, err = run_cli(capsys, "plot", *paths, tmp_path / "missing.txt", "-o", tmp_path / output)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1 and f"-o {tmp_path / output}: {reason}" in err, err
    if output != "folder":  # the suffixes it can write are named
        assert ".pdf" in err and ".png" in err and ".svg" in err
    assert {path: sha256(path) for path in paths} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "run0.txt"]
    assert not any((tmp_path / "folder").iterdir())


def test_plot_never_writes_through_a_symbolic_link(tmp_path, capsys):
    """`ln -s good.txt link.png; logs.py plot ok.txt -o link.png` once replaced good.txt with the image."""
    (good,) = write_logs(tmp_path, [5.5], [1000])
    link, dangling = tmp_path / "link.png", tmp_path / "dangling.png"
    link.symlink_to("run0.txt")
    dangling.symlink_to("elsewhere.png")  # writing through it would make a file elsewhere
    before = sha256(good)
    for output, to in ((link, "run0.txt"), (dangling, "elsewhere.png")):
        code, out, err = run_cli(capsys, "plot", good, "-o", output)
        assert code == 2 and out == "" and "Traceback" not in err
        assert err == f"logs.py: error: -o {output}: a symbolic link (to {to}), and plot writes through none; give " \
                      "the path of the image itself\n"
    assert sha256(good) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.png", "link.png", "run0.txt"]


def test_plot_writes_its_image_whole_or_not_at_all(tmp_path, capsys, figures, monkeypatch):
    """The image goes to a temporary file renamed onto -o: a link made there after the check is replaced, not
    written through, and a write that fails leaves the old image and no temporary file."""
    (good,) = write_logs(tmp_path, [5.5], [1000])
    output = tmp_path / "curves.png"
    assert run_cli(capsys, "plot", good, "-o", output)[0] == 0
    old_image, before = output.read_bytes(), sha256(good)
    output.unlink()
    output.symlink_to("run0.txt")
    logs.write_image(figures[0], output)
    assert not output.is_symlink() and output.read_bytes() == old_image and sha256(good) == before

    def disk_full(self, file, **kwargs):
        file.write(b"\x89PNG half an image")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(type(figures[0]), "savefig", disk_full)
    code, out, err = run_cli(capsys, "plot", good, "-o", output)
    assert code == 2 and out == "" and err == f"logs.py: error: {output}: cannot write it (No space left on device)\n"
    assert output.read_bytes() == old_image and sha256(good) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run0.txt"]


def test_compare_says_which_target_it_judged_by_when_the_logs_name_different_ones(tmp_path, capsys):
    """The verdict depends on the target: compare once took the candidate's without a word."""
    baseline = write_logs(tmp_path / "a", [3.27, 3.26], [1000, 1100], target=3.28)
    candidate = write_logs(tmp_path / "b", [3.25, 3.27], [900, 950], target=3.3)
    before = {path: sha256(path) for path in baseline + candidate}
    code, out, err = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "target: the baseline's logs name target_val_loss 3.28 and the candidate's 3.3; " \
                                  "judged by 3.3 (the logs' target_val_loss); give --target T to judge both by another"
    code, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate, "--target", "3.28")
    assert code == 0 and out.startswith("baseline ") and "candidate vs target 3.28 (--target)" in out
    assert {path: sha256(path) for path in baseline + candidate} == before


@pytest.mark.parametrize("target, written", [("abc", '"abc"'), ([1], "[1]"), (True, "true"), (-1, "-1")])
def test_a_log_whose_target_is_not_a_finite_number_is_refused(tmp_path, capsys, target, written):
    path = tmp_path / "run.txt"
    path.write_text(log_text(target=target))
    before = sha256(path)
    code, out, err = run_cli(capsys, "summary", path)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == f"logs.py: error: {path}: line 9: target_val_loss is {written}, not a finite number >= 0\n"
    assert sha256(path) == before


@pytest.mark.parametrize("target", ["abc", "[1]", "nan", "-inf", "-1"])
def test_a_target_flag_that_is_not_a_finite_number_is_refused(tmp_path, capsys, target):
    with pytest.raises(SystemExit) as refused:
        logs.main(["summary", *write_logs(tmp_path, [5.5], [1000]), f"--target={target}"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "Traceback" not in err
    # argparse's usage line, then its one-line error
    assert err.splitlines()[-1] == f"logs.py summary: error: argument --target: {target!r} is not a finite number >= 0"


def test_compare_against_a_baseline_that_took_0_s(tmp_path, capsys):
    baseline = write_logs(tmp_path / "base", [5.50, 5.51], [0, 0])
    candidate = write_logs(tmp_path / "cand", [5.50, 5.52], [30000, 30200])
    code, out, err = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert code == 0 and err == ""
    assert "train time: candidate - baseline = +30.100 s (n/a: the baseline's time is 0 s); " in out
    assert out.rstrip().splitlines()[-1] == "verdict: not faster"


def test_command_line_errors_exit_2_without_traceback(tmp_path):
    not_a_log = tmp_path / "notes.txt"
    not_a_log.write_text("hello\n")
    script = str(REPO_ROOT / "records" / "logs.py")
    for argv in (["summary", str(not_a_log)], ["compare", str(not_a_log)], ["diff", str(not_a_log)]):
        result = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------------
# The reference trainer's logs (the field's record history): no hyperparameters line, no training loss

def reference_log_text(final_loss=3.27, final_time_ms=180000.0, num_iterations=20, val_loss_every=10,
                       finished=True) -> str:
    """A log as the reference trainer writes it: its source, the environment with nvidia-smi's table, a few lines
    of its own, step lines without a training loss, and the peak memory line."""
    lines = ["import torch", "print('the reference trainer')", SEPARATOR, "Running Python 3.12.7",
             "Running PyTorch 2.7.0.dev20250110+cu126 compiled for CUDA 12.6",
             "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |", SEPARATOR,
             "Created 2 gradient buckets", "Bucket 0: 1 params, 147.4 MB"]
    for step in range(num_iterations + 1):
        time_ms = final_time_ms * step / num_iterations
        if step == num_iterations or step % val_loss_every == 0:
            loss = 10 + (final_loss - 10) * step / num_iterations
            lines.append(f"step:{step}/{num_iterations} val_loss:{loss:.4f} train_time:{time_ms:.0f}ms "
                         f"step_avg:{time_ms / max(step, 1):.2f}ms")
        if step < num_iterations:
            time_ms = final_time_ms * (step + 1) / num_iterations
            lines.append(f"step:{step + 1}/{num_iterations} train_time:{time_ms:.0f}ms step_avg:"
                         f"{time_ms / (step + 1):.2f}ms")
    if finished:
        lines.append("peak memory allocated: 30712 MiB reserved: 31010 MiB")
    return "\n".join(lines) + "\n"


def write_reference_logs(folder: Path, final_losses, final_times_ms) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (loss, time_ms) in enumerate(zip(final_losses, final_times_ms)):
        (folder / f"ref{i}.txt").write_text(reference_log_text(loss, time_ms))
    return [str(folder / f"ref{i}.txt") for i in range(len(final_losses))]


def test_a_reference_trainer_log_parses_to_its_results(tmp_path):
    path = tmp_path / "ref.txt"
    path.write_text(reference_log_text())
    run = logs.read_log(path)
    assert run.problem is None and run.num_iterations == 20 and run.source.startswith("import torch\n")
    assert [(p.step, p.loss) for p in run.val] == [(0, 10.0), (10, 6.635), (20, 3.27)]
    assert len(run.train) == 20 and all(math.isnan(p.loss) for p in run.train)
    assert run.final.time_ms == 180000 and run.peak_memory == "allocated: 30712 MiB reserved: 31010 MiB"
    assert run.device == "1x NVIDIA H100 80GB HBM3" and run.torch == "2.7.0.dev20250110+cu126"
    path.write_text(reference_log_text(finished=False))
    assert "no 'peak memory' line" in logs.read_log(path).problem


def test_an_older_reference_log_with_a_nan_first_average_and_peak_memory_consumption_parses(tmp_path):
    path = tmp_path / "ref.txt"
    path.write_text(reference_log_text().replace("step:0/20 val_loss:10.0000 train_time:0ms step_avg:0.00ms",
                                                 "step:0/20 val_loss:10.0000 train_time:0ms step_avg:nanms")
                    .replace("peak memory allocated: 30712 MiB reserved: 31010 MiB",
                             "peak memory consumption: 30712 MiB"))
    run = logs.read_log(path)
    assert run.problem is None and math.isnan(run.val[0].step_avg_ms) and run.final.loss == 3.27
    assert run.peak_memory == "consumption: 30712 MiB"


def test_summary_and_compare_of_reference_logs_use_the_record_target(tmp_path, capsys):
    reference = write_reference_logs(tmp_path / "ref", [3.270, 3.272, 3.268], [180000, 181000, 179000])
    code, out, _ = run_cli(capsys, "summary", *reference)
    assert code == 0 and "val loss:   3.2700 ± 0.0020 (n=3)" in out and "train time: 180.000 s ± 1.000 s" in out
    assert "target 3.28 (the record target: the logs name none)" in out
    assert "step_avg" in out.splitlines()[0] and "9000.00 ms" in out  # 180 s / 20 steps
    ours = write_logs(tmp_path / "ours", [3.275, 3.276, 3.274], [170000, 171000, 169000], target=3.28)
    code, out, _ = run_cli(capsys, "compare", *reference, "--", *ours)
    assert code == 0 and out.rstrip().splitlines()[-1] == "verdict: record"
    code, out, _ = run_cli(capsys, "compare", *reference, "--", *ours, "--target", "3.2")
    assert out.rstrip().splitlines()[-1] == "verdict: loss not significant"


def test_diff_and_plot_of_reference_logs(tmp_path, capsys, figures):
    a, b = write_reference_logs(tmp_path, [3.27, 3.26], [180000, 175000])
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 0 and "identical" in out and "3.2700" in out and "3.2600" in out
    code, out, _ = run_cli(capsys, "plot", a, b, "-o", tmp_path / "ref.png")
    assert code == 0 and out.strip() == f"wrote {tmp_path / 'ref.png'}: 2 line(s) and the target 3.28"


def test_a_stopped_or_diverged_log_is_reported_in_its_own_words(tmp_path):
    stopped, diverged = tmp_path / "stopped.txt", tmp_path / "diverged.txt"
    lines = log_text(finished=False).splitlines()
    stopped.write_text("\n".join(lines[:-2] + ["checkpoint: logs/x/step000003.pt",
                                                 "stopped: step:3/4 reason:SIGTERM"]) + "\n")
    diverged.write_text("\n".join(lines[:-2] + ["diverged: training diverged at step 3: train loss nan, gradient "
                                                  "norm nan; there is no checkpoint to go back to"]) + "\n")
    assert logs.read_log(stopped).problem == ("stopped on request at step 3/4 (stopped: step:3/4 reason:SIGTERM); a "
                                              "checkpoint was saved, so it can be resumed")
    assert logs.read_log(diverged).problem == ("diverged at step 3/4 (training diverged at step 3: train loss nan, "
                                               "gradient norm nan; there is no checkpoint to go back to)")


def test_a_baseline_that_misses_the_target_is_beaten_by_a_candidate_that_reaches_it(tmp_path, capsys):
    # the baseline is faster, but its runs end above the candidate's target: its time to that target is unbounded
    baseline = write_logs(tmp_path / "base", [5.75, 5.76, 5.74], [240000, 241000, 239000], target=5.8)
    candidate = write_logs(tmp_path / "cand", [5.20, 5.22, 5.21], [296000, 297000, 295000], target=5.4)
    code, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate)
    assert code == 0 and "the baseline does not reach the target 5.4 (mean val loss 5.7500)" in out
    assert out.rstrip().splitlines()[-1] == "verdict: record"
    code, out, _ = run_cli(capsys, "compare", *baseline, "--", *candidate, "--target", "5.8")
    assert out.rstrip().splitlines()[-1] == "verdict: not faster"  # against a target both reach, time decides


@pytest.mark.parametrize("absurd", ["nested", "digits", "two runs"])
def test_a_log_that_parses_but_is_absurd_is_refused_in_one_line(tmp_path, capsys, absurd):
    # JSON nested 200,000 deep (Python's parser recurses), a step number of 5,000 digits (int() refuses over 4,300),
    # two logs run together (it once read as the first run's header with the second's steps)
    text = log_text()
    if absurd == "nested":
        text = re.sub(r"(?m)^hyperparameters: .*$", "hyperparameters: " + "[" * 200_000 + "]" * 200_000, text)
    elif absurd == "digits":
        text = text.replace("step:4/4 val_loss", "step:" + "9" * 5000 + "/4 val_loss")
    else:
        text += text
    path = tmp_path / "absurd.txt"
    path.write_text(text)
    code, out, err = run_cli(capsys, "summary", path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err[-500:]
    expected = {"nested": "not a training log this can read: RecursionError",
                "digits": "not a training log this can read: ValueError",
                "two runs": "a second run's hyperparameters at line "}[absurd]
    assert err.startswith(f"logs.py: error: {path}: {expected}"), err
