"""Triton 3.6.0's CPU interpreter (the test extras' pin, .ci/run) re-patches triton.language on every kernel launch
and on every call of a device function inside one (interpreter._patch_lang): each patch ran inspect.getmembers
over triton.language, its tensor class and
math module (dir, getattr of every name and a sort) to find the builtins. In the kernel tests that was about a
quarter of the interpreter's time (test_ops: 28 s of 121 s under cProfile, 20,416 patches for 1,142 launches).

cache_builtin_names keeps, per patched object, the names getmembers found builtin the first time, and each later
patch looks at those names alone: it patches the ones whose current value is a builtin, as getmembers' loop did
(inside a launch they hold the interpreter's wrappers, which are no builtins, so a device function's call patches
nothing again, as before). Which kernels run and what they compute is unchanged; a Triton whose interpreter has
other internals is left as it is."""
import inspect


def cache_builtin_names() -> bool:
    try:
        from triton.runtime import interpreter
        from triton.language import core
    except Exception:  # no Triton: nothing to speed up
        return False
    real, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if real is None or patch_attr is None or getattr(real, "cached_names", None) is not None:
        return False
    if list(inspect.signature(real).parameters) != ["pkg", "builder", "scope"]:
        return False
    names: dict[int, tuple[object, list[str]]] = {}

    def _patch_builtin(pkg, builder, scope):
        held = names.get(id(pkg))
        if held is None or held[0] is not pkg:
            held = names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg) if core.is_builtin(m)])
        for name in held[1]:
            member = getattr(pkg, name, None)
            if core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.cached_names = names
    interpreter._patch_builtin = _patch_builtin
    return True
