"""The workers of pytest-xdist share the cores for torch's threads (conftest.py)."""
import os

import pytest
import torch

from conftest import worker_threads


def test_each_worker_takes_its_share_of_the_cores():
    assert [worker_threads(2, 2), worker_threads(16, 4), worker_threads(3, 4), worker_threads(None, 2)] == [1, 4, 1, 1]
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not n:
        pytest.skip("not under pytest-xdist (-n 0): torch keeps its own thread count")
    assert torch.get_num_threads() == worker_threads(os.cpu_count(), int(n))


def test_the_processes_a_worker_starts_take_its_share_too():
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not n:
        pytest.skip("not under pytest-xdist (-n 0): the environment is left as it was")
    assert os.environ["OMP_NUM_THREADS"] == str(worker_threads(os.cpu_count(), int(n)))
