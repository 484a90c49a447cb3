import sys
from pathlib import Path

# Tests import the project as top-level packages and share tests/tiny.py.
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from threads, and on a busy 2-core machine OpenMP barriers make them ~40x slower."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
