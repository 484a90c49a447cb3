"""The gated Markov head's per-slot latent in one launch (refiners.markov.MarkovHead.latent, variant "gated").

A step of the head, before its vocabulary readout, is z = sigmoid(gate([h ; e])) * e with e = w1[prev]: the
embedding row, the concatenation, the gate's matvec with its bias, the sigmoid and the product, five launches on the
torch ops for each of the block's slots, one launch here (the baseline gets the treatment xPress's pass gets in
core.kernels.xpress, so that speed comparisons between the heads compare the methods, not their launch counts).
The launch spreads a slot's r outputs over programs of ROWS rows each, and each program takes the gate's columns
BK at a time: a slot's time is a few dependent loads, not one program's walk over every column (the first form, one
program a slot in 64-column steps, 11 steps at r = 80 and H = 576, read 0.360 ms for 15 slots against the torch
modules' 0.312 on an H100: results/perf/refiner_latents_h100/).

Contract: prev a 0-d (or 1-element) int64 token id on the device, h [H] the slot's drafter hidden row, w1 [V, r],
gate [r, H + r] (its input columns: h's, then e's), bias [r], one dtype (fp32/bf16/fp16) -> z [r]. Rounding as the
torch ops': the gate's output (bias included) rounded, the sigmoid rounded, the product rounded; the matvec sums in
fp32 in another order than the torch ops'. Several requests' slots in one launch: prev [N], h [N, H] -> z [N, r],
each request's programs running exactly its one-slot programs (a request's z is bit for bit its one-slot z;
core.ops.stacked runs it under vmap).
"""
from __future__ import annotations

import torch

from core.kernels.common import Launch, after_previous, launch_opts, pow2_at_least, rounded, triton, tl

MAX_RANK = 512
ROWS = 16   # a program's outputs (rows of the gate)
BK = 256    # the gate's columns a program reads at a time: 3 + 1 steps at the shipped H = 576, r = 80


def fits(rank: int) -> bool:
    return 1 <= rank <= MAX_RANK


if triton is not None:
    @triton.jit
    def _gated_kernel(prev_ptr, h_ptr, w1_ptr, g_ptr, b_ptr, z_ptr, R, H, s_w1, s_g, n_prev, n_h, n_z,
                      PDL: tl.constexpr, RT: tl.constexpr, BK: tl.constexpr):
        after_previous(PDL)
        req = tl.program_id(0).to(tl.int64)  # the request whose slot this program runs (n_*: its strides)
        prev_ptr += req * n_prev
        h_ptr += req * n_h
        z_ptr += req * n_z
        dt = z_ptr.dtype.element_ty
        o = tl.program_id(1) * RT + tl.arange(0, RT)  # this program's rows of the gate (and of z)
        ook = o < R
        prev = tl.load(prev_ptr)
        acc = tl.zeros((RT,), dtype=tl.float32)
        for k0 in range(0, H, BK):  # the gate's columns over h
            ks = k0 + tl.arange(0, BK)
            kok = ks < H
            x = tl.load(h_ptr + ks, mask=kok, other=0.0).to(tl.float32)
            w = tl.load(g_ptr + o[:, None] * s_g + ks[None, :], mask=ook[:, None] & kok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        for k0 in range(0, R, BK):  # and over e = w1[prev]
            ks = k0 + tl.arange(0, BK)
            kok = ks < R
            x = tl.load(w1_ptr + prev * s_w1 + ks, mask=kok, other=0.0).to(tl.float32)
            w = tl.load(g_ptr + o[:, None] * s_g + H + ks[None, :], mask=ook[:, None] & kok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        b = tl.load(b_ptr + o, mask=ook, other=0.0).to(tl.float32)
        gate = rounded(acc + b, dt)
        keep = rounded(1.0 / (1.0 + tl.exp(-gate)), dt)
        e = tl.load(w1_ptr + prev * s_w1 + o, mask=ook, other=0.0).to(tl.float32)
        tl.store(z_ptr + o, (keep * e).to(dt), mask=ook)


def gated_latent(prev: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
                 launch: Launch = Launch()) -> torch.Tensor:
    """The module's contract: z [r] of one slot, in one launch (or z [N, r] for N requests' slots: prev [N], h
    [N, H])."""
    r, hidden = w1.shape[1], h.shape[-1]
    stacked = h.dim() == 2
    n = h.shape[0] if stacked else 1
    if not fits(r) or gate.shape != (r, hidden + r) or bias.shape != (r,) or prev.numel() != n or h.dim() > 2:
        raise ValueError(f"kernels.markov.gated_latent: rank {r} (at most {MAX_RANK}), gate {tuple(gate.shape)} "
                         f"(wanted {(r, hidden + r)}), bias {tuple(bias.shape)}, prev {tuple(prev.shape)} or h "
                         f"{tuple(h.shape)} does not fit")
    if w1.stride(-1) != 1 or gate.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError("kernels.markov.gated_latent: rows must be contiguous")
    z = torch.empty((n, r), dtype=w1.dtype, device=w1.device)
    p1, h2 = prev.reshape(n), (h if stacked else h.unsqueeze(0))
    _gated_kernel[(n, -(-r // ROWS))](p1, h2, w1, gate, bias, z, r, hidden, w1.stride(0), gate.stride(0),
                                      p1.stride(0), h2.stride(0), z.stride(0), RT=ROWS,
                                      BK=min(BK, pow2_at_least(max(hidden, r), 16)), num_warps=4,
                                      **launch_opts(launch, w1.device, 1))
    return z if stacked else z[0]
