"""The Triton ops under torch.func.vmap: StackedTritonOps batches a refiner's kernels over several requests.

refiners.batch.BatchRefiner runs a refiner's own refine() over a stack of requests through vmap, and vmap cannot
look inside a Triton launch. Here each kernel family a refinement uses (the matmul with its residual and argmax,
the xPress latent, the gated Markov latent) is a torch.library custom op with a vmap rule, and the rule launches
the kernel once for the whole stack:

* `xb::xpress_latent`: cache [N, B, r] and prev [N, B] in one launch of N programs, each the one-block program
  (core.kernels.xpress), so every request's latent is bit for bit its own one-block latent;
* `xb::markov_gated_latent`: prev [N] and h [N, H] in one launch, each request's programs its one-slot programs
  (core.kernels.markov), likewise;
* `xb::linear`: the requests' rows flattened into one matmul of N x rows (at most kernels.MAX_ROWS: one launch;
  more: the torch ops, as TritonOps routes any call of that many rows). A row's product then shares its launch
  with the other requests' rows: equal to its own launch's wherever the kernels are batch-invariant
  (Launch.batch_invariant), within the dtype's rounding otherwise.

StackedTritonOps is a TritonOps whose kernel launchers (`_kernel`) are these ops; its routing (what fits the
kernels, the fallbacks it counts) is TritonOps' own. Outside vmap the ops run the kernels as TritonOps does, one
request at a time; a custom op costs a few microseconds of host time a call more, which is why TritonOps itself
does not use them (a graphed step does not see it). rms_norm, attention and the cache writes are not a
refinement's: StackedTritonOps runs rms_norm on the torch ops and leaves the rest to TritonOps (not vmappable).
"""
from __future__ import annotations

import dataclasses

import torch

from core import kernels
from core.ops.torch_impl import TorchOps
from core.ops.triton_impl import TritonOps

_TORCH = TorchOps()  # the readout past kernels.MAX_ROWS rows (the rule has no ops instance; TorchOps holds no state)


def _launch(pdl: bool, invariant: bool) -> kernels.Launch:
    return kernels.Launch(pdl=pdl, batch_invariant=invariant)


def _stacked(t: torch.Tensor | None, dim: int | None, n: int) -> torch.Tensor | None:
    """A vmapped argument with its batch dim first (an unbatched one repeated N times, as a view)."""
    if t is None:
        return None
    return t.movedim(dim, 0) if dim is not None else t.unsqueeze(0).expand(n, *t.shape)


def _shared(name: str, in_dims, which: range) -> None:
    if any(in_dims[i] is not None for i in which):
        raise NotImplementedError(f"{name} under vmap: the weights must be shared by every request (one head)")


@torch.library.custom_op("xb::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None, eps: float, gated: bool,
           residual: torch.Tensor | None, argmax: bool, pdl: bool, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.linear as an op: (y, the rows' argmax, or an empty tensor without argmax)."""
    out = kernels.linear(x, w, norm=norm, eps=eps, gated=gated, residual=residual, argmax=argmax,
                         launch=_launch(pdl, invariant))
    return out if argmax else (out, x.new_empty(0, dtype=torch.int64))


@linear.register_fake
def _(x, w, norm, eps, gated, residual, argmax, pdl, invariant):
    ids = x.new_empty(x.shape[:-1] if argmax else (0,), dtype=torch.int64)
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=w.dtype), ids


@torch.library.register_vmap("xb::linear")
def _linear_vmap(info, in_dims, x, w, norm, eps, gated, residual, argmax, pdl, invariant):
    _shared("linear", in_dims, (1, 2))
    n = info.batch_size
    xs, rs = _stacked(x, in_dims[0], n), _stacked(residual, in_dims[5], n)
    rows = xs.shape[:-1]
    flat = xs.reshape(-1, xs.shape[-1])
    res = None if rs is None else rs.reshape(-1, rs.shape[-1])
    if flat.shape[0] <= kernels.MAX_ROWS:
        y, ids = linear(flat, w, norm, eps, gated, res, argmax, pdl, invariant)
    else:  # more rows than one launch takes: the torch ops (as TritonOps routes them without Launch.wide_rows)
        out = _TORCH.linear(flat, w, norm=norm, eps=eps, act="silu" if gated else None, residual=res, argmax=argmax)
        y, ids = out if argmax else (out, flat.new_empty(0, dtype=torch.int64))
    y = y.view(*rows, -1)
    ids = ids.view(rows) if argmax else ids.new_empty((n, 0))
    return (y, ids), (0, 0)


@torch.library.custom_op("xb::xpress_latent", mutates_args=())
def xpress_latent(cache: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w_tok: torch.Tensor,
                  mix: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, folded: bool,
                  pdl: bool) -> torch.Tensor:
    return kernels.xpress_latent(cache, prev, w1, w_tok, mix, gate, up, down, folded=folded,
                                 launch=_launch(pdl, False))


@xpress_latent.register_fake
def _(cache, prev, w1, w_tok, mix, gate, up, down, folded, pdl):
    return cache.new_empty((*cache.shape[:-2], cache.shape[-2] - 1, cache.shape[-1]))


@torch.library.register_vmap("xb::xpress_latent")
def _xpress_vmap(info, in_dims, cache, prev, w1, w_tok, mix, gate, up, down, folded, pdl):
    _shared("xpress_latent", in_dims, range(2, 8))
    n = info.batch_size
    cs, ps = _stacked(cache, in_dims[0], n), _stacked(prev, in_dims[1], n)
    lead = cs.shape[:-2]  # [N] or, under nested vmaps, every level's stack: one launch for all of them
    z = xpress_latent(cs.reshape(-1, *cs.shape[-2:]), ps.reshape(-1, ps.shape[-1]), w1, w_tok, mix, gate, up,
                      down, folded, pdl)
    return z.view(*lead, *z.shape[1:]), 0


@torch.library.custom_op("xb::markov_gated_latent", mutates_args=())
def markov_gated_latent(prev: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, gate: torch.Tensor,
                        bias: torch.Tensor, pdl: bool) -> torch.Tensor:
    return kernels.markov_gated_latent(prev, h, w1, gate, bias, launch=_launch(pdl, False))


@markov_gated_latent.register_fake
def _(prev, h, w1, gate, bias, pdl):
    return h.new_empty((*h.shape[:-1], w1.shape[1]), dtype=w1.dtype)


@torch.library.register_vmap("xb::markov_gated_latent")
def _markov_vmap(info, in_dims, prev, h, w1, gate, bias, pdl):
    _shared("markov_gated_latent", in_dims, range(2, 5))
    n = info.batch_size
    hs = _stacked(h, in_dims[1], n)
    lead = hs.shape[:-1]  # [N] or, under nested vmaps, every level's stack
    ps = _stacked(prev, in_dims[0], n).reshape(-1)
    z = markov_gated_latent(ps, hs.reshape(-1, hs.shape[-1]), w1, gate, bias, pdl)
    return z.view(*lead, -1), 0


def _linear_op(x, w, *, norm=None, eps=0.0, gated=False, residual=None, argmax=False, launch):
    y, ids = linear(x, w, norm, float(eps), gated, residual, argmax, bool(launch.pdl), launch.batch_invariant)
    return (y, ids) if argmax else y


def _latent_op(cache, prev, w1, w_tok, mix, gate, up, down, *, folded, launch):
    return xpress_latent(cache, prev, w1, w_tok, mix, gate, up, down, folded, bool(launch.pdl))


def _markov_op(prev, h, w1, gate, bias, *, launch):
    return markov_gated_latent(prev, h, w1, gate, bias, bool(launch.pdl))


STACKED = {"linear": _linear_op, "xpress_latent": _latent_op, "markov_latent": _markov_op}


class StackedTritonOps(TritonOps):
    """TritonOps whose refinement kernels vmap can batch (the module docstring). `of`: the TritonOps it stands
    beside (its device, launch settings and fallback counter are shared)."""

    def __init__(self, of: TritonOps):
        # its launchers take at most MAX_ROWS rows a call (STACKED has no wide_linear): Launch.wide_rows off
        super().__init__(of.device, dataclasses.replace(of.launch, wide_rows=False), of.debug, of.torch)
        self.fallbacks = of.fallbacks

    def _kernel(self, name: str):
        return STACKED[name]

    def rms_norm(self, x, weight, eps):
        return self.torch.rms_norm(x, weight, eps)
