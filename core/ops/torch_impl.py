"""The decode math in torch ops: the reference numerics (HF's modules step by step) and differentiable."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from core.cache import StaticKV, attend, rotate
from core.ops.base import Ops, Span


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm in two kernels instead of about seven: the fused normalisation computes in fp32 and rounds to
    the input dtype once, then the weight multiplies in that dtype, as HF does."""
    return weight * F.rms_norm(x, weight.shape, None, eps)


SILU = ("silu", "swish")  # the names HF configs give silu


def trained(fn) -> bool:
    """Whether an activation (a module or a function) carries parameters, which a name cannot."""
    return any(True for _ in getattr(fn, "parameters", lambda: ())())


@functools.lru_cache(maxsize=None)
def activation(name: str):
    """The function a gated MLP applies to its gate, by its hidden_act name: F.silu for silu, else transformers'
    own (ACT2FN, which is what the HF modules are built from)."""
    if name in SILU:
        return F.silu
    from transformers.activations import ACT2FN

    from core.errors import UsageError
    try:
        fn = ACT2FN[name]
    except KeyError:
        raise UsageError(f"activation {name!r} is not one transformers knows (transformers.activations.ACT2FN); "
                         "use one of its names") from None
    if trained(fn):  # e.g. prelu, xielu in transformers 5.19
        raise UsageError(f"activation {name!r} has trained parameters, which a name cannot carry: run that MLP "
                         "through its own module (the Target does not fuse such layers)")
    return fn


class TorchOps(Ops):
    name = "torch"

    def linear(self, x, w, *, bias=None, norm=None, eps=0.0, act=None, residual=None, argmax=False):
        if norm is not None:
            x = rms(x, norm, eps)
        if act is not None:
            gate, up = x.chunk(2, dim=-1)
            x = activation(act)(gate) * up
        y = F.linear(x, w, bias)
        if residual is not None:
            y = torch.add(residual, y).to(residual.dtype)
        return (y, y.argmax(-1)) if argmax else y

    def rms_norm(self, x, weight, eps):
        return rms(x, weight, eps)

    def _heads(self, rows: torch.Tensor, d: int, norm, eps, cos, sin) -> torch.Tensor:
        """Rows [T, heads * d] -> [1, heads, T, d], per-head norm and rotary where given."""
        y = rows.view(1, rows.shape[0], -1, d)
        if norm is not None:
            y = rms(y, norm, eps)
        y = y.transpose(1, 2)
        return y if cos is None else rotate(y, cos, sin)

    def attention(self, qkv, kv: StaticKV, layer, span: Span, cos, sin, n_q, scale, q_norm=None, k_norm=None,
                  eps=0.0):
        d, n_kv = kv.head_dim, kv.n_kv_heads
        q, k, v = qkv.split((n_q * d, n_kv * d, n_kv * d), dim=-1)
        q = self._heads(q, d, q_norm, eps, cos, sin)
        kv.write(layer, span.positions, self._heads(k, d, k_norm, eps, cos, sin),
                 self._heads(v, d, None, eps, None, None))
        ks, vs = kv.read(layer, span.length)
        return attend(q, ks, vs, span.mask(n_q // n_kv), scale, span.impl)[0]

    def write_kv(self, rows, kv: StaticKV, layer, positions, cos, sin, k_norm=None, eps=0.0):
        d, n_kv = kv.head_dim, kv.n_kv_heads
        k, v = rows.split((n_kv * d, n_kv * d), dim=-1)
        kv.write(layer, positions, self._heads(k, d, k_norm, eps, cos, sin), self._heads(v, d, None, eps, None, None))
