"""The decode math on core.kernels (Triton); what the kernels do not take runs on a TorchOps.

The kernels take up to kernels.MAX_ROWS rows without biases, silu as the only gated activation, one dtype, and
attention heads that `kernels.heads_fit`; a prompt (prefill) stays on torch ops, whose cuBLAS/SDPA suit long
blocks. A refinement compiled with torch.compile calls these between its compiled pieces (they run outside the
compiler, wrapped on first use so that importing this module does not import torch._dynamo).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from core import kernels
from core.ops.base import Ops
from core.ops.torch_impl import SILU, TorchOps


def unsupported_reason(config) -> str | None:
    """Why a target with this (HF) config cannot run its decode steps on the kernels (None: it can)."""
    if not kernels.available():
        return "triton is not installed"
    if getattr(config, "model_type", None) == "gemma4_text":
        return "Gemma 4 layers run on torch ops (sandwich norms, GeGLU, experts)"
    if getattr(config, "hidden_act", "silu") not in SILU:
        return f"activation {config.hidden_act!r} (the kernels fuse silu)"
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    if not kernels.heads_fit(d, heads, getattr(config, "num_key_value_heads", heads)):
        return f"head_dim {d} is not a power of two >= 16 (or the query heads do not group)"
    if getattr(config, "model_type", None) == "qwen2" or getattr(config, "attention_bias", False) \
            or getattr(config, "mlp_bias", False):
        return "projections with biases"
    return None


# A decoder layer's weights under this many bytes make a launch-bound target: its one-row launches each stream about
# a microsecond of weights or less, as long as the launch gap PDL hides. SmolLM2-135M: 7.1 MB a layer in bf16, its
# one-row AR step about 150 launches at 10x its byte floor (0.913 ms against 0.091 on an H100, 0.713 at B = 2, where
# every launch had PDL; 0.813 with one-row PDL: results/perf/one_row_pdl_h100/); Qwen3-8B: 386 MB, where one-row PDL measured
# neutral to slower (the same NOTES), so it keeps them without.
LAUNCH_BOUND_BYTES = 16 << 20


def layer_weight_bytes(config, dtype: torch.dtype) -> int:
    """The bytes of one decoder layer's matmul weights in `dtype` (q/k/v, o_proj, gate/up and down_proj) of a
    target with this (HF) config."""
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return (h * d * (2 * heads + 2 * kv) + 3 * h * config.intermediate_size) * dtype.itemsize


def launch_bound(config, dtype: torch.dtype) -> bool:
    """Whether the target's decoder layer reads under LAUNCH_BOUND_BYTES of weights: core.ops.make_ops then gives its
    one-row launches PDL (kernels.Launch.one_row_pdl)."""
    return layer_weight_bytes(config, dtype) < LAUNCH_BOUND_BYTES


class TritonOps(Ops):
    """debug: check the cache's split-attention counters before each eager attention launch (a host sync).
    fallbacks: (op, why) -> how many decode-sized calls (rows a kernel takes) ran on the torch ops instead; a
    captured graph's replays do not call these, so a graphed step counts once per capture; this process's calls
    only (in a multi-process run, rank 0's)."""
    name = "triton"

    def __init__(self, device: torch.device, launch: kernels.Launch = kernels.Launch(pdl=None), debug: bool = False,
                 torch_ops: TorchOps | None = None):
        self.device = torch.device(device)
        self.launch = launch.resolve(self.device)
        self.debug = debug
        self.torch = torch_ops or TorchOps()
        self._outside: dict = {}
        self.fallbacks: Counter = Counter()

    @property
    def proposing(self):
        if not self.launch.batch_invariant:
            return self
        if "proposing" not in self._outside:  # the same kernels on the fastest tiles; one fallback count
            fast = TritonOps(self.device, replace(self.launch, batch_invariant=False), self.debug, self.torch)
            fast.fallbacks = self.fallbacks
            self._outside["proposing"] = fast
        return self._outside["proposing"]

    def sized(self, rows, groups, prefill=False, request_rows=None):
        if prefill:
            return self.torch
        if request_rows is not None:
            # several requests (BatchOps): each call decides for itself. The rows' attention runs one request's
            # launch shape (rows_attention: `request_rows` x groups, SDPA where that does not fit, counted), and
            # linear and rms_norm over more than MAX_ROWS rows take the torch ops call by call; sizing the whole
            # forward by every request's rows at once sent 4 x 16 rows at 4 query heads per K/V head (Qwen3-8B's
            # verify at B = 4) to the torch ops for every op
            if request_rows < 1 or rows % request_rows:
                raise ValueError(f"a batched forward of {rows} rows is not whole requests of {request_rows} rows")
            return self
        if not kernels.fits(rows, groups, self.launch.batch_invariant):
            if rows <= kernels.MAX_ROWS:
                self.fallbacks["forward", f"{rows} rows x {groups} query heads per K/V head"] += 1
            return self.torch
        return self

    def for_heads(self, head_dim, n_q, n_kv, windows=False):
        if kernels.heads_fit(head_dim, n_q, n_kv) and not windows:
            return self
        why = "sliding windows" if windows else f"heads of {head_dim} ({n_q} query, {n_kv} K/V)"
        self.fallbacks["model", why] += 1  # counted once: the model runs every step on the torch ops
        return self.torch

    def _uncompiled(self, name: str, fn):
        if name not in self._outside:
            self._outside[name] = torch.compiler.disable(fn)
        return self._outside[name]

    def _kernel(self, name: str):
        """The launcher of one kernel family ("linear", "xpress_latent", "markov_latent"), outside the compiler;
        core.ops.stacked's subclass swaps in launchers that torch.func.vmap can batch."""
        return self._uncompiled(name, KERNELS[name])

    def linear(self, x, w, *, bias=None, norm=None, eps=0.0, act=None, residual=None, argmax=False):
        why = _linear_misfit(x, w, bias, act, residual, self.launch.wide_rows)
        if why is not None:
            if x.shape[0] <= kernels.MAX_ROWS:
                self.fallbacks["linear", why] += 1
            return self.torch.linear(x, w, bias=bias, norm=norm, eps=eps, act=act, residual=residual, argmax=argmax)
        if norm is not None and act is not None:
            x, norm = self.rms_norm(x, norm, eps), None
        family = "wide_linear" if x.shape[0] > kernels.MAX_ROWS else "linear"  # wide: Launch.wide_rows only
        return self._kernel(family)(x, w, norm=norm, eps=eps, gated=act is not None, residual=residual,
                                      argmax=argmax, launch=self.launch)

    def _misfit(self, check, head, dtype) -> str | None:
        """check(head, dtype)'s verdict, once per (head, dtype): a refinement asks it every pass or slot, and the
        walk over the head's parameters is host time on the eager step."""
        key = ("misfit", check, id(head), dtype)
        held = self._outside.get(key)
        if held is None or held[0] is not head:  # (the head is held, so its id is not reused while cached)
            held = self._outside[key] = (head, check(head, dtype))
        return held[1]

    def xpress_latent(self, head, cache, prev):
        why = self._misfit(_latent_misfit, head, cache.dtype)
        if why is not None:
            self.fallbacks["xpress latent", why] += 1
            return head.latent(cache, prev)
        return self._kernel("xpress_latent")(cache, prev, *kernels.xpress_head_weights(head), folded=head.folded,
                                             launch=self.launch)

    def markov_latent(self, head, prev, h, state):
        if head.variant == "vanilla":  # its latent is the embedding row itself: nothing to fuse
            return head.latent(prev, h, state)
        why = self._misfit(_markov_misfit, head, h.dtype)
        if why is not None:
            self.fallbacks["markov latent", why] += 1
            return head.latent(prev, h, state)
        g = head.gate
        return self._kernel("markov_latent")(prev, h, head.w1.weight, g.weight, g.bias, launch=self.launch), state

    def rms_norm(self, x, weight, eps):
        if x.dim() != 2 or x.shape[0] > (kernels.WIDE_ROWS if self.launch.wide_rows else kernels.MAX_ROWS):
            if x.dim() != 2 and x.numel() // x.shape[-1] <= kernels.MAX_ROWS:
                self.fallbacks["rms_norm", f"{x.dim()}-d rows"] += 1
            return self.torch.rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps, self.launch)

    def attention(self, qkv, kv, layer, span, cos, sin, n_q, scale, q_norm=None, k_norm=None, eps=0.0):
        inv = self.launch.batch_invariant
        if span.window is not None or not kernels.fits(qkv.shape[0], n_q // kv.n_kv_heads, inv):
            if qkv.shape[0] <= kernels.MAX_ROWS:
                self.fallbacks["attention", "a sliding window" if span.window is not None else
                               f"{qkv.shape[0]} rows x {n_q // kv.n_kv_heads} query heads per K/V head"] += 1
            return self.torch.attention(qkv, kv, layer, span, cos, sin, n_q, scale, q_norm, k_norm, eps)
        if self.debug and not _capturing(qkv.device):
            kv.check_counters()
        return kernels.attention(qkv, q_norm, k_norm, eps, cos, sin, span.positions, kv.k[layer, 0], kv.v[layer, 0],
                                 n_q, scale, causal=span.causal, counters=kv.counters[layer], launch=self.launch)

    def rows_attention(self, qkv, kv, layer, span, cos, sin, n_q, scale, q_norm=None, k_norm=None, eps=0.0):
        """core.ops.BatchOps' attention for the rows of R requests (positions [R, T], a StaticKV of R rows) in one
        launch of the attention kernel (the batch-invariant one under Launch.batch_invariant), each request over
        its own cache row, the same bits as its own launch; None where the kernel does not take the call (the
        torch ops then run it): a sliding window, or more rows than one program keeps."""
        r, t = span.positions.shape
        groups = n_q // kv.n_kv_heads
        why = ("a sliding window" if span.window is not None else "mixed dtypes" if qkv.dtype != kv.dtype else
               None if kernels.fits(t, groups, self.launch.batch_invariant) else
               f"{t} rows x {groups} query heads per K/V head a request")
        if why is not None:
            self.fallbacks["batched attention", why] += 1
            return None
        if self.debug and not _capturing(qkv.device):
            kv.check_counters()
            _check_rows(span, kv)
        return kernels.attention(qkv, q_norm, k_norm, eps, cos.reshape(r * t, -1), sin.reshape(r * t, -1),
                                 span.positions, kv.k[layer], kv.v[layer], n_q, scale, causal=span.causal,
                                 counters=kv.counters[layer], launch=self.launch)

    def write_kv(self, rows, kv, layer, positions, cos, sin, k_norm=None, eps=0.0):
        if rows.shape[0] > kernels.MAX_ROWS:
            return self.torch.write_kv(rows, kv, layer, positions, cos, sin, k_norm, eps)
        kernels.write_kv(rows, k_norm, eps, cos, sin, positions, kv.k[layer, 0], kv.v[layer, 0], self.launch)


def _check_rows(span, kv) -> None:
    """The debug check of a batched attention (host syncs): the kernel attends over [0, last position] and writes
    at the positions unchecked, so a drafter's limit must be its block's last position + 1 (core.ops.Span) and
    every position inside the cache (the torch path would raise there)."""
    last = span.positions[:, -1]
    if span.limit is not None and not torch.equal(span.limit.view(-1), last + 1):
        raise RuntimeError("batched attention: a span's limit is not its last position + 1 in every row; the "
                           "kernel would attend over other slots than the torch path")
    if int(span.positions.max()) >= kv.capacity or int(span.positions.min()) < 0:
        raise RuntimeError(f"batched attention: a position outside the cache's {kv.capacity} slots")


def _linear_misfit(x, w, bias, act, residual, wide: bool = False) -> str | None:
    """Why kernels.linear cannot take this call (None: it can); wide: Launch.wide_rows (past MAX_ROWS in tiles)."""
    if x.shape[0] > (kernels.WIDE_ROWS if wide else kernels.MAX_ROWS):
        return f"{x.shape[0]} rows"
    if bias is not None:
        return "a bias"
    if act is not None and act not in SILU:
        return f"activation {act!r}"
    if x.dtype != w.dtype or (residual is not None and residual.dtype != w.dtype):
        return "mixed dtypes"
    if residual is not None and residual.dim() != 2:
        return "a residual that is not 2-d"
    return None


def _latent_misfit(head, dtype) -> str | None:
    """Why kernels.xpress_latent cannot take this head's pass (None: it can)."""
    hidden = head.mlp.gate_proj.weight.shape[0]
    refused = kernels.xpress_refused(dtype, head.w1.weight.device)
    if refused is not None:
        return refused
    if not kernels.xpress_fits(head.block, head.rank, hidden):
        return f"block {head.block}, rank {head.rank}, MLP hidden {hidden}"
    if any(p.dtype != dtype for p in head.parameters()):
        return "mixed dtypes"
    if not head.mix.L.is_contiguous():
        return "a mixer that is not contiguous"
    return None


def _markov_misfit(head, dtype) -> str | None:
    """Why kernels.markov_gated_latent cannot take this head's step (None: it can)."""
    if head.variant != "gated":
        return f"the {head.variant} variant"
    if not kernels.markov_fits(head.rank):
        return f"rank {head.rank}"
    if any(p.dtype != dtype for p in head.parameters()):
        return "mixed dtypes"
    return None


def fallback_note(ops) -> str | None:
    """One line on the decode-sized calls the Triton ops handed to the torch ops (None: none, or not TritonOps)."""
    found = getattr(ops, "fallbacks", None)
    if not found:
        return None
    parts = ", ".join(f"{op} ({why}) x{n}" for (op, why), n in sorted(found.items()))
    return (f"decode-sized calls the Triton kernels do not take ran on torch ops, at their speed (a graphed step "
            f"counts once per capture): {parts}")


def _kernel_linear(*args, **kw):
    return kernels.linear(*args, **kw)  # looked up per call (the tests count the launches)


def _kernel_wide_linear(*args, **kw):
    return kernels.wide_linear(*args, **kw)


def _kernel_latent(*args, **kw):
    return kernels.xpress_latent(*args, **kw)


def _kernel_markov(*args, **kw):
    return kernels.markov_gated_latent(*args, **kw)


KERNELS = {"linear": _kernel_linear, "wide_linear": _kernel_wide_linear, "xpress_latent": _kernel_latent,
           "markov_latent": _kernel_markov}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
