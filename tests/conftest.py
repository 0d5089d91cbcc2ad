"""Shared test setup: the repo root on sys.path (tests import train_gpt's parts), and shared fixtures."""
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Synthetic train and val shards, written once per test module."""
    from synthetic import write_synthetic_shards
    return write_synthetic_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def single(files):
    """Three steps of the tiny model in one process: the reference every layout must reproduce."""
    from layouts import train_steps
    return train_steps(0, 1, files, 3)
