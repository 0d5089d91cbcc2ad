"""Read train_gpt.py's run logs: per-run results, record statistics, code diffs and loss curves.

    python records/logs.py summary logs/*.txt                        # results, mean ± std, p-value vs the target
    python records/logs.py compare old/*.txt -- new/*.txt            # is the candidate (after --) a new record?
    python records/logs.py diff logs/a.txt logs/b.txt                # code, hyperparameters and curves of two runs
    python records/logs.py plot logs/*.txt -o curves.png             # val loss vs train time and vs step, per run
    python records/logs.py plot old/*.txt -- new/*.txt -o cmp.png    # the same, one mean line per group

The log format is the contract written down in records/README.md ("The log format"); the reference trainer's logs
(the field's record history) are read too. A directory argument stands for the *.txt logs in it. Exit status 2: an input is not a usable log, or a group holds no complete run.
Needs only the standard library, and matplotlib for `plot`.
"""
import argparse
import difflib
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SEPARATOR = "=" * 100
RECORD_TARGET = 3.28  # the record config's target: the val loss of llm.c's GPT-2 small replication
ALPHA = 0.01  # the genre's significance level, for the loss test and for the speed test
REQUIRED_HYPERPARAMETERS = ("preset", "num_iterations", "val_loss_every", "target_val_loss")
GROUP_FLAG = "--next-group"  # what a bare `--` between groups becomes before argparse (which would swallow it)

# (the reference trainer's training lines carry no loss: "step:N/T train_time:...ms step_avg:...ms"; its older
# versions write step 0's average as "nan" and the peak memory as "consumption: N MiB")
STEP_LINE = re.compile(r"step:(\d+)/(\d+) (?:(val_loss|train_loss):(\S+) )?train_time:(\d+(?:\.\d+)?)ms "
                       r"step_avg:(\d+(?:\.\d+)?|nan)ms")
PEAK_MEMORY_LINE = re.compile(r"peak memory (allocated: \d+ MiB reserved: \d+ MiB|rss: \d+ MiB"
                              r"|consumption: \d+ MiB)")
NVIDIA_SMI_GPU_ROW = re.compile(r"\|\s+\d+\s+(.+?)\s+(?:On|Off)\s+\|")
RESUMED_LINE = re.compile(r"resumed: step:(\d+)/(\d+) from .+")  # its total: the resumed num_iterations


class LogError(Exception):
    """An input that cannot be used: reported as one line naming the file, exit status 2."""


# ----------------------------------------------------------------------------------------------------
# Parsing

@dataclass
class Point:
    step: int
    loss: float
    time_ms: float
    step_avg_ms: float


@dataclass
class Run:
    path: Path
    source: str  # train_gpt.py as it was for this run
    torch: str
    device: str
    hyperparameters: dict
    layout: dict  # the `run:` line's fields: device, world_size, grad_accum_steps
    val: list[Point]
    train: list[Point]
    peak_memory: str | None  # "rss: 812 MiB" or "allocated: 1234 MiB reserved: 2345 MiB"
    problem: str | None  # why the run is not a result (crashed, cut, stopped early); None when it finished
    ended: str | None = None  # the log's own `stopped: ...` or `diverged: ...` line

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def num_iterations(self) -> int:
        return self.hyperparameters["num_iterations"]

    @property
    def last(self) -> Point | None:
        """The latest point logged, val or train."""
        return max(self.val + self.train, key=lambda p: p.step, default=None)

    @property
    def final(self) -> Point:
        """The val point at step num_iterations: the run's result (complete runs only)."""
        return self.val[-1]


def not_a_file(path: Path) -> str | None:
    """What stands at path when it exists but is no regular file: reading a named pipe blocks until something
    writes to it, and a folder is not one file."""
    if not path.exists() or path.is_file():
        return None
    return "a folder" if path.is_dir() else "a named pipe, socket or device"


def read_log(path: Path) -> Run:
    if kind := not_a_file(path):
        raise LogError(f"{path}: {kind}, not a log file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LogError(f"{path}: not a training log (not UTF-8 text)") from None
    except OSError as e:
        raise LogError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return parse_log(text, path)
    except LogError as e:
        raise LogError(f"{path}: {e}") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; JSON nested thousands deep
        raise LogError(f"{path}: not a training log this can read: {type(e).__name__}: "
                       f"{' '.join(str(e).split())[:120]}") from None


def parse_log(text: str, path: Path) -> Run:
    if not text.strip():
        raise LogError("empty file")
    lines = text.split("\n")
    # the trainer ends every line with a newline, so a last line without one was cut while being written
    cut = lines.pop() != ""
    if SEPARATOR not in lines:
        raise LogError("not a training log (no line of 100 '=' after an embedded source)")
    end_source = lines.index(SEPARATOR)
    if SEPARATOR not in lines[end_source + 1:]:
        raise LogError("truncated log: it ends inside the environment block")
    end_env = lines.index(SEPARATOR, end_source + 1)
    env, body = lines[end_source + 1:end_env], lines[end_env + 1:]
    later_runs = [end_env + 2 + i for i, line in enumerate(body) if i and line.startswith("hyperparameters: ")]
    if later_runs:  # (the trainer writes one such line, at a log's start: two logs run together)
        raise LogError(f"a second run's hyperparameters at line {later_runs[0]}: the file holds more than one run; "
                       "split it into one log per run")
    if not body:
        raise LogError(f"truncated log: it ends {'inside' if cut else 'before'} the hyperparameters line")
    if body[0].startswith("hyperparameters: ") or not any(STEP_LINE.fullmatch(line) for line in body):
        hyperparameters, first = parse_hyperparameters(body[0], end_env + 2), 1
    else:  # the reference trainer's log (the field's record history): no hyperparameters line
        hyperparameters, first = reference_hyperparameters(body), 0
    # the trainer writes its source without the trailing newline, then the separator on a line of its own
    run = Run(path=path, source="".join(line + "\n" for line in lines[:end_source]),
              torch=torch_version(env), device="", hyperparameters=hyperparameters,
              layout={}, val=[], train=[], peak_memory=None, problem=None)
    malformed = read_body(run, body[first:], first_number=end_env + 2 + first)
    run.device = describe_device(env, run.layout)
    run.problem = malformed or completion_problem(run, cut)
    return run


def parse_hyperparameters(line: str, number: int) -> dict:
    if not line.startswith("hyperparameters: "):
        raise LogError(f"not a training log (line {number} should be 'hyperparameters: {{...}}')")
    try:
        hyperparameters = json.loads(line[len("hyperparameters: "):])
    except json.JSONDecodeError:
        hyperparameters = None
    if not isinstance(hyperparameters, dict):
        raise LogError(f"line {number}: the hyperparameters are not one valid JSON object (cut?)")
    missing = [k for k in REQUIRED_HYPERPARAMETERS if k not in hyperparameters]
    if missing:
        raise LogError(f"line {number}: the hyperparameters lack {', '.join(missing)}")
    if not is_target(hyperparameters["target_val_loss"]):
        raise LogError(f"line {number}: target_val_loss is {json.dumps(hyperparameters['target_val_loss'])}, "
                       "not a finite number >= 0")
    return hyperparameters


def is_target(value) -> bool:
    """A target val loss as the trainer accepts one: a finite number >= 0 (JSON's true is no number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def reference_hyperparameters(body: list[str]) -> dict:
    """What a reference-trainer log tells of its hyperparameters: the step count its step lines share (its
    target is the record's, unless --target says otherwise)."""
    totals = {match[2] for line in body if (match := STEP_LINE.fullmatch(line))}
    if len(totals) != 1:
        raise LogError(f"not a training log: its step lines count to different totals {sorted(totals)}")
    return dict(num_iterations=int(totals.pop()))


def read_body(run: Run, lines: list[str], first_number: int) -> str | None:
    """Fills in the run's layout, val and train points and peak memory; returns its first malformed line, if any."""
    for number, line in enumerate(lines, start=first_number):
        if line.startswith("step:"):
            point = parse_step(line, run.num_iterations)
            if point is None:
                total = STEP_LINE.fullmatch(line)
                if total and int(total[2]) != run.num_iterations:
                    return (f"step line {number} counts to {total[2]} steps, but the run's num_iterations is "
                            f"{run.num_iterations} (its hyperparameters line, or its last resumed: line)")
                return f"malformed step line {number}: {line[:80]!r}"
            (run.val if " val_loss:" in line else run.train).append(point)
        elif line.startswith("peak memory"):
            if not PEAK_MEMORY_LINE.fullmatch(line):
                return f"malformed peak memory line {number}: {line[:80]!r}"
            run.peak_memory = line[len("peak memory "):]
        elif line.startswith("run: "):
            run.layout = dict(field.split("=", 1) for field in line[len("run: "):].split() if "=" in field)
        elif line.startswith(("stopped: ", "diverged: ")):
            run.ended = line
        elif line.startswith("resumed: "):
            resumed = RESUMED_LINE.fullmatch(line)
            if resumed is None:
                return f"malformed resumed line {number}: {line[:80]!r}"
            # a resume may change --num_iterations (the trainer logs it): the steps from here count to the new one
            run.hyperparameters["num_iterations"] = int(resumed[2])
        # any other line (checkpoint:, resumed with changed hyperparameters:, ...) carries nothing this tool reports
    return None


def parse_step(line: str, num_iterations: int) -> Point | None:
    match = STEP_LINE.fullmatch(line)
    if match is None or int(match[2]) != num_iterations:
        return None
    try:
        loss = float(match[4] or "nan")  # "nan" and "inf" are real outcomes of a diverged run; a reference
        # trainer's training line has no loss
    except ValueError:
        return None
    return Point(int(match[1]), loss, float(match[5]), float(match[6]))


def completion_problem(run: Run, cut: bool) -> str | None:
    last = run.last
    where = f"step {last.step}/{run.num_iterations}" if last else "the first step"
    if run.ended is not None and run.ended.startswith("stopped: "):
        return f"stopped on request at {where} ({run.ended}); a checkpoint was saved, so it can be resumed"
    if run.ended is not None:
        return f"diverged at {where} ({run.ended[len('diverged: '):][:200]})"
    if cut:
        return f"cut mid-line after {where} (crashed, killed, or still running)"
    if run.peak_memory is None:
        return f"no 'peak memory' line: it stopped at {where} (crashed, killed, or still running)"
    if not run.val or run.val[-1].step != run.num_iterations:
        return f"its last val step is not num_iterations={run.num_iterations} (stopped early at {where})"
    return None


def torch_version(env: list[str]) -> str:
    return next((m[1] for line in env if (m := re.match(r"Running PyTorch (\S+)", line))), "unknown")


def describe_device(env: list[str], layout: dict) -> str:
    """The CPU line, or the GPUs in nvidia-smi's table, with the world size the run used."""
    described = next((line for line in env if line.startswith(("CPU: ", "GPU: "))), None)
    if described is None:
        gpus = Counter(m[1] for line in env if (m := NVIDIA_SMI_GPU_ROW.match(line)))
        described = ", ".join(f"{n}x {name}" for name, n in gpus.items()) or layout.get("device", "unknown")
    world_size = layout.get("world_size")
    return f"{described}, world_size {world_size}" if world_size else described


def expand(paths: list[str]) -> list[Path]:
    """A directory stands for the *.txt logs in it (a record folder)."""
    expanded = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            logs = sorted(path.glob("*.txt"))
            if not logs:
                raise LogError(f"{path}: a directory without *.txt logs")
            expanded += logs
        else:
            expanded.append(path)
    return expanded


def load(paths: list[str]) -> list[Run]:
    return [read_log(path) for path in expand(paths)]


def counted(runs: list[Run]) -> list[Run]:
    """The complete runs; each incomplete one is named on stderr, as it would otherwise silently shrink n."""
    notes = [f"{run.path}: incomplete run, not counted: {run.problem}" for run in runs if run.problem]
    if len(notes) == len(runs):
        raise LogError("no complete run to count: " + "; ".join(notes))
    for note in notes:
        print(f"logs.py: {note}", file=sys.stderr)
    return [run for run in runs if run.problem is None]


# ----------------------------------------------------------------------------------------------------
# Statistics: Student's t distribution from the regularized incomplete beta function, no scipy needed

def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), from its continued fraction (Numerical Recipes, 6.4)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # the fraction converges fast only below (a+1)/(a+b+2); above, use I_x(a, b) = 1 - I_(1-x)(b, a)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * beta_fraction(a, b, x) / a
    return 1 - math.exp(log_front) * beta_fraction(b, a, 1 - x) / b


def beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), evaluated by the modified Lentz method."""
    def nonzero(v: float) -> float:
        return v if abs(v) > 1e-300 else 1e-300

    c, d = 1.0, 1 / nonzero(1 - (a + b) * x / (a + 1))
    fraction = d
    for m in range(1, 10_000):
        for coefficient in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 / nonzero(1 + coefficient * d)
            c = nonzero(1 + coefficient / c)
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            return fraction
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (fractional df allowed, as Welch needs)."""
    if math.isinf(t) or math.isnan(t):  # nan: a diverged run's loss; it propagates to "not significant"
        return t if math.isnan(t) else float(t > 0)
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1 - tail if t > 0 else tail


def p_less(difference: float, se: float, df: float) -> float:
    """One-sided p-value for H1 'the true difference is < 0', given the observed one and its standard error."""
    if se == 0:  # identical values: t is ±inf, and a zero difference is no evidence either way
        return 0.0 if difference < 0 else 1.0
    return t_cdf(difference / se, df)


def p_two_sided(difference: float, se: float, df: float) -> float:
    if se == 0:
        return 1.0 if difference == 0 else 0.0
    return 2 * t_cdf(-abs(difference) / se, df)


def mean(values) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


def variance(values: list[float]) -> float:
    """The sample variance (n - 1). Not the statistics module's: in Python 3.11 it raises on nan."""
    center = mean(values)
    return math.fsum((v - center) ** 2 for v in values) / (len(values) - 1)


def mean_below_target_p(values: list[float], target: float) -> float | None:
    """One-sided one-sample t-test, H1: mean < target. None below n = 2 (no variance estimate)."""
    if len(values) < 2:
        return None
    se = math.sqrt(variance(values) / len(values))
    return p_less(mean(values) - target, se, len(values) - 1)


def welch(baseline: list[float], candidate: list[float]) -> tuple[float, float, float] | None:
    """mean(candidate) - mean(baseline), its standard error, Welch–Satterthwaite df; None below n = 2."""
    if min(len(baseline), len(candidate)) < 2:
        return None
    va, vb = (variance(v) / len(v) for v in (baseline, candidate))
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(baseline) - 1) + vb ** 2 / (len(candidate) - 1)) if se > 0 else math.inf
    return mean(candidate) - mean(baseline), se, df


def significant(p: float | None) -> bool:
    return p is not None and p < ALPHA  # false for nan too


def verdict(time_p: float | None, loss_p: float | None) -> str:
    """Speed first: a loss that is not significant only calls for more runs when the change is faster."""
    if not significant(time_p):
        return "not faster"
    if not significant(loss_p):
        return "loss not significant"
    return "record"


def losses(runs: list[Run]) -> list[float]:
    return [run.final.loss for run in runs]


def times_s(runs: list[Run]) -> list[float]:
    return [run.final.time_ms / 1000 for run in runs]


def resolve_target(runs: list[Run], given: float | None) -> tuple[float, str]:
    """--target, else the logs' target_val_loss when they all agree, else the record target."""
    if given is not None:
        return given, "--target"
    targets = {run.hyperparameters.get("target_val_loss") for run in runs}
    if len(targets) == 1 and None not in targets:
        return float(targets.pop()), "the logs' target_val_loss"
    if targets == {None}:
        return RECORD_TARGET, "the record target: the logs name none"
    return RECORD_TARGET, "the record target; the logs' target_val_loss values differ"


# ----------------------------------------------------------------------------------------------------
# Text output

def table(rows: list[list[str]]) -> str:
    """Left-aligned columns; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_p(p: float | None) -> str:
    if p is None:
        return "n/a (p needs n >= 2)"
    return f"{p:.3g} ({'significant' if significant(p) else 'not significant'} at {ALPHA})"


def mean_std(values: list[float], digits: int, unit: str = "") -> str:
    average = f"{mean(values):.{digits}f}{unit}"
    if len(values) < 2:
        return f"{average} (n=1: std needs n >= 2)"
    return f"{average} ± {math.sqrt(variance(values)):.{digits}f}{unit} (n={len(values)})"


def run_row(run: Run) -> list[str]:
    point = run.final if run.problem is None else run.last
    timing = [f"{point.time_ms / 1000:.3f} s", f"{point.step_avg_ms:.2f} ms"] if point else ["-", "-"]
    return [str(run.path), f"{run.final.loss:.4f}" if run.problem is None else "incomplete", *timing,
            f"{point.step if point else 0}/{run.num_iterations}", run.peak_memory or "-", run.torch, run.device]


def summary(args) -> str:
    runs = load(args.logs)
    header = ["run", "final val loss", "train time", "step_avg", "steps", "peak memory", "torch", "device"]
    lines = [table([header] + [run_row(run) for run in runs]), ""]
    complete = counted(runs)
    target, source = resolve_target(complete, args.target)
    lines += [f"complete runs: {len(complete)} of {len(runs)}",
              f"val loss:   {mean_std(losses(complete), 4)}",
              f"train time: {mean_std(times_s(complete), 3, ' s')}",
              f"target {target:g} ({source}); one-sided t-test, H1 mean val loss < target: "
              f"p = {format_p(mean_below_target_p(losses(complete), target))}"]
    return "\n".join(lines)


def compare(args) -> str:
    if len(args.groups or []) != 1:
        raise LogError("compare takes two groups: BASELINE_LOG... -- CANDIDATE_LOG...")
    baseline, candidate = counted(load(args.logs)), counted(load(args.groups[0]))
    target, source = resolve_target(candidate, args.target)
    time_test, loss_test = welch(times_s(baseline), times_s(candidate)), welch(losses(baseline), losses(candidate))
    time_p = p_less(*time_test) if time_test else None
    loss_p = mean_below_target_p(losses(candidate), target)
    lines = [f"{name}: train time {mean_std(times_s(runs), 3, ' s')}, val loss {mean_std(losses(runs), 4)}"
             for name, runs in (("baseline ", baseline), ("candidate", candidate))]
    named = [sorted({run.hyperparameters.get("target_val_loss") for run in runs} - {None})
             for runs in (baseline, candidate)]
    if args.target is None and len(set(named[0] + named[1])) > 1:  # the verdict depends on the target: say which
        lines.insert(0, f"target: the baseline's logs name target_val_loss {', '.join(map(str, named[0])) or 'none'} "
                        f"and the candidate's {', '.join(map(str, named[1])) or 'none'}; judged by {target:g} "
                        f"({source}); give --target T to judge both by another")
    base_time = mean(times_s(baseline))
    time_change = mean(times_s(candidate)) - base_time
    # a baseline logged at 0 s (its train_time rounds to 0 ms) has no relative change
    relative = f"{100 * time_change / base_time:+.1f}%" if base_time > 0 else "n/a: the baseline's time is 0 s"
    lines.append(f"train time: candidate - baseline = {time_change:+.3f} s ({relative}); "
                 f"Welch one-sided p (candidate faster) = {format_p(time_p)}")
    if not mean(losses(baseline)) < target:  # its time to the target is unbounded: any run that gets there is faster
        time_p = 0.0
        lines.append(f"the baseline does not reach the target {target:g} (mean val loss "
                     f"{mean(losses(baseline)):.4f}): a candidate that does is faster, whatever its time")
    loss_change = mean(losses(candidate)) - mean(losses(baseline))
    lines.append(f"val loss: candidate - baseline = {loss_change:+.4f}; "
                 f"Welch two-sided p = {format_p(p_two_sided(*loss_test) if loss_test else None)}")
    lines.append(f"candidate vs target {target:g} ({source}): one-sided p (mean < target) = {format_p(loss_p)}")
    devices = {run.device for run in baseline + candidate}
    if len(devices) > 1:
        lines.append(f"warning: the runs used different hardware ({'; '.join(sorted(devices))}): "
                     "times compare only on the same hardware")
    lines.append(f"verdict: {verdict(time_p, loss_p)}")
    return "\n".join(lines)


def diff(args) -> str:
    a, b = (read_log(Path(name)) for name in args.logs)
    code = "".join(difflib.unified_diff(a.source.splitlines(keepends=True), b.source.splitlines(keepends=True),
                                        fromfile=str(a.path), tofile=str(b.path)))
    names = [f"{label} = {run.path}" + (f" (incomplete: {run.problem})" if run.problem else "")
             for label, run in (("A", a), ("B", b))]
    return "\n".join([*names, "", "# source diff (A -> B)",
                      code.rstrip("\n") or "(the embedded sources are identical)", "",
                      "# hyperparameters that differ (A -> B)", hyperparameter_diff(a, b), "",
                      "# val loss vs train time", curves_side_by_side(a, b)])


def hyperparameter_diff(a: Run, b: Run) -> str:
    # run_id differs by construction and names nothing about the run's setup
    keys = sorted((a.hyperparameters.keys() | b.hyperparameters.keys()) - {"run_id"})
    missing = object()
    changed = [(k, a.hyperparameters.get(k, missing), b.hyperparameters.get(k, missing)) for k in keys]
    rows = [[k, "(absent)" if va is missing else json.dumps(va), "->", "(absent)" if vb is missing else json.dumps(vb)]
            for k, va, vb in changed if va != vb]
    return table(rows) if rows else "(none)"


def curves_side_by_side(a: Run, b: Run) -> str:
    by_step = [{p.step: p for p in run.val} for run in (a, b)]
    rows = [["step", "A val_loss", "A train_time", "B val_loss", "B train_time"]]
    for step in sorted(by_step[0].keys() | by_step[1].keys()):
        cells = [str(step)]
        for points in by_step:
            p = points.get(step)
            cells += [f"{p.loss:.4f}", f"{p.time_ms / 1000:.3f} s"] if p else ["", ""]
        rows.append(cells)
    return table(rows)


# ----------------------------------------------------------------------------------------------------
# Plot

@dataclass
class Curve:
    label: str
    steps: list[int]
    times_s: list[float]
    losses: list[float]
    complete: bool


def run_curves(runs: list[Run]) -> list[Curve]:
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # run ids repeat across record folders (seed0.txt, ...)
        names = [str(run.path.with_suffix("")) for run in runs]
    return [Curve(name + ("" if run.problem is None else " (incomplete)"), [p.step for p in run.val],
                  [p.time_ms / 1000 for p in run.val], [p.loss for p in run.val], run.problem is None)
            for name, run in zip(names, runs)]


def group_curve(runs: list[Run], index: int) -> Curve:
    """The group's mean val loss and mean train time at the val steps all its runs share."""
    by_step = [{p.step: p for p in run.val} for run in runs]
    steps = sorted(set.intersection(*(set(points) for points in by_step)))
    folders = {run.path.resolve().parent.name for run in runs}
    name = folders.pop() if len(folders) == 1 else f"group {index + 1}"
    return Curve(f"{name} (mean of {len(runs)})", steps,
                 [mean(points[s].time_ms for points in by_step) / 1000 for s in steps],
                 [mean(points[s].loss for points in by_step) for s in steps], True)


def make_figure(curves: list[Curve], target: float):
    """Val loss against train time and against step: one line per curve, and the target."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(figure)
    by_time, by_step = figure.subplots(1, 2, sharey=True)
    for curve in curves:
        style = "-" if curve.complete else "--"
        by_time.plot(curve.times_s, curve.losses, style, marker=".", label=curve.label)
        by_step.plot(curve.steps, curve.losses, style, marker=".", label=curve.label)
    for axes, xlabel in ((by_time, "train time (s)"), (by_step, "step")):
        axes.axhline(target, color="black", linestyle=":", label=f"target {target:g}", gid="target")
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
    by_time.set_ylabel("validation loss")
    # step 0 sits at ~ln(vocab) for every run; leaving it out of the y range keeps the finish readable
    later = [loss for curve in curves for step, loss in zip(curve.steps, curve.losses) if step > 0 and
             math.isfinite(loss)]
    if later:
        low, high = min(later + [target]), max(later + [target])
        margin = 0.05 * (high - low) or 0.1
        by_time.set_ylim(low - margin, high + margin)
    figure.legend(*by_step.get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    return figure


def check_output(output: Path) -> None:
    """Refuse, before any log is read, an output matplotlib would fail on only after the work, or would write
    elsewhere (a name without a suffix gets .png appended; a symbolic link leads to another file)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if output.is_symlink():
        raise LogError(f"-o {output}: a symbolic link (to {os.readlink(output)}), and plot writes through none; "
                       "give the path of the image itself")
    if kind := not_a_file(output):
        raise LogError(f"-o {output}: {kind}; the output must be a file path such as curves.png")
    formats = FigureCanvasAgg.get_supported_filetypes()
    if output.suffix[1:].lower() not in formats:
        raise LogError(f"-o {output}: the suffix {output.suffix or '(none)'} names no format matplotlib writes; "
                       f"use one of {', '.join('.' + f for f in sorted(formats))}")


def plot(args) -> str:
    check_output(Path(args.output))
    groups = [args.logs] + (args.groups or [])
    if len(groups) == 1:  # one line per run, crashed ones too (dashed): where a run diverged is worth seeing
        runs = load(args.logs)
        curves = run_curves(runs)
    else:
        run_groups = [counted(load(group)) for group in groups]
        runs = [run for group in run_groups for run in group]
        curves = [group_curve(group, i) for i, group in enumerate(run_groups)]
    target, _ = resolve_target(runs, args.target)
    write_image(make_figure(curves, target), Path(args.output))
    return f"wrote {args.output}: {len(curves)} line(s) and the target {target:g}"


def write_image(figure, output: Path) -> None:
    """The figure into a temporary file beside output, then renamed onto it: a failed write leaves output as it was,
    and the rename replaces whatever name stands there (a link made since the check too), never a file it leads to."""
    temporary = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    created = False
    try:
        with open(temporary, "xb") as file:  # (x: never onto something already there)
            created = True
            figure.savefig(file, dpi=100, format=output.suffix[1:].lower())
        os.replace(temporary, output)
    except OSError as e:
        if created:
            temporary.unlink(missing_ok=True)
        raise LogError(f"{output}: cannot write it ({e.strerror or e})") from None


# ----------------------------------------------------------------------------------------------------
# Command line

def target_flag(text: str) -> float:
    """--target's value, held to the rule a log's target_val_loss is."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if not is_target(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logs.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, usage: str, nargs="+", groups=False, target=True):
        sub = commands.add_parser(name, help=help, usage=f"logs.py {name} {usage}", description=help)
        sub.add_argument("logs", nargs=nargs, metavar="LOG")
        if groups:
            sub.add_argument(GROUP_FLAG, nargs="+", action="append", dest="groups", help=argparse.SUPPRESS)
        if target:
            sub.add_argument("--target", type=target_flag,
                             help="target val loss (default: the logs' target_val_loss when they agree, else 3.28)")
        return sub

    command("summary", "per-run results; mean, std and p-value against the target", "LOG... [--target T]")
    command("compare", "baseline runs vs candidate runs: time and loss differences, Welch tests, verdict",
            "BASELINE_LOG... -- CANDIDATE_LOG... [--target T]", groups=True)
    command("diff", "source diff, differing hyperparameters, and val-loss curves of two runs", "LOG_A LOG_B",
            nargs=2, target=False)
    command("plot", "val loss vs train time and vs step, per run or (with --) per group",
            "LOG... [-- LOG... ...] -o OUT.png [--target T]", groups=True).add_argument(
        "-o", "--output", required=True, help="the image to write; its suffix picks the format (.png, .pdf, .svg, ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args([GROUP_FLAG if arg == "--" else arg for arg in argv])
    try:
        print(COMMANDS[args.command](args))
    except LogError as e:
        print(f"logs.py: error: {e}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {"summary": summary, "compare": compare, "diff": diff, "plot": plot}

if __name__ == "__main__":
    sys.exit(main())
