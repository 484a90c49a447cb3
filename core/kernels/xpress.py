"""The xPress head's per-pass latent in one launch (refiners.xpress.XPressHead.latent).

A pass of the head, before its vocabulary readout, is a dozen tiny ops on a [B, r] block (B = 16 slots, r = 80 for
the shipped SmolLM2 head): the predecessor tokens' embedding rows, their half of in_proj, the add, the per-channel
causal mix, gate, up, silu, the product, down and the residual. As separate launches each costs a few microseconds
even inside a CUDA graph, which is most of a pass on a small target; here one program does them all, the block in
registers.

Contract: cache [B, r] (the pass-invariant half of in_proj, XPressHead.block_cache), prev [B] int64 token ids,
w1 [V, r] (embedding), w_tok [r, r] (in_proj's token columns; any row stride), mix [r, B, B] contiguous (folded:
M = L ⊙ tril + I; or raw L), gate and up [h, r], down [r, h], one dtype (fp32/bf16/fp16; fp32 not on a GPU:
`refused`) -> z [B-1, r] (slots 1..B-1). Several requests' blocks in one launch: cache [N, B, r] and prev [N, B]
-> z [N, B-1, r], one program per request, each running exactly the one-block program on its own rows (the same
weights), so a request's latent is bit for bit its one-block latent (core.ops.stacked runs it under vmap).
Rounding as the torch ops' (each op's output rounded to the dtype where the torch op rounds: the token half of
in_proj, the add, the mix, gate, up, silu, the product, down, the residual); the matmul and the mix sum in fp32,
in another order than cuBLAS. `fits` says which geometries the program takes.
"""
from __future__ import annotations

import torch

from core.kernels.common import Launch, after_previous, launch_opts, pow2_at_least, prec, rounded, triton, tl

MAX_BLOCK = 32   # slots: the mix loops over them, and every slot's row stays in registers
# the launcher's mix path and warps below rank 256: the transposed mix with 8 warps, the faster on an H100 (the
# probe: 10.6 against 14.2 us a launch; bench_refiner, two pairs on one card: 19.5 and 18.9 against 22.1 us a pass;
# results/perf/latent_probe_h100/), under which tests/test_xpress_latent.py passed compiled there
MIX_TRANSPOSED = True
WARPS = 8
MAX_RANK = 256   # r: three [block, r] fp32 blocks and a weight tile live in one program's registers


def fits(block: int, rank: int, hidden: int) -> bool:
    """Whether one program takes a head of this geometry (else the torch ops run the latent)."""
    return 2 <= block <= MAX_BLOCK and 1 <= rank <= MAX_RANK and 1 <= hidden <= 4 * MAX_RANK


def refused(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the compiled kernel is not used for this dtype on this device (None: it is). fp32 on a GPU: its first
    GPU run (2026-12-05, an H100, Triton 3.6, results/perf/NOTES.md) gave wrong latents at the shipped geometry
    with the raw mixer (every element off, the largest by 355) and ran out of shared memory at rank 256, while
    bf16 and fp16 matched the torch ops at every geometry tested and Triton's CPU interpreter matches in fp32.
    A probe of the launch settings on an H100 (harness/lab/probe_xpress_fp32.py, results/perf/NOTES.md) narrowed
    it: wrong (errors the size of the outputs) only with the raw mixer, ieee dots, 4 warps
    and the in_proj tile BK = 64 that the launcher picks at rank 80; right with BK = 16 or 8 warps, with or without
    PDL, and with the folded mixer. A Triton 3.6 code-generation fault is the likely cause, not confirmed; until a
    changed launch is tested on a GPU at every geometry (rank 256 also ran out of shared memory in fp32), the
    torch ops run fp32 heads on a GPU. The launcher's default is now 8 warps with the transposed mix (bf16 and fp16
    measured and tested so); fp32 stays refused, not retested at that setting."""
    if dtype == torch.float32 and device.type == "cuda":
        return "fp32 on a GPU"
    return None


if triton is not None:
    @triton.jit
    def _latent_kernel(cache_ptr, prev_ptr, w1_ptr, wt_ptr, m_ptr, g_ptr, u_ptr, d_ptr, z_ptr, B, R, H,
                       s_cache, s_prev, s_w1, s_wt, s_g, s_u, s_d, s_z, n_cache, n_prev, n_z, PDL: tl.constexpr,
                       PREC: tl.constexpr, RAW: tl.constexpr, BP: tl.constexpr, RP: tl.constexpr, BK: tl.constexpr,
                       BH: tl.constexpr, MIXT: tl.constexpr = False):
        after_previous(PDL)
        req = tl.program_id(0).to(tl.int64)  # the request whose block this program runs (n_*: its strides)
        cache_ptr += req * n_cache
        prev_ptr += req * n_prev
        z_ptr += req * n_z
        dt = z_ptr.dtype.element_ty
        rows = tl.arange(0, BP)
        cols = tl.arange(0, RP)
        rok, cok = rows < B, cols < R
        both = rok[:, None] & cok[None, :]
        prev = tl.load(prev_ptr + rows * s_prev, mask=rok, other=0)
        # x = cache + w1[prev] @ w_tok^T: the token half of in_proj, then the add, each rounded as torch rounds them
        lin = tl.zeros((BP, RP), dtype=tl.float32)
        for k0 in range(0, R, BK):
            ks = k0 + tl.arange(0, BK)
            kok = ks < R
            e = tl.load(w1_ptr + prev[:, None] * s_w1 + ks[None, :], mask=rok[:, None] & kok[None, :], other=0.0)
            wt = tl.load(wt_ptr + cols[None, :] * s_wt + ks[:, None], mask=kok[:, None] & cok[None, :], other=0.0)
            lin += tl.dot(e, wt, input_precision=PREC)
        cache = tl.load(cache_ptr + rows[:, None] * s_cache + cols[None, :], mask=both, other=0.0).to(tl.float32)
        x = rounded(cache + rounded(lin, dt), dt)
        # y[k, c] = sum_j M[c, k, j] x[j, c]: slot j's row picked out of the block, times M's column j of every
        # channel (a folded M holds the identity; a raw L is masked to j <= k and x added after, rounded once more)
        if MIXT:
            # the same mix over the transposed block (channels down, slots across): output slot k is one sum along
            # the slots of M[c, k, :] (B contiguous elements a channel) times x^T, no slot picked out of the block
            # first; the sum over j in the reduction's order, not j's (mix_transposed in `latent`)
            xt = tl.trans(x)
            yt = tl.zeros((RP, BP), dtype=tl.float32)
            both_t = cok[:, None] & rok[None, :]
            for k in range(0, B):
                live_t = both_t & (rows[None, :] <= k) if RAW else both_t
                mk = tl.load(m_ptr + cols[:, None] * B * B + k * B + rows[None, :], mask=live_t, other=0.0)
                yk = tl.sum(mk.to(tl.float32) * xt, axis=1)
                yt = tl.where(rows[None, :] == k, yk[:, None], yt)
            y = tl.trans(yt)
        else:
            y = tl.zeros((BP, RP), dtype=tl.float32)
            for j in range(0, B):
                xj = tl.sum(tl.where(rows[:, None] == j, x, 0.0), axis=0)
                live = both & (rows[:, None] >= j) if RAW else both
                mj = tl.load(m_ptr + cols[None, :] * B * B + rows[:, None] * B + j, mask=live, other=0.0)
                y += mj.to(tl.float32) * xj[None, :]
        y = rounded(y, dt)
        if RAW:
            y = rounded(x + y, dt)
        yd = y.to(dt)
        # z = y + down(silu(gate(y)) * up(y)), over the hidden width in chunks of BH
        acc = tl.zeros((BP, RP), dtype=tl.float32)
        for h0 in range(0, H, BH):
            hs = h0 + tl.arange(0, BH)
            hok = hs < H
            wmask = cok[:, None] & hok[None, :]
            wg = tl.load(g_ptr + hs[None, :] * s_g + cols[:, None], mask=wmask, other=0.0)
            wu = tl.load(u_ptr + hs[None, :] * s_u + cols[:, None], mask=wmask, other=0.0)
            ga = rounded(tl.dot(yd, wg, input_precision=PREC), dt)
            up = rounded(tl.dot(yd, wu, input_precision=PREC), dt)
            act = rounded(ga / (1.0 + tl.exp(-ga)), dt)
            a = (act * up).to(dt)
            wd = tl.load(d_ptr + cols[None, :] * s_d + hs[:, None], mask=hok[:, None] & cok[None, :], other=0.0)
            acc += tl.dot(a, wd, input_precision=PREC)
        z = (y + rounded(acc, dt)).to(dt)
        tl.store(z_ptr + (rows[:, None] - 1) * s_z + cols[None, :], z, mask=both & (rows[:, None] >= 1))


def head_weights(head) -> tuple:
    """`latent`'s weight arguments from an xPress head (refiners.xpress.XPressHead, duck-typed: core sits below the
    refiners): w1, in_proj's token half, the mixer, the MLP's gate, up and down."""
    m = head.mlp
    return head.w1.weight, head.w_tok, head.mix.L, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight


def settings(block: int, rank: int, dtype: torch.dtype, device: torch.device, folded: bool = True,
             launch: Launch = Launch(), mix_transposed: bool | None = None, tiles: dict | None = None) -> dict:
    """The compile-time settings and warps `latent` launches with at this geometry: the launcher's, or `tiles` (BK,
    BH, num_warps, MIXT) in their place, as harness/lab/probe_latent_speed times them."""
    rp = pow2_at_least(rank, 16)
    return {"PREC": prec(dtype), "RAW": not folded, "BP": pow2_at_least(block, 16), "RP": rp, "BK": min(rp, 64),
            "BH": 32 if rp >= 256 else 64, "num_warps": 8 if rp >= 256 else WARPS,
            "MIXT": MIX_TRANSPOSED if mix_transposed is None else mix_transposed, **(tiles or {}),
            **launch_opts(launch, device, block)}


def latent(cache: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w_tok: torch.Tensor, mix: torch.Tensor,
           gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, folded: bool = True,
           launch: Launch = Launch(), mix_transposed: bool | None = None, tiles: dict | None = None) -> torch.Tensor:
    """The module's contract: z [B-1, r] of one pass, in one launch (or [N, B-1, r] for N requests' blocks, cache
    [N, B, r] and prev [N, B]). folded=False: `mix` is the raw L (training's form), and the mix is x + (L ⊙ tril)
    x, as CausalMixer computes it. mix_transposed (None: MIX_TRANSPOSED): the mix as sums along each output slot's
    row of M (coalesced loads, one sum a slot) instead of one slot's column of x at a time: the default (with 8
    warps) since the twenty-second session; on an H100 10.6 us against 14.2 us for the column mix with 4 warps on
    the served launch (folded, PDL), the same bf16 bits on that input (results/perf/latent_probe_h100/). In general
    the two paths give the same values to the dtype's rounding, not bit for bit (the sum over slots in another
    order). harness/lab/probe_latent_speed.py times both, and other `tiles` (see `settings`)."""
    if cache.dim() not in (2, 3):
        raise ValueError(f"kernels.xpress.latent: cache {tuple(cache.shape)} is not [B, r] or [N, B, r]")
    stacked = cache.dim() == 3
    n, (b, r) = (cache.shape[0] if stacked else 1), cache.shape[-2:]
    h = gate.shape[0]
    why = refused(cache.dtype, cache.device)
    if why is not None:
        raise ValueError(f"kernels.xpress.latent: {why} is not taken (wrong results measured; see "
                         "kernels.xpress.refused); use the torch ops, or bf16 / fp16")
    if not fits(b, r, h):
        raise ValueError(f"kernels.xpress.latent: block {b}, rank {r}, MLP hidden {h} is outside one program "
                         f"(block <= {MAX_BLOCK}, rank <= {MAX_RANK}, hidden <= {4 * MAX_RANK}); use the torch ops")
    if mix.shape != (r, b, b) or not mix.is_contiguous() or prev.shape != cache.shape[:-1]:
        raise ValueError(f"kernels.xpress.latent: mix {tuple(mix.shape)} (contiguous [r, B, B] wanted) or prev "
                         f"{tuple(prev.shape)} does not fit blocks of {b} slots at rank {r} (cache "
                         f"{tuple(cache.shape)})")
    for t in (cache, w1, w_tok, gate, up, down):
        if t.stride(-1) != 1:
            raise ValueError("kernels.xpress.latent: every matrix's rows must be contiguous")
    z = torch.empty((n, b - 1, r), dtype=cache.dtype, device=cache.device)
    c3, p2 = (cache, prev) if stacked else (cache.unsqueeze(0), prev.unsqueeze(0))
    _latent_kernel[(n,)](c3, p2, w1, w_tok, mix, gate, up, down, z, b, r, h, c3.stride(1), p2.stride(1),
                         w1.stride(0), w_tok.stride(0), gate.stride(0), up.stride(0), down.stride(0), z.stride(1),
                         c3.stride(0), p2.stride(0), z.stride(0),
                         **settings(b, r, cache.dtype, cache.device, folded, launch, mix_transposed, tiles))
    return z if stacked else z[0]
