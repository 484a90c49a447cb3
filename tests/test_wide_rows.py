"""Launch.wide_rows: core.kernels.wide_linear, kernels.linear past MAX_ROWS rows as launches over row tiles of
MAX_ROWS (a batched verify or draft from B x W = 128 rows), each tile the launch of its rows alone, with every
epilogue; TritonOps routes linear and rms_norm calls of that many rows to the kernels only when asked (the torch ops
otherwise, as before). Triton's CPU interpreter here (fp32), compiled kernels on a GPU (bf16 too)."""
import pytest
import torch

from kernel_env import DEV, DTYPES, pytestmark, rnd, tol  # noqa: F401  (sets TRITON_INTERPRET first)
from core import kernels  # noqa: E402
from core.ops import TorchOps  # noqa: E402
from core.ops.triton_impl import TritonOps  # noqa: E402

lin = torch.nn.functional.linear
T = kernels.MAX_ROWS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [T + 1, 2 * T + 2])
def test_wide_rows_are_row_tiles_each_computed_as_its_own_launch(dtype, m):
    """Within rounding of torch for the plain product, the residual, the norm, the gated input and the argmax;
    and each row tile bit for bit the launch of its rows alone (the last, shorter one too). m: a last tile of one
    row (the broadcast-multiply loop) and of several (2: tensor-core dots, padded to 16) after two full ones. n = 72:
    column tiles of 32 (several rows) and 16 (one row), the last partial either way, so the argmax crosses programs
    (each program costs ~0.1 s on the interpreter; 300 columns and a third m of 100 rows, a partial 36-row tile on
    the same dot path as the 2-row one, made this test ~45 s)."""
    k, n = 96, 72
    w, x, r = rnd(n, k, dtype=dtype, scale=0.1, seed=1), rnd(m, k, dtype=dtype, seed=2), rnd(m, n, dtype=dtype, seed=3)
    g, x2 = rnd(k, dtype=dtype, seed=4), rnd(m, 2 * k, dtype=dtype, seed=5)
    y = kernels.wide_linear(x, w)
    torch.testing.assert_close(y, lin(x, w), **tol(dtype))
    normed = g * torch.nn.functional.rms_norm(x, (k,), None, 1e-6)
    yn = kernels.wide_linear(x, w, norm=g, eps=1e-6, residual=r)
    torch.testing.assert_close(yn, r + lin(normed, w), **tol(dtype))
    gate, up = x2.chunk(2, dim=-1)
    yg = kernels.wide_linear(x2, w, gated=True)
    torch.testing.assert_close(yg, lin(torch.nn.functional.silu(gate) * up, w), **tol(dtype))
    ya, ids = kernels.wide_linear(x, w, residual=r, argmax=True)
    assert torch.equal(ids, ya.argmax(-1)) and ids.shape == (m,)
    for lo in range(0, m, T):  # the tiles: rows lo..lo+T-1 (the last may be 1 row: the broadcast-multiply loop)
        t = slice(lo, lo + T)
        assert torch.equal(y[t], kernels.linear(x[t], w)), lo
        assert torch.equal(yn[t], kernels.linear(x[t], w, norm=g, eps=1e-6, residual=r[t])), lo
        assert torch.equal(yg[t], kernels.linear(x2[t], w, gated=True)), lo
        assert torch.equal(ids[t], kernels.linear(x[t], w, residual=r[t], argmax=True)[1]), lo
    with pytest.raises(ValueError, match="wide_linear takes"):
        kernels.wide_linear(rnd(kernels.WIDE_ROWS + 1, k), w)


def test_triton_ops_take_wide_rows_only_under_launch_wide_rows(monkeypatch):
    """Default: a call of more than MAX_ROWS rows runs on the torch ops (no kernel launch), as before. With
    Launch(wide_rows=True): linear and rms_norm launch the kernels, within rounding of the torch ops, and nothing
    is counted as a fallback; past WIDE_ROWS rows the torch ops again."""
    calls = {"wide_linear": 0, "rms_norm": 0}
    for name in calls:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1),
                                                                               _r(*a, **k))[1])
    w, x, g, res = rnd(80, 64, scale=0.1, seed=1), rnd(100, 64, seed=2), rnd(64, seed=3), rnd(100, 80, seed=4)
    want_y = TorchOps().linear(x, w, residual=res)
    want_n = TorchOps().rms_norm(x, g, 1e-6)
    plain = TritonOps(DEV)
    torch.testing.assert_close(plain.linear(x, w, residual=res), want_y, **tol(torch.float32))
    torch.testing.assert_close(plain.rms_norm(x, g, 1e-6), want_n, **tol(torch.float32))
    assert calls == {"wide_linear": 0, "rms_norm": 0}
    wide = TritonOps(DEV, kernels.Launch(pdl=None, wide_rows=True))
    torch.testing.assert_close(wide.linear(x, w, residual=res), want_y, **tol(torch.float32))
    torch.testing.assert_close(wide.rms_norm(x, g, 1e-6), want_n, **tol(torch.float32))
    assert calls == {"wide_linear": 1, "rms_norm": 1} and not wide.fallbacks
    big = rnd(kernels.WIDE_ROWS + 1, 64, seed=5)
    torch.testing.assert_close(wide.linear(big, w), TorchOps().linear(big, w), **tol(torch.float32))
    assert calls["wide_linear"] == 1  # past WIDE_ROWS: the torch ops


def test_the_stacked_twin_keeps_its_calls_to_one_launch_under_wide_rows():
    """StackedTritonOps' launchers (vmap rules) take at most MAX_ROWS rows; beside a TritonOps with wide rows it
    routes longer calls to the torch ops, never to a wide launcher it does not have."""
    from core.ops.stacked import StackedTritonOps
    of = TritonOps(DEV, kernels.Launch(pdl=None, wide_rows=True))
    twin = StackedTritonOps(of)
    assert of.launch.wide_rows and not twin.launch.wide_rows and twin.fallbacks is of.fallbacks
    w, x = rnd(40, 64, scale=0.1, seed=1), rnd(100, 64, seed=2)
    torch.testing.assert_close(twin.linear(x, w), TorchOps().linear(x, w), **tol(torch.float32))


def test_wide_rows_are_a_launch_setting_that_the_invariant_kernels_refuse():
    assert kernels.Launch(pdl=None, wide_rows=True).resolve(torch.device("cpu")) == \
        kernels.Launch(pdl=False, wide_rows=True)
    with pytest.raises(ValueError, match="wide_rows does not combine with batch_invariant"):
        kernels.Launch(wide_rows=True, batch_invariant=True)


def test_bench_batch_measures_the_verify_on_wide_rows(tmp_path, monkeypatch):
    """bench_batch --kernels triton --wide-rows: a verify of 3 x 22 rows runs its matmuls on the kernels (calls of
    more than MAX_ROWS rows launched: 66, two tiles, the last of 2 rows; 3 x 32 cost a third more on the
    interpreter), and the file says so in its kernels field. On the GPU where there is one: with a GPU, conftest
    leaves Triton's CPU interpreter off, and --device cpu failed there (the H200, 2026-12-05)."""
    import json

    from harness.lab import bench_batch
    wide = []
    real = kernels.wide_linear
    monkeypatch.setattr(kernels, "wide_linear", lambda x, *a, **k: (wide.append(x.shape[0] > T),
                                                                    real(x, *a, **k))[1])
    out = tmp_path / "w.json"
    assert bench_batch.main(["--preset", "tiny", "--device", str(DEV), "--kernels", "triton", "--wide-rows",
                             "--batch-sizes", "3", "--contexts", "8", "--block-size", "22", "--reps", "1",
                             "--warmup", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "wide rows" in res["kernels"].split(", ") and {r["width"] for r in res["rows"]} == {1, 22}
    assert any(wide)
