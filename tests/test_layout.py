"""The shape of the code base (docs/DESIGN.md): no import cycle, no file over 400 lines, algorithms free of
backend checks, the decode core free of algorithms."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "drafters", "refiners", "training")
SKIP = {".git", ".venv", "venv", "__pycache__", "node_modules", "shared"}
MAX_LINES = 400


def py_files():
    for p in sorted(ROOT.rglob("*.py")):
        if not SKIP & set(p.relative_to(ROOT).parts):
            yield p


def module_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in py_files() if p.relative_to(ROOT).parts[0] in PACKAGES}


def imports(p: Path, known: set[str]) -> set[str]:
    """Project modules `p` imports anywhere (at the top or inside a function: a lazy import is still a
    dependency): the longest known name each import statement names."""
    out, own = set(), module_name(p)
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != own:
                out.add(n)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    mods = project_modules()
    graph = {m: imports(p, set(mods)) for m, p in mods.items()}
    assert cycles(graph) == []


def test_no_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in py_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


BACKEND_WORDS = ("triton", "kernel", "cuda", "_kern", "_fast")
ALGORITHMS = [ROOT / "harness" / "decode" / "target.py", *sorted((ROOT / "drafters").glob("*.py")),
              *sorted((ROOT / "refiners").glob("*.py"))]


def backend_checks(p: Path) -> list[str]:
    """Branches whose condition names a backend, and imports of one (the ops seam is the only way in)."""
    found = []
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
        tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
        for t in tests:
            words = [n.id for n in ast.walk(t) if isinstance(n, ast.Name)] + \
                [n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)] + \
                [n.value for n in ast.walk(t) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            hit = [w for w in words if any(b in w.lower() for b in BACKEND_WORDS)]
            if hit:
                found.append(f"{p.name}:{node.lineno} branches on {hit[0]!r}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{p.name}:{node.lineno} imports {m}" for m in mods
                      if m.startswith(("triton", "harness.decode.kernels", "harness.decode.ops.triton_impl"))]
    return found


def test_backend_check_finder_sees_one():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def f(self, x):\n    if self._kern is not None:\n        return x\n    return x.cuda() if x.is_cuda "
                "else x\nfrom harness.decode import kernels\n")
    assert len(backend_checks(Path(f.name))) == 2
    Path(f.name).unlink()


def test_algorithm_modules_contain_no_backend_checks():
    assert [c for p in ALGORITHMS for c in backend_checks(p)] == []


def test_the_decode_core_knows_no_algorithm():
    """harness/decode imports only the Drafter/Refiner protocols and the identity refiner (the drafter-only
    arm): algorithms are named in harness/protocol (build.py, presets.py)."""
    mods = project_modules()
    allowed = {"drafters.base", "refiners.base", "refiners.identity"}
    bad = {m: sorted(i for i in imports(p, set(mods)) if i.startswith(("drafters", "refiners")) and i not in allowed)
           for m, p in mods.items() if m.startswith("harness.decode")}
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_gpu_check_runs_the_kernel_tests_on_cuda_too():
    """The kernel tests are not marked gpu (they run on the CPU interpreter too), so `-m gpu` alone skipped them on
    the H200: every module on kernel_env carries the `device` mark, and gpu_check.sh selects it."""
    import kernel_env
    assert "device" in {m.name for m in kernel_env.pytestmark}
    on_kernel_env = {}  # module -> what it imports from kernel_env at its top level
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for n in tree.body:
            if isinstance(n, ast.ImportFrom) and n.module == "kernel_env":
                on_kernel_env.setdefault(p.name, set()).update(a.name for a in n.names)
    assert {"test_kernels.py", "test_ops.py", "test_counters.py"} <= set(on_kernel_env)
    for name, names in on_kernel_env.items():
        assert "pytestmark" in names, f"{name} imports kernel_env without its pytestmark (the device mark)"
    assert '-m "gpu or device"' in (ROOT / "harness" / "lab" / "gpu_check.sh").read_text(encoding="utf-8")
