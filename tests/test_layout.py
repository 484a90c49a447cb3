"""The shape of the code base (docs/DESIGN.md): packages in layers (core <- drafters, refiners <- harness.decode <-
harness.protocol <- harness.lab <- scripts <- training; nothing imports training), no import cycle, no file over
400 lines, algorithms free of backend checks."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "harness", "drafters", "refiners", "training", "scripts")
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
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module or ''}.{a.name}" for a in node.names]  # `from core import kernels` too
            found += [f"{p.name}:{node.lineno} imports {m}" for m in mods
                      if m.startswith(("triton", "core.kernels", "core.ops.triton_impl"))]
    return found


def test_backend_check_finder_sees_one():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def f(self, x):\n    if self._kern is not None:\n        return x\n    return x.cuda() if x.is_cuda "
                "else x\nfrom core import kernels\n")
    assert len(backend_checks(Path(f.name))) == 3  # two branches and the import
    Path(f.name).unlink()


def test_algorithm_modules_contain_no_backend_checks():
    assert [c for p in ALGORITHMS for c in backend_checks(p)] == []


# The layers, bottom first: a module imports its own package and the layers below it, never one above.
LAYERS = (("core",), ("drafters", "refiners"), ("harness.decode",), ("harness.protocol",), ("harness.lab",),
          ("scripts",), ("training",))
ALGORITHMS_MODULE = "harness.protocol.algorithms"  # the one module of harness/ that names algorithms


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, package) of a project module (the empty package `harness` itself sits under its layers)."""
    if module == "harness":
        return 2, "harness.decode"
    for i, packages in enumerate(LAYERS):
        for pkg in packages:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py's LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        lm, pm = layer_of(m)
        for d in sorted(deps):
            ld, pd = layer_of(d)
            if pd == pm:
                continue
            if ld > lm or (ld == lm and pd != pm):
                bad.append(f"{m} imports {d} (layer {pd} is not below {pm})")
            elif pd in ("drafters", "refiners") and m.startswith("harness.") and m != ALGORITHMS_MODULE:
                bad.append(f"{m} imports the algorithm {d}; harness/ takes algorithms from {ALGORITHMS_MODULE}")
    return bad


def test_layer_checker_sees_an_upward_and_a_sideways_import():
    graph = {"core.cache": {"harness.decode.loop"}, "drafters.dflash": {"refiners.xpress"},
             "harness.decode.loop": {"drafters.dflash", "core.cache"}, "harness.protocol.algorithms": {"refiners.x"},
             "refiners.x": set(), "refiners.xpress": set(), "training.a": {"harness.lab.b"}, "harness.lab.b": set()}
    assert layer_violations(graph) == [
        "core.cache imports harness.decode.loop (layer harness.decode is not below core)",
        "drafters.dflash imports refiners.xpress (layer refiners is not below drafters)",
        "harness.decode.loop imports the algorithm drafters.dflash; harness/ takes algorithms from "
        "harness.protocol.algorithms"]


def test_packages_import_in_layers():
    mods = project_modules()
    graph = {m: imports(p, set(mods)) for m, p in mods.items()}
    assert layer_violations(graph) == []


def test_nothing_outside_training_imports_training():
    mods = project_modules()
    for top in ("benchmark_compile_all.py",):
        assert not any(i.startswith("training") for i in imports(ROOT / top, set(mods)))


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
