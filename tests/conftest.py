"""Shared test setup: the repo root on sys.path (tests import train_gpt's parts), and a gloo launcher."""
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
