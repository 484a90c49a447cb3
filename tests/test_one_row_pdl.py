"""Issue 29's B = 1 against B = 2: the AR step at B = 2 (0.80 ms on the H100 sweep, SmolLM2-135M) was cheaper than
at B = 1 (1.00 ms). Both steps attend over caches of the same capacity (so the same split count); what differs is
the launches: at B = 2 every launch has several rows and so programmatic dependent launch, at B = 1 none had it
(and the one-row matmul tiles, which set the bits, stay as they are). A launch-bound target now gives its one-row
launches PDL too (Launch.one_row_pdl, chosen by core.ops.make_ops), which changes no bit: the same kernels, grids
and constexprs, only the start of each launch. CPU: Triton's interpreter has no PDL, so the launches' PDL
decisions are recorded as a Hopper GPU would take them while the kernels run without it."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (sets TRITON_INTERPRET first)
from core import kernels
from core.devices import Backend
from core.ops import make_ops
from core.ops.triton_impl import LAUNCH_BOUND_BYTES, launch_bound
from harness.decode.batch_target import BatchTarget
from harness.protocol.presets import hf_config, preset
from tiny import tiny_target

F32 = Backend(DEV, torch.float32)
KERNEL_MODULES = ("matmul", "attention", "rows")


def _module(name):
    import sys
    return sys.modules[f"core.kernels.{name}"]


def test_the_rule_picks_smollm2_and_leaves_qwen3_8b():
    """SmolLM2-135M's decoder layer reads 7.1 MB of bf16 weights, Qwen3-8B's 386 MB (one-row PDL measured neutral
    to slower there, results/perf/NOTES.md)."""
    smol, qwen = hf_config(preset("smollm2-135m")), hf_config(preset("qwen3-8b"))
    assert launch_bound(smol, torch.bfloat16) and not launch_bound(qwen, torch.bfloat16)
    from transformers import AutoModelForCausalLM
    from core.ops.triton_impl import layer_weight_bytes
    for cfg in (smol, qwen):  # the rule's count against the layer's own matmul weights (built on the meta device)
        with torch.device("meta"):
            layer = AutoModelForCausalLM.from_config(cfg).model.layers[0]
        n = sum(p.numel() for name, p in layer.named_parameters() if p.dim() == 2)
        assert layer_weight_bytes(cfg, torch.bfloat16) == 2 * n
    assert layer_weight_bytes(smol, torch.bfloat16) < LAUNCH_BOUND_BYTES < layer_weight_bytes(qwen, torch.bfloat16)
    assert make_ops("triton", DEV, torch.bfloat16, smol).launch.one_row_pdl is True
    assert make_ops("triton", DEV, torch.bfloat16, qwen).launch.one_row_pdl is False
    # a caller's own choice stands (bench_batch --one-row-pdl off: the launches from before the rule)
    off = kernels.Launch(pdl=None, one_row_pdl=False)
    assert make_ops("triton", DEV, torch.bfloat16, smol, launch=off).launch.one_row_pdl is False
    assert make_ops("triton", DEV, torch.bfloat16, smol, launch=kernels.Launch(pdl=None, batch_invariant=True)) \
        .launch.one_row_pdl is True
    with pytest.raises(ValueError, match="one_row_pdl"):
        kernels.Launch(one_row_pdl=1)


def _decisions(monkeypatch, seen: list):
    """Every launch's PDL decision (rows, on) as on a Hopper GPU; the kernels themselves run without PDL."""
    monkeypatch.setattr(_module("common"), "pdl_supported", lambda device: True)
    for name in KERNEL_MODULES:
        real = _module(name).launch_opts

        def record(launch, device, rows, real=real):
            seen.append((rows, real(launch, device, rows)["PDL"]))
            return {"PDL": False}
        monkeypatch.setattr(_module(name), "launch_opts", record)


def test_a_launch_bound_targets_one_row_step_takes_pdl_as_its_two_row_step_does(monkeypatch):
    """The sweep's AR step (BatchTarget.verify: one request on the single-request kernels, two on the rows' ops):
    at B = 1 every launch (5 a layer: q/k/v with the norm folded, attention, o_proj, gate/up, down_proj; then the
    lm_head, its norm folded at this vocabulary) now starts under PDL, as every launch at B = 2 does. Before, none
    at B = 1 did."""
    seen = []
    _decisions(monkeypatch, seen)
    t = tiny_target("llama", backend=F32, capacity=32, layers=2)
    t.fuse_projections()
    t.use_ops(make_ops("triton", DEV, torch.bfloat16, t.config))  # the run's choice, from the target's config
    assert t.ops.launch.pdl and t.ops.launch.one_row_pdl
    g = torch.Generator().manual_seed(0)
    got = {}
    for b in (1, 2):
        batch = BatchTarget(t, b)
        batch.ensure_capacity(32)
        batch.pos.fill_(5)
        seen.clear()
        batch.verify(torch.randint(8, 100, (b, 1), generator=g).to(DEV), 6, want_features=False)
        got[b] = list(seen)
    assert len(got[1]) == 5 * t.n_layers + 1 and {rows for rows, _ in got[1]} == {1}
    assert all(on for _, on in got[1]), got[1]
    assert all(on for _, on in got[2]) and {rows for rows, _ in got[2]} == {2}
    # a target past the rule keeps its one-row launches without PDL (Qwen3-8B's shapes), its blocks with it
    big = kernels.Launch(pdl=None, one_row_pdl=False)
    t.use_ops(make_ops("triton", DEV, torch.bfloat16, t.config, launch=big))
    seen.clear()
    t.verify(torch.tensor([9], device=DEV), 16, want_features=False)
    assert seen and not any(on for _, on in seen)


class Recorder:
    """Stands in for a kernel: records (grid, constexprs and scalars) instead of launching."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((self.name, tuple(grid), len(args), dict(kw)))
        return launch


def test_one_row_pdl_changes_only_the_launch_attribute(monkeypatch):
    """At SmolLM2-135M's shapes, one row: each launch with Launch.one_row_pdl is the launch without it (grid,
    arguments, tiles, warps, stages) but for PDL and its launch attribute, so its programs compute the same bits;
    no weight prefetch at one row (it slowed the one-row AR step, results/perf/NOTES.md)."""
    seen = []
    for name, kern in (("matmul", "_linear_kernel"), ("attention", "_attention_kernel"),
                       ("rows", "_rmsnorm_kernel"), ("rows", "_silu_mul_kernel"),
                       ("rows", "_argmax_reduce_kernel")):
        monkeypatch.setattr(_module(name), kern, Recorder(kern, seen))
    monkeypatch.setattr(_module("common"), "pdl_supported", lambda device: True)
    meta = dict(device="meta", dtype=torch.bfloat16)
    runs = []
    for one_row in (False, True):
        launch = kernels.Launch(pdl=True, one_row_pdl=one_row)
        seen.clear()
        for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
            x, w, g, r = (torch.empty(*s, **meta) for s in ((1, k), (n, k), (k,), (1, n)))
            kernels.linear(x, w, norm=g, eps=1e-6, launch=launch)
            kernels.linear(x, w, residual=r, argmax=True, launch=launch)
            kernels.linear(torch.empty(1, 2 * k, **meta), w, gated=True, residual=r, launch=launch)
        kc = torch.empty(3, 512, 64, **meta)
        kernels.attention(torch.empty(1, 15 * 64, **meta), None, None, 1e-6, torch.empty(1, 64, **meta),
                          torch.empty(1, 64, **meta), torch.empty(1, dtype=torch.long, device="meta"), kc, kc, 9,
                          0.125, counters=torch.empty(3, dtype=torch.int32, device="meta"), launch=launch)
        runs.append(list(seen))
    before, after = runs
    assert len(before) == len(after) > 15
    for (name, grid, n, kw0), (name1, grid1, n1, kw1) in zip(before, after):
        assert (name, grid, n) == (name1, grid1, n1)
        assert kw0["PDL"] is False and "launch_pdl" not in kw0 and kw1["PDL"] is True and kw1["launch_pdl"] is True
        assert kw1.get("PF_COLS", 0) == 0
        assert {k: v for k, v in kw0.items() if k != "PDL"} == \
            {k: v for k, v in kw1.items() if k not in ("PDL", "launch_pdl")}


def test_the_batch_invariant_matmul_prefetches_no_weights_at_one_row(monkeypatch):
    """--batch-invariant on a launch-bound target: its one-row matmul launches take PDL (one_row_pdl) with no weight
    prefetch before the wait (PF_COLS 0), as kernels.linear's; at two rows PDL and the prefetch, as before."""
    seen = []
    monkeypatch.setattr(_module("invariant"), "_inv_linear_kernel", Recorder("_inv_linear_kernel", seen))
    monkeypatch.setattr(_module("common"), "pdl_supported", lambda device: True)
    from core.kernels import invariant
    meta = dict(device="meta", dtype=torch.bfloat16)
    launch = kernels.Launch(pdl=True, batch_invariant=True, one_row_pdl=True)
    for rows in (1, 2):
        invariant.linear(torch.empty(rows, 576, **meta), torch.empty(960, 576, **meta), launch=launch)
    (_, _, _, one), (_, _, _, two) = seen
    assert one["PDL"] is True and one["launch_pdl"] is True and one["PF_COLS"] == 0
    assert two["PDL"] is True and two["PF_COLS"] > 0
