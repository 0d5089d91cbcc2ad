"""Faults in a running job end with a message and the last checkpoint named, never a hang; no run cuts or
overwrites another run's log or checkpoints; values that would crash later are refused at start. Each fault is
reproduced as a user meets it (the command line, real gloo processes, real signals) and each refusal checked for
its exit status, its one-line message, and every earlier file left byte for byte (sha256) as it was."""
import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_gpt
from conftest import REPO_ROOT, file_size_limit
from synthetic import TWO_LAYERS, tiny_flags
from test_checkpoints import assert_states_equal, step_lines
from test_inputs import refused


def digests(folder: Path) -> dict:
    """sha256 of every file under folder, by path."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def flags(files, tmp_path, run_id="run", **overrides):
    return tiny_flags(files, **dict(dict(log_dir=tmp_path / "logs", run_id=run_id, num_iterations=8,
                                         val_loss_every=0), **overrides))


def launch(argv, rank=None, world_size=2, port=None, **popen):
    """train_gpt.py as a user starts it: one process, or one rank of world_size on MASTER_PORT port."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "train_gpt.py"), *map(str, argv)], env=env,
                            **dict(dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), **popen))


def refused_at_the_command_line(argv, *words, env=None):
    """The trainer run as a command exits 2 with one line naming each of words, and no traceback."""
    result = subprocess.run([sys.executable, str(REPO_ROOT / "train_gpt.py"), *map(str, argv)], capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    for word in words:
        assert str(word) in result.stderr, (word, result.stderr)
    return result.stderr


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged(log: Path, text: str):
    return lambda: log.exists() and text in log.read_text()


# 1-4. no run cuts another's log or loses checkpoints

def test_resuming_into_another_log_dir_never_cuts_that_folder_s_run_of_the_same_id(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "exp", save_every=2, num_iterations=2, log_dir=tmp_path / "A"))
    train_gpt.main(flags(files, tmp_path, "exp", save_every=2, num_iterations=2, log_dir=tmp_path / "B", seed=1))
    before = digests(tmp_path / "B")
    refused_at_the_command_line(flags(files, tmp_path, "exp", num_iterations=6, log_dir=tmp_path / "B",
                                      resume=tmp_path / "A" / "exp" / "step000002.pt"),
                                f"{tmp_path / 'B' / 'exp.txt'} is not the log of the run that saved the checkpoint",
                                "resume with the --log_dir the checkpoint was saved in")
    assert digests(tmp_path / "B") == before


def test_resume_latest_takes_the_highest_step_not_the_last_name(tmp_path):
    args = train_gpt.parse_args(["--preset", "tiny", "--log_dir", str(tmp_path), "--run_id", "r"], cuda=False)
    (tmp_path / "r").mkdir()
    for name in ("step999999.pt", "step1000000.pt", "step000005.pt"):
        (tmp_path / "r" / name).write_bytes(b"")
    assert sorted(p.name for p in (tmp_path / "r").glob("step*.pt"))[-1] == "step999999.pt"  # what text order says
    for name in ("step000005.pt.tmp", "stepx.pt", "step000007.pt.before_resume_from_5"):  # no checkpoints
        (tmp_path / "r" / name).write_bytes(b"")
    assert list(train_gpt.saved_checkpoints(args)) == [5, 999999, 1000000]


def test_resuming_from_an_older_checkpoint_keeps_the_later_ones_and_the_replayed_log(tmp_path, files, capsys):
    train_gpt.main(flags(files, tmp_path, "old", save_every=2, num_iterations=6))
    folder, log = tmp_path / "logs" / "old", tmp_path / "logs" / "old.txt"
    before = digests(tmp_path / "logs")
    train_gpt.main(flags(files, tmp_path, "old", save_every=2, num_iterations=6, resume=folder / "step000002.pt"))
    said = capsys.readouterr().out
    assert "resuming run old from step 2, before its later checkpoints: kept in" in said
    for step in (4, 6):
        kept = folder / f"step{step:06d}.pt.before_resume_from_2"
        assert digests(tmp_path / "logs")[kept] == before[folder / f"step{step:06d}.pt"]
    copy = log.with_name("old.txt.replayed")
    assert digests(tmp_path / "logs")[copy] == before[log] and f"kept as {copy}" in said
    assert list(train_gpt.saved_checkpoints(train_gpt.parse_args(
        ["--preset", "tiny", "--log_dir", str(tmp_path / "logs"), "--run_id", "old"], cuda=False))) == [2, 4, 6]


def test_a_running_job_s_id_is_refused_and_its_folder_moved_or_its_log_folder_deleted_ends_it_in_one_line(tmp_path,
                                                                                                         files):
    """A second run of a running job's id, fresh or resuming, is refused at once, and no lock file is left to tidy.
    Issue 32, cases 1, 8 and 9: a run whose folder was moved once made it again, so that a second run of its id
    resumed into its log; one whose log folder was deleted ended in two chained tracebacks. (The first run prints to
    a full device, which once killed it before step 1.) Each run is frozen while its folder goes; each message's
    advice is then followed."""
    argv = flags(files, tmp_path, "busy", num_iterations=12, save_every=2)
    deleted = flags(files, tmp_path, "gone", num_iterations=12, log_dir=tmp_path / "L")
    with open("/dev/full", "w") as full:
        runs = [launch(argv, stdout=full), launch(deleted)]
    logs = [tmp_path / "logs" / "busy.txt", tmp_path / "L" / "gone.txt"]
    for run, log in zip(runs, logs):
        wait_for(logged(log, "\nstep:3/12 "), "step 3")
        run.send_signal(signal.SIGSTOP)
    assert not list(tmp_path.rglob("*.lock"))  # nothing a user would think safe to delete
    started = time.time()
    for second in [launch(argv), launch([*argv, "--resume=latest"])]:  # started afresh, or resuming
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2 and "run id busy is in use" in err and "Traceback" not in err, err
    assert time.time() - started < 60
    folder = tmp_path / "logs" / "busy"
    folder.rename(tmp_path / "logs" / "busy.moved")
    shutil.rmtree(tmp_path / "L")
    ended = []
    for run in runs:
        run.send_signal(signal.SIGCONT)
        ended.append(run.communicate(timeout=120)[1])
        assert run.returncode == 2 and ended[-1].count("\n") == 1 and "Traceback" not in ended[-1], ended[-1]
    assert ended[0] == (f"error: the run's folder {folder} was moved, replaced or deleted during the run, and a run "
                        f"writes only into the folder it locked; to continue, put it back at {folder} and run again "
                        "with --run_id busy --resume latest\n")
    assert re.fullmatch(rf"error: cannot write the log {logs[1]} \(No such file or directory\): it was deleted, moved "
                        r"or replaced by a link during the run, then continue .*\n", ended[1]), ended[1]
    assert not folder.exists() and not (tmp_path / "L").exists()  # neither made again
    before = digests(tmp_path / "logs")
    refused([*argv, "--resume=latest"], "run id busy is taken", f"a log {logs[0]} exist")
    assert digests(tmp_path / "logs") == before
    (tmp_path / "logs" / "busy.moved").rename(folder)  # the advice, followed
    train_gpt.main([*argv, "--resume=latest"])
    text = logs[0].read_text()
    assert text.count("\nrun: id=busy") == 1 and int(re.search(r"\nresumed: step:(\d+)/12 ", text)[1]) >= 2
    assert [int(n) for n in re.findall(r"^step:(\d+)/12 train_loss:", text, re.M)] == list(range(1, 13))
    train_gpt.main([*deleted, "--resume=latest"])  # the other advice, followed: no checkpoint, so from step 0
    assert re.search(r"\nno checkpoint of run gone yet: starting from step 0\n(?s:.*)\nstep:12/12 val_loss",
                     logs[1].read_text())
    assert not (tmp_path / "L" / "gone").exists()  # a run that saves nothing leaves no empty folder behind


# 5, 6, 10. a rank that stops answering or dies, and one that never comes

def two_ranks(argv, port):
    return [launch(argv, rank, 2, port) for rank in range(2)]


def frozen(argv, at: str, log: Path) -> tuple[str, str, float]:
    """Two ranks of argv, rank 1 frozen (SIGSTOP) once rank 0's log shows `at` and run again (SIGCONT) once rank 0 has
    ended: what each printed, and how long rank 0 took to end after the freeze."""
    ranks = two_ranks(argv, train_gpt.free_port())
    wait_for(logged(log, at), at.strip())
    ranks[1].send_signal(signal.SIGSTOP)
    frozen_at = time.time()
    err = ranks[0].communicate(timeout=60)[1]
    took = time.time() - frozen_at
    ranks[1].send_signal(signal.SIGCONT)
    late = ranks[1].communicate(timeout=60)[1]
    assert [rank.returncode for rank in ranks] == [train_gpt.EXIT_LOST] * 2, (err, late)
    return err, late, took


def finished(argv):
    """Two ranks of argv, run to the end."""
    for process in two_ranks(argv, train_gpt.free_port()):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]


def test_a_frozen_rank_is_named_in_time_every_rank_says_so_in_one_line_and_the_advice_ends_as_one_run(tmp_path,
                                                                                                      files):
    """Rank 1 frozen in step 1, then in step 5: rank 0 names it within --collective_timeout and the roll call, exits
    5 and leaves nothing partial; rank 1, run again, finds the run over and says so in one line. The advice, followed,
    starts the first run over (no checkpoint yet) and resumes the second from step 3, which then ends as the first
    does. Issue 32, cases 7 and 10: a rank frozen in step 1 was once noticed only at gloo's own timeout (the watchdog
    began with step 2), the frozen rank printed gloo's tracebacks, and with no checkpoint yet the advice to continue
    with --resume latest was refused ("run id X is taken")."""
    logs = tmp_path / "logs"
    early = flags(files, tmp_path, "early", num_iterations=6, save_every=6, collective_timeout=3)
    err, late, took = frozen(early, "\nrun: id=early ", logs / "early.txt")  # rank 1 is past every collective before
    assert took < 3 + 10                                                    # step 1
    advice = re.escape("no checkpoint was saved; once every rank is up, start again (its log is kept aside) with "
                       "--run_id early --resume latest\n")
    assert re.fullmatch(r"rank 1 stopped answering: rank 0 waited 3 s in a collective in step 1 "
                        rf"\(--collective_timeout\); {advice}", err), err
    # (frozen before its watchdog began, rank 1 learns it only from a collective that fails)
    assert re.fullmatch(r"(rank 1 did not run for \d+ s \(its process was stopped\), longer than "
                        r"--collective_timeout 3: the other ranks have ended the run|rank 0, which holds the run's "
                        rf"store, stopped answering: rank 1 saw a collective fail) in step 1(?: \(.*\))?; {advice}",
                        late), late
    lost_attempt = digests(logs)[logs / "early.txt"]
    finished([*early, "--resume=latest"])  # the advice, followed: the run from its start, uninterrupted
    assert digests(logs)[logs / "early.txt.unfinished"] == lost_attempt
    assert "\nlost: " not in (logs / "early.txt").read_text()

    argv, log = flags(files, tmp_path, "lost", num_iterations=6, save_every=3, collective_timeout=3), logs / "lost.txt"
    err, late, took = frozen(argv, "\nstep:4/6 ", log)
    advice = re.escape(f"the last checkpoint is {logs / 'lost' / 'step000003.pt'} (step 3); once every rank is up, "
                       "continue with --run_id lost --resume latest")
    message = re.compile(rf"rank 1 stopped answering: rank 0 waited 3 s in a collective in step (\d+) .*; {advice}$")
    assert message.search(err.strip()) and took < 3 + 10, err
    last_line = log.read_text().splitlines()[-1]
    assert last_line.startswith("lost: ") and int(message.search(last_line)[1]) >= 5, last_line
    assert re.fullmatch(r"rank 1 did not run for \d+ s \(its process was stopped\), longer than --collective_timeout "
                        rf"3: the other ranks have ended the run in step \d+; {advice}\n", late), late
    assert sorted(p.name for p in (logs / "lost").iterdir()) == ["step000003.pt"]  # nothing partial
    finished([*argv, "--resume=latest"])
    assert step_lines(log.read_text()) == step_lines((logs / "early.txt").read_text())
    assert_states_equal(torch.load(logs / "lost" / "step000006.pt", weights_only=True),
                        torch.load(logs / "early" / "step000006.pt", weights_only=True))


def test_a_job_paused_whole_for_longer_than_the_timeout_goes_on_when_it_runs_again(tmp_path, files):
    """Every rank stopped together (a suspended job: Slurm's scontrol suspend, docker pause), then continued: each
    rank's watchdog sees its own gap, finds every rank at the roll call, and the run ends as usual."""
    ranks = two_ranks(flags(files, tmp_path, "paused", num_iterations=6, collective_timeout=2), train_gpt.free_port())
    wait_for(logged(tmp_path / "logs" / "paused.txt", "\nstep:2/6 "), "step 2")
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)
    time.sleep(4)
    for rank in ranks:
        rank.send_signal(signal.SIGCONT)
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-2000:]
    assert re.search(r"\nstep:6/6 val_loss:", (tmp_path / "logs" / "paused.txt").read_text())


def test_a_killed_rank_is_named_with_its_step_and_the_last_checkpoint(tmp_path, files):
    argv = flags(files, tmp_path, "lost", num_iterations=6, save_every=3, collective_timeout=3)
    started = time.time()
    ranks = two_ranks(argv, train_gpt.free_port())
    log = tmp_path / "logs" / "lost.txt"
    wait_for(logged(log, "\nstep:4/6 "), "step 4")
    ranks[1].kill()
    out, err = ranks[0].communicate(timeout=60)
    ranks[1].communicate()
    assert ranks[0].returncode == train_gpt.EXIT_LOST == 5 and "Traceback" not in err, err[-2000:]
    # a killed rank's links close: the others' collective fails, unless the watchdog's timeout comes first
    message = re.compile(r"rank 1 stopped answering: rank 0 (?:saw a collective fail|waited 3 s in a collective) in "
                         rf"step (\d+) .*; the last checkpoint is {log.parent / 'lost' / 'step000003.pt'} \(step 3\); "
                         r"once every rank is up, continue with --run_id lost --resume latest$")
    assert message.search(err.strip()) and time.time() - started < 60, err
    assert log.read_text().splitlines()[-1] == f"lost: {err.strip()}"
    assert sorted(p.name for p in (log.parent / "lost").iterdir()) == ["step000003.pt"]  # nothing partial


def test_a_rank_alone_in_a_world_of_two_ends_after_the_timeout_naming_what_is_missing(tmp_path, files):
    started = time.time()
    alone = launch(flags(files, tmp_path, collective_timeout=2), rank=0, port=train_gpt.free_port())
    out, err = alone.communicate(timeout=60)
    assert alone.returncode == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "rank 0 waited 2 s (--collective_timeout)" in err and "WORLD_SIZE=2" in err and "1/2" in err
    assert time.time() - started < 30


@pytest.mark.parametrize("env, words", [
    (dict(WORLD_SIZE="0"), "WORLD_SIZE='0' must be a whole number from 1"),
    (dict(WORLD_SIZE="abc"), "WORLD_SIZE='abc' must be a whole number from 1"),
    (dict(RANK="1"), "RANK='1' must be a whole number from 0 to 0"),
    (dict(WORLD_SIZE="2", RANK="1"), "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT"),
    (dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="99999"), "MASTER_PORT='99999'"),
    (dict(LOCAL_WORLD_SIZE="abc"), "LOCAL_WORLD_SIZE='abc' must be a whole number from 1 to 1"),  # issue 32, case 8
])
def test_a_malformed_launch_environment_is_refused_before_any_work(tmp_path, files, monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    refused(flags(files, tmp_path), words)
    assert not (tmp_path / "logs").exists()


def test_a_run_id_of_bytes_that_are_not_utf8_is_refused_at_the_command_line(tmp_path):
    """Issue 32, case 8: `--run_id $'bad\\xffid'` once ended in a UnicodeEncodeError."""
    refused_at_the_command_line(["--preset", "tiny", "--log_dir", tmp_path, "--run_id", "bad\udcffid"],
                                "--run_id 'bad\\udcffid' holds bytes that are not UTF-8 text")
    assert not any(tmp_path.iterdir())


# 7, 11. values that pass the parser and crash or exhaust the machine later

def test_an_unreachable_iteration_count_is_refused_at_once_in_little_memory(tmp_path, files):
    # the trainer as a command, reporting its own peak memory (VmHWM: this program's, not the forked test's)
    report_peak = ("import re, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
                   "run_name='__main__')\nfinally:\n    print(re.search(r'VmHWM:\\s+(\\d+)', "
                   "open('/proc/self/status').read())[1], file=sys.stderr)")
    started = time.time()
    result = subprocess.run([sys.executable, "-c", report_peak, str(REPO_ROOT / "train_gpt.py"),
                             *flags(files, tmp_path, num_iterations=10_000_000_000, save_every=1)],
                            capture_output=True, text=True, timeout=120)
    *message, peak_kib = result.stderr.splitlines()
    assert result.returncode == 2 and message == ["error: --num_iterations must be a whole number > 0 and below "
                                                  "2**31, got 10000000000"], result.stderr
    assert int(peak_kib) * 1024 < 2**30 and time.time() - started < 60


def test_checkpoints_are_counted_not_listed_for_the_room_check(tmp_path, monkeypatch):
    args = train_gpt.parse_args(["--preset", "tiny", "--log_dir", str(tmp_path), "--num_iterations", str(2**31 - 1),
                                 "--save_every", "1"], cuda=False)
    started = time.time()
    with pytest.raises(train_gpt.UserError, match="its log and 2147483648 checkpoint"):  # every step's and a stop's
        train_gpt.check_room_for_the_run(args, 0)
    assert time.time() - started < 10
    monkeypatch.setattr(train_gpt.shutil, "disk_usage", lambda path: type("Usage", (), dict(free=2**20))())
    with pytest.raises(train_gpt.UserError, match=r"its log and 1 checkpoint\(s\)"):  # --save_every 0: a stop's
        train_gpt.check_room_for_the_run(dataclasses.replace(args, num_iterations=10, save_every=0), 0)
    with pytest.raises(train_gpt.UserError, match=r"its log and 3 checkpoint\(s\).*--keep_last 2"):
        train_gpt.check_room_for_the_run(dataclasses.replace(args, num_iterations=10, save_every=1, keep_last=2), 0)


@pytest.mark.parametrize("extra, words", [
    (["--final_window_blocks", "1000000000000000000"],
     "--final_window_blocks 1e+18 must be a token or more (128-token blocks) and below 2**31 tokens"),
    (["--model_dim", "1048576", "--num_heads", "8192", "--head_dim", "128"],
     "need at least"),
    # the flag that made the model too big is named, not the small ones beside it
    (["--ngram_rows", "2147483646"], "parameters (100% of them in ngram.table.weight (2147483646, 32), sized by "
                                      "--ngram_rows) need at least"),
])
def test_sizes_that_would_overflow_or_exhaust_memory_are_refused_at_start(tmp_path, files, extra, words):
    refused([*flags(files, tmp_path), *extra], words)


# 14, 20. checkpoints with a wrong field, and messages that name the real cause

def test_a_checkpoint_field_of_the_wrong_type_or_value_is_refused_by_name(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4))
    state = torch.load(tmp_path / "logs" / "C" / "step000004.pt", weights_only=True)
    before = digests(tmp_path / "logs")
    nan_model = dict(state["model"], **{"embed.weight": torch.full_like(state["model"]["embed.weight"], float("nan"))})
    adam, muon = (next(name for name, entries in state[kind].items() if entries) for kind in ("adam", "muon"))

    def edited(kind, name, **entries):  # the state with some of one parameter's optimizer state replaced
        return dict(state, **{kind: dict(state[kind], **{name: dict(state[kind].get(name, {}), **entries)})})
    exp_avg, momentum = state["adam"][adam]["exp_avg"], state["muon"][muon]["momentum_buffer"]
    for broken, words in ((dict(state, step="4"), "bad step field '4' (expected a step count >= 0)"),
                          (dict(state, step=-1), "bad step field -1"),
                          (dict(state, data="x"), "bad data field 'x'"),
                          (dict(state, data=dict(state["data"], offset=-5)), "bad data field (expected"),
                          (dict(state, training_time_ms="soon"), "bad training_time_ms field"),
                          (dict(state, training_time_ms=float("inf")), "bad training_time_ms field inf (expected a "
                                                                       "finite number >= 0)"),
                          (dict(state, model=nan_model), "non-finite values in tensor embed.weight"),
                          # issue 32, case 4: a wrong shape once crashed the process (SIGSEGV) at the first step
                          (edited("adam", adam, exp_avg=exp_avg[:-1]), f"holds Adam state {adam}.exp_avg that is of "
                                                                       f"shape {tuple(exp_avg[:-1].shape)}, where this "
                                                                       f"model's is {tuple(exp_avg.shape)}"),
                          (edited("adam", adam, step=torch.ones(3)), f"Adam state {adam}.step that is of shape (3,)"),
                          (edited("adam", adam, exp_avg_sq=-state["adam"][adam]["exp_avg_sq"] - 1),
                           f"Adam state {adam}.exp_avg_sq that holds negative values"),
                          (edited("adam", adam, exp_avg=exp_avg.long()), "that holds torch.int64, not floating-point"),
                          (edited("adam", muon, exp_avg=momentum), f"Adam state {muon}.exp_avg that no optimizer "
                                                                   "of this model keeps"),
                          (edited("muon", muon, momentum_buffer=momentum[..., :-1]),
                           f"Muon state {muon}.momentum_buffer that is of shape"),
                          (edited("muon", muon, second_moment=torch.zeros(momentum.shape)),
                           f"Muon state {muon}.second_moment that is of shape"),
                          (dict(state, rng=dict(state["rng"], cpu=state["rng"]["cpu"].float())), "bad rng field"),
                          (dict(state, rng=dict(state["rng"], cpu=state["rng"]["cpu"][:-1])), "bad rng field")):
        bad = tmp_path / "bad.pt"
        torch.save(broken, bad)
        refused(flags(files, tmp_path, "C", resume=bad), f"checkpoint {bad}", words)
    assert digests(tmp_path / "logs") == before


def test_a_run_id_too_long_and_a_broken_log_dir_link_are_named_as_such(tmp_path, files):
    words = refused(flags(files, tmp_path, "x" * 300), "--run_id is 300 bytes long", "use at most 239 bytes")
    assert "File name too long" not in words
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "nowhere")
    loop.symlink_to(loop)
    refused(flags(files, tmp_path, log_dir=dangling), f"{dangling} is a symbolic link to {tmp_path / 'nowhere'}, "
            "which does not exist")
    refused(flags(files, tmp_path, log_dir=loop / "logs"), f"{loop} is a loop of symbolic links")


def test_a_file_size_limit_below_a_checkpoint_is_refused_at_start_and_named_when_a_write_reaches_it(tmp_path,
                                                                                                    files):
    """Issue 32, case 14: under `ulimit -f`, a checkpoint write failed with "[enforce fail ...] unexpected pos", then
    said that the earlier checkpoints were intact, where there were none."""
    folder = tmp_path / "logs" / "limited"
    folder.mkdir(parents=True)
    with file_size_limit(2**20):
        refused(flags(files, tmp_path), "this process may write files of at most 1048576 bytes (`ulimit -f`), and this "
                "run's log and checkpoints take up to", "raise the limit (`ulimit -f unlimited`)")
        failure = train_gpt.write_checkpoint(folder / "step000004.pt", dict(model=torch.zeros(2**19)))
    assert failure == (f"cannot write checkpoint {folder / 'step000004.pt'}: it reached this process's file size "
                       "limit of 1048576 bytes (`ulimit -f`): raise the limit (`ulimit -f unlimited`); no checkpoint "
                       "of this run was written")
    assert not any(folder.iterdir())


def test_no_file_is_written_through_a_link_left_where_its_temporary_file_goes(tmp_path):
    """Issue 32: every file is written through a temporary file and a rename, and never through a link."""
    precious, target = tmp_path / "precious.txt", tmp_path / "shard.bin"
    precious.write_text("another run's log")
    Path(f"{target}.tmp").symlink_to(precious)
    train_gpt.write_file_atomically(target, lambda f: f.write(b"tokens"), "data shard")
    assert precious.read_text() == "another run's log" and target.read_bytes() == b"tokens"
    assert sorted(tmp_path.iterdir()) == [precious, target]



def test_a_link_where_a_checkpoint_or_shard_goes_is_refused_by_name_and_neither_it_nor_its_target_changes(tmp_path):
    """Issue 53: a link standing at the very name a checkpoint or shard is written under is refused, not written
    through (the other run's file keeps its bytes) and not replaced (the link stays, so the user sees what happened)."""
    precious = tmp_path / "elsewhere" / "step000004.pt"
    precious.parent.mkdir()
    precious.write_bytes(b"another run's checkpoint")
    folder = tmp_path / "run"
    folder.mkdir()
    link = folder / "step000004.pt"
    link.symlink_to(precious)
    failure = train_gpt.write_checkpoint(link, dict(model=torch.zeros(3)))
    assert failure.startswith(f"{link} is a symbolic link (to {precious}): a checkpoint is written only into a file "
                              "of its own, never over or through a link"), failure
    with pytest.raises(train_gpt.UserError, match=f"{re.escape(str(link))} is a symbolic link .* a data shard is"):
        train_gpt.write_data_shard(link, [1, 2, 3])
    assert link.is_symlink() and precious.read_bytes() == b"another run's checkpoint"
    assert sorted(folder.iterdir()) == [link]


# 15-18. signals, disk use, data

def test_a_hangup_to_one_rank_stops_every_rank_with_a_checkpoint_like_sigterm(tmp_path, files):
    ranks = two_ranks(flags(files, tmp_path, "hup", num_iterations=100), train_gpt.free_port())
    log = tmp_path / "logs" / "hup.txt"
    wait_for(logged(log, "\nstep:2/100 "), "step 2")
    ranks[1].send_signal(signal.SIGHUP)  # its terminal closed
    ended = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [train_gpt.EXIT_STOPPED] * 2, ended
    assert re.search(r"stopped after step \d+ \(SIGHUP\)", ended[1][1]) and "Traceback" not in ended[0][1]
    stopped = re.search(r"\ncheckpoint: (\S+)\nstopped: step:(\d+)/100 reason:another rank was asked to stop\n$",
                        log.read_text())
    assert stopped and torch.load(stopped[1], weights_only=True)["step"] == int(stopped[2])


def test_a_second_interrupt_while_the_stop_checkpoint_is_written_lets_it_finish(tmp_path, files, monkeypatch,
                                                                                capsys):
    real_write, real_step = train_gpt.write_checkpoint, train_gpt.optimizer_step

    def interrupted_step(trainer, step):  # Ctrl-C during step 3
        real_step(trainer, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    def write_interrupted_again(path, state):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode, here, inside the write
        return real_write(path, state)
    monkeypatch.setattr(train_gpt, "optimizer_step", interrupted_step)
    monkeypatch.setattr(train_gpt, "write_checkpoint", write_interrupted_again)
    with pytest.raises(train_gpt.RunEnded, match=r"stopped after step 3 \(SIGINT\)"):
        train_gpt.main(flags(files, tmp_path, "twice"))
    assert "SIGINT again: the checkpoint being written is finished first" in capsys.readouterr().out
    assert torch.load(tmp_path / "logs" / "twice" / "step000003.pt", weights_only=True)["step"] == 3


def test_keep_last_keeps_exactly_the_newest_complete_checkpoints(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "keep", save_every=2, keep_last=2))
    assert sorted(p.name for p in (tmp_path / "logs" / "keep").iterdir()) == ["step000006.pt", "step000008.pt"]
    assert (tmp_path / "logs" / "keep.txt").read_text().count("\ncheckpoint: ") == 4


def test_training_shards_that_include_a_validation_shard_are_refused(tmp_path, files):
    both = str(Path(files["train_files"]).parent / "synth_*.bin")
    refused(flags(files, tmp_path, train_files=both), f"--train_files '{both}' matches the validation shard",
            "synth_val_000000.bin", "the run would train on its validation data")
    assert not (tmp_path / "logs" / "run.txt").exists()


# 8. a plan for thousands of ranks

def test_a_plan_runs_each_role_once_and_equals_the_plan_of_every_rank(monkeypatch):
    """36 data-parallel ranks under ZeRO 1, more than a two-layer tiny model has parameters to own (33), so several
    own none and share a role (measured by hand as well: 64 ranks of the six-layer one under --pp 2 --tp 2 --zero 3
    plan alike both ways)."""
    nproc = 36
    args = train_gpt.parse_args(["--preset", "tiny", "--seqs_per_step", str(nproc), "--val_tokens",
                                 str(256 * nproc), "--compile", "false", "--zero", "1", *TWO_LAYERS], cuda=False)
    assert len(list(train_gpt.build_model(args, torch.device("meta")).parameters())) < nproc
    builds, real_build = [], train_gpt.build_trainer
    monkeypatch.setattr(train_gpt, "build_trainer", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    plan = train_gpt.plan_layout(args, nproc, cuda=True)
    roles = len(builds)
    assert roles < nproc  # ranks in one role ran once
    monkeypatch.setattr(train_gpt, "rank_role", lambda rank, *rest: (rank,))  # every rank its own role
    every_rank = train_gpt.plan_layout(args, nproc, cuda=True)
    assert len(builds) == roles + nproc
    assert plan == every_rank and len({str(r) for r in plan["ranks"]}) > 1  # the same, and not all alike


def test_a_plan_of_4096_ranks_takes_seconds(capsys):
    started = time.time()
    train_gpt.main(["--preset", "tiny", "--plan", "--nproc", "4096", "--seqs_per_step", "4096", "--val_tokens",
                    str(4096 * 256)])
    assert time.time() - started < 60 and capsys.readouterr().out.count("\n") > 8192


def test_a_plan_at_the_largest_sequence_and_step_count_the_checks_accept_runs_as_any_plan(capsys):
    # its cost grows with ranks, layers and micro-batches: not with --num_iterations (the steps it accounts are found
    # by arithmetic) nor --train_seq_len (the dense twin's scores stand in for FlexAttention's on the meta device:
    # within int64 here); one sequence a step, so that the plans of what would fit cost one micro-batch each
    longest = str(train_gpt.MAX_SEQ_LEN)
    train_gpt.main(["--preset", "tiny", "--plan", "--nproc", "1", "--num_iterations", str(2**31 - 1), "--adam_every",
                    str(2**31 - 2), "--train_seq_len", longest, "--val_seq_len", longest, "--val_tokens", longest,
                    "--seqs_per_step", "1"])
    assert "per rank" in capsys.readouterr().out
