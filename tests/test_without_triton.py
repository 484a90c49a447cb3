"""The README's CPU path has no Triton (the CPU torch wheel brings none): every module of the project imports, and
the main job's decode of every arm runs, in a process where `import triton` fails; `--kernels auto` on the CPU
never imports the kernels, with Triton or without."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "harness", "drafters", "refiners", "scripts", "training")
# Imported before anything else in the child: `import triton` (and any triton.*) raises ImportError, as it does
# where Triton is not installed.
BLOCKER = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked: the CPU wheel brings no Triton)")
        return None
sys.meta_path.insert(0, _NoTriton())
"""
# Training's own extras (requirements-speculators.txt, requirements-training.txt): a module that needs one of these
# is not on the main job's path; a user who runs training installs them.
TRAINING_EXTRAS = ("speculators", "hs_connectors", "loguru", "pydantic_settings")


def modules() -> list[str]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in PACKAGES and "__pycache__" not in rel.parts:
            parts = list(rel.with_suffix("").parts)
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def run_child(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_the_blocker_blocks_triton():
    proc = run_child("import triton\n")
    assert proc.returncode != 0 and "blocked: the CPU wheel brings no Triton" in proc.stderr


# One child process where `import triton` fails runs three checks in turn, each with its own stdout, stderr and exit
# code (they took a child each: 27 s; the child starts torch and the project once). The decode runs first, so that
# "auto never imports the kernels" is read before anything else has imported them; every module is imported last.
STAGES = """
import contextlib, io, json, sys, traceback
RESULTS = {}


def stage(name, fn):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn() or 0
        except SystemExit as e:
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
    RESULTS[name] = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def decode():
    import runpy
    sys.argv = %(argv)r
    try:
        runpy.run_path("benchmark_compile_all.py", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    print("KERNELS_IMPORTED", any(m == "core.kernels" or m.startswith("core.kernels.") for m in sys.modules))


def refusal():
    from harness.lab.bench_generate import main
    rc = main(["--random-weights", "tiny", "--device", "cpu", "--prompts", "2", "--attention", "triton"])
    from core.errors import UsageError
    from harness.decode.batched_gen import BatchedGenerator
    from harness.protocol.presets import build_random
    from core.devices import resolve_backend
    m = build_random("tiny", resolve_backend("cpu", "float32"), fuse=False)
    try:
        BatchedGenerator(m.target.model, rows=2, attention="triton")
    except UsageError as e:
        print("refused:", e)
    return rc


def imports():
    import importlib
    failed = {}
    for m in %(modules)r:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] not in %(extras)r:
                failed[m] = repr(e)
        except Exception as e:
            failed[m] = repr(e)
    print(json.dumps(failed))


for name, fn in (("decode", decode), ("refusal", refusal), ("imports", imports)):
    stage(name, fn)
print("STAGES " + json.dumps(RESULTS))
"""


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    """{stage: {rc, stdout, stderr}} of the one child without Triton; the decode's results folder."""
    results = tmp_path_factory.mktemp("no_triton")
    argv = ["benchmark_compile_all.py", "--random-weights", "tiny", "--max-samples", "1", "--max-new-tokens", "4",
            "--fair-interleave", "1", "--fair-warmup-rounds", "0", "--fair-k-list", "1,2", "--device", "cpu", "--quiet",
            "--results-dir", str(results), "--run-id", "no_triton"]
    proc = run_child(STAGES % {"argv": argv, "modules": modules(), "extras": TRAINING_EXTRAS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STAGES "))
    return json.loads(line[len("STAGES "):]), results


def test_every_module_imports_without_triton(blocked):
    got = blocked[0]["imports"]
    assert got["rc"] == 0, got["stderr"][-3000:]
    assert json.loads(got["stdout"].strip().splitlines()[-1]) == {}


def test_every_arm_decodes_without_triton_and_auto_never_imports_the_kernels(blocked):
    """The main job's shape (the embedded default's arms: AR, drafter-only, Markov, xPress) on the tiny random
    preset, through the CLI, with --kernels auto on the CPU."""
    got, tmp_path = blocked[0]["decode"], blocked[1]
    assert got["rc"] == 0, got["stderr"][-3000:]
    assert "KERNELS_IMPORTED False" in got["stdout"]
    config = json.loads((tmp_path / "no_triton" / "config.json").read_text())
    assert config["resolved"]["arms"] == ["AR", "drafter-only", "Markov", "xPress(K=1)", "xPress(K=2)"]
    from harness.protocol.results_io import read_folder_rows
    rows = read_folder_rows(tmp_path / "no_triton")
    assert {r["arm"] for r in rows} == set(config["resolved"]["arms"])


# One child with Triton as installed here (TRITON_INTERPRET unset, which core.ops and core.kernels read as "0")
# serves the two checks below (a child each before: each started torch and the project). The ops check runs first,
# so that nothing else has imported the kernels when their absence is read; the refusal's exit code comes last.
PRESENT = """
import sys, torch
from core.ops import make_ops
ops = make_ops("auto", torch.device("cpu"), torch.float32)
print("OPS", type(ops).__name__, any(m.startswith(("core.kernels", "triton")) for m in sys.modules), flush=True)
from harness.lab.bench_generate import main
rc = main(['--random-weights', 'tiny', '--device', 'cpu', '--prompts', '2', '--attention', 'triton'])
print("RC", rc)
"""


@pytest.fixture(scope="module")
def present():
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PRESENT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines and lines[0].startswith("OPS "), proc.stderr[-3000:]
    return proc


def test_auto_on_the_cpu_leaves_the_kernels_unimported_with_triton_present(present):
    """Without the blocker (Triton may be installed, as in CI): --kernels auto on the CPU picks the torch ops and
    imports neither the kernels nor Triton."""
    assert present.stdout.splitlines()[0].split() == ["OPS", "TorchOps", "False"]


def test_the_triton_attention_of_the_batched_generator_is_refused_without_triton(blocked):
    """bench_generate --attention triton, and BatchedGenerator(attention="triton") itself, say in one line that
    Triton is needed (before any model loads, for the CLI) instead of failing inside a kernel launch."""
    proc = blocked[0]["refusal"]
    assert proc["rc"] == 2, proc["stderr"]
    assert "error: batched generation: attention triton needs the triton package" in proc["stderr"]
    assert "random weights" not in proc["stdout"]  # refused before the model loads
    assert "refused: batched generation: attention triton needs the triton package" in proc["stdout"]


def test_the_triton_attention_on_a_cpu_without_the_interpreter_is_refused_before_loading(present):
    """Triton installed, TRITON_INTERPRET unset, --device cpu: one line before the model loads (it was a
    RuntimeError from the kernel launch, after loading)."""
    if "needs the triton package" in present.stderr:
        return  # no Triton here: the other refusal, tested above
    assert present.stdout.splitlines()[-1] == "RC 2", present.stderr[-2000:]
    assert "attention triton runs on a CUDA device" in present.stderr and "random weights" not in present.stdout
