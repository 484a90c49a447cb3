"""Under pytest-xdist (pytest.ini: -n auto) each worker is a process of its own, and torch would give every one of
them a thread per core: two workers on two cores would run four. Each worker gets an equal share of the cores for
torch's intra-op threads instead (tests/test_xdist_threads.py), and so do the processes a worker starts (the CLI,
the scripts): OMP_NUM_THREADS, which torch reads when it loads. On the busy 2-core machine a tiny-model CLI run
took 76 s with a thread per core against 22 s with one (OpenMP's barriers spin on cores the other worker holds)."""
import os


def worker_threads(cpus: int | None, workers: int) -> int:
    return max(1, (cpus or 1) // max(1, workers))


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":  # (the root conftest chose the interpreter: no CUDA here)
        from interpreter_patch import cache_builtin_names
        cache_builtin_names()  # the interpreter's per-launch patch without its getmembers scans (its docstring)
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if n and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        share = worker_threads(os.cpu_count(), int(n))
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)
