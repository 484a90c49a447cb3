"""Under pytest-xdist (pytest.ini: -n auto) each worker is a process of its own, and torch would give every one of
them a thread per core: two workers on two cores would run four. Each worker gets an equal share of the cores for
torch's intra-op threads instead (tests/test_xdist_threads.py)."""
import os


def worker_threads(cpus: int | None, workers: int) -> int:
    return max(1, (cpus or 1) // max(1, workers))


def pytest_configure(config):
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if n and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(worker_threads(os.cpu_count(), int(n)))
