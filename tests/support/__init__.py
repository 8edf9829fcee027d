"""The suite's helpers (tests/conftest.py holds only fixtures and hooks): what the test modules import."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent  # the repository: the processes' cwd and PYTHONPATH
TESTS = REPO / "tests"  # its data folders: agents/, templates/, workers/
