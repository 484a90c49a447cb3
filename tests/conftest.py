"""Under pytest-xdist (pytest.ini: -n auto) each worker is a process of its own, and torch would give every one of
them a thread per core: two workers on two cores would run four. Each worker gets an equal share of the cores for
torch's intra-op threads instead (tests/test_xdist_threads.py), and so do the processes a worker starts (the CLI,
the scripts): OMP_NUM_THREADS, which torch reads when it loads. On the busy 2-core machine a tiny-model CLI run
took 76 s with a thread per core against 22 s with one (OpenMP's barriers spin on cores the other worker holds)."""
import os

import pytest


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


# --dist loadfile hands a module to a worker as one unit; pytest.ini turns off xdist's own order (most tests first)
# so that the modules go out in this order: the longest first, the short ones last, where they fill the gaps, so the
# two workers end together (longest-processing-time first). xdist's order put the 47 s compile-cache module and the
# 34 s GGUF module among the last handed out (3 and 4 tests), while the other worker idled. Seconds: each module's
# summed --durations in a whole-suite run on the 2-core machine unloaded (2026-12-07 evening, an AMD EPYC host:
# 1,213 s summed, 649 s wall; test_gguf_cache.py as measured after its move to a tiny GGUF); only the order
# matters. A module missing here counts 0 and keeps its place.
MODULE_SECONDS = {
    "test_sampling.py": 101, "test_distributed.py": 63, "test_ops.py": 54, "test_training_toy.py": 60,
    "test_sampling_rows.py": 45, "test_batch_invariant.py": 43, "test_training_compile_cache.py": 41,
    "test_smollm2.py": 40, "test_protocol.py": 39, "test_batch_decode_sampled.py": 38,
    "test_batch_refine_twin.py": 31, "test_kernels.py": 31, "test_training_box.py": 26, "test_topp.py": 25,
    "test_stacked_ops.py": 23, "test_loop.py": 20, "test_without_triton.py": 20, "test_tiny_runs.py": 16,
    "test_compare_runs.py": 16, "test_xpress_latent.py": 15, "test_compiling.py": 15, "test_training_online.py": 15,
    "test_batch_graphs.py": 15, "test_sweep.py": 14, "test_batch_neighbours.py": 14, "test_wide_rows.py": 14,
    "test_readme_numbers.py": 14, "test_training_rows.py": 14, "test_batched_generate_triton.py": 13,
    "test_publish.py": 13, "test_batch_decode.py": 13, "test_batch_refill.py": 12, "test_capture_plan.py": 12,
    "test_cli_refiners.py": 11, "test_training_inputs.py": 11, "test_spyre_numerics.py": 10,
    "test_training_compile.py": 10, "test_lab_launch.py": 10, "test_bench_refiner.py": 10,
    "test_training_pipeline.py": 9, "test_verify.py": 8, "test_training_init_from.py": 7, "test_xpress.py": 7,
    "test_cli.py": 7, "test_training_restart.py": 7, "test_gemma4.py": 7, "test_batched_generate.py": 6,
    "test_gguf_cache.py": 6, "test_bench_flex.py": 6, "test_training_scale.py": 6, "test_batch_draft.py": 6
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process (-n 0): the order does not matter
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path.name, i)
    items.sort(key=lambda item: (-MODULE_SECONDS.get(item.path.name, 0), first[item.path.name]))


@pytest.fixture
def no_plots(monkeypatch):
    """For tiny runs whose checks read no plot: drawing a run's plots costs about 3 s of CPU. The plots themselves
    are checked by test_tiny_runs (its module run) and test_protocol (the script, --rebuild and the
    plots-interrupted resume); the torchrun/accelerate runs of test_distributed draw theirs, unread."""
    from harness.protocol import report
    monkeypatch.setattr(report, "write_plots", lambda *a, **k: [])


@pytest.fixture(scope="module")
def no_plots_module():
    """no_plots for a whole module, its module fixtures' runs included (test_compare_runs' nine CLI runs drew about
    1.4 s of plots each, and matplotlib's first figure in a process costs about 3.5 s more, on the 2-core machine,
    2026-12-07): for modules whose checks read no plot."""
    from harness.protocol import report
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "write_plots", lambda *a, **k: [])
        yield
