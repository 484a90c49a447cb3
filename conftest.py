import os
import sys
from pathlib import Path

# Tests import the project as top-level packages and share tests/tiny.py.
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton picks its CPU interpreter when a kernel is defined, and triton.language's own helpers are defined when
    # triton is first imported (torch._dynamo imports it too): choose it before any test module loads anything
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from threads, and on a busy 2-core machine OpenMP barriers make them ~40x slower."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
