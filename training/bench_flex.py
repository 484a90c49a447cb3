"""Flex attention of the DFlash drafter's step, alone: python -m training.bench_flex --out results/perf/flex.json

Why: an H100 profile of a training step of the 5-layer SmolLM2-135M DFlash drafter (torch 2.11, CUDA 13, bf16, 9
query / 3 KV heads, head_dim 64) gave flex attention's forward kernel 41.5 ms for 5 layer calls, its backward 10.0
ms, where a backward usually costs 2-2.5x its forward. This times flex_attention as training runs it (compiled
alone, training/compiling.py) on one synthetic packed row with that run's statistics: --tokens base tokens in
documents of about --doc-len (document_ids -1 on a padding tail, the first --prompt-share of each out of the loss),
anchors from speculators' select_anchors, the mask from its create_anchor_block_mask_mod and compiled
create_block_mask (128x128 blocks). Q: anchors x block_size rows; KV: tokens + Q. Random q, k, v and upstream
gradient. Each variant is a row, after --warmup calls (the first compiles): the forward alone (grad enabled, so it
writes the logsumexp as in training), then forward + backward (grad of q, k, v); medians of --reps CUDA-event
timings. The mask's blocks give the FLOPs computed (every listed block: 4d flops a pair forward, 10d backward) and
the useful ones (unmasked pairs). Rows on the default batch are checked against the default (output and the three
gradients, within 8 eps of the dtype): kernel options must not change results. On CPU flex attention has no
backward (torch 2.13): CPU rows are eager forwards under no_grad, where kernel options do nothing; they check the
harness, the statistics and the GQA expansion, not speed.

At the default shape (seed 0, computed on CPU with these functions) the mask lists 2,375 partial + 371 full blocks
of 512 x 770 (5.4 a Q block), 104 GFLOP computed forward (38% useful); at 32768 tokens 1,848 + 363, 83 GFLOP. The
profiled 8.3 ms a call is 10-12.5 TFLOP/s, the backward's 2.0 ms 100-130 on the same blocks: not more work, slower
work. Hypotheses, ranked (torch 2.13's source; the sm90 forward table and the fwd_/bwd_ prefixes are the same in
the 2.9-2.12-era sources found; "default_configs" and "kernels" record what the GPU's torch picks):
1. Tile and warps: the forward default for bf16, d 64 on sm90 is BLOCK_M = BLOCK_N = 128 with 4 warps, 3 stages: a
   thread holds 128 elements of every [BLOCK_M, BLOCK_N] tensor (fp32 scores, P, the mask_mod's int64 compares and
   booleans); the backward's (64x128 / 128x64 with 8 warps; 64x64 with 4 in older tables) 32. With this mask_mod
   the forward spills (measured on an H100, torch 2.11: 738 registers a thread; results/perf/flex_h100/). Rows: fwd_bm64_bn64 (32 a thread), fwd_warps8, fwd_bm128_bn64 (64); "kernels" gives
   n_regs, n_spills and tile_elems_per_thread.
2. mask_mod on nearly every tile (87% of listed blocks partial: 16x16 anchor blocks inside a 128 block, prefixes
   ending at anchors, documents not aligned to 128): it gathers query_anchor_positions[q], then document_ids[that],
   and document_ids[kv % T], in int64, re-loaded every KV iteration. Row: noop_mask_mod (same blocks, a mask_mod
   reading nothing; not compared).
3. Latency, not math: 512 Q blocks x 9 heads, ~5 tiles a CTA. TFLOP/s columns; fwd_stages2, fwd_tma ("all").
4. GQA: the forward runs a CTA per query head, loading each K/V block 3 times (the backward loops the 3 heads in
   one KV CTA): ~0.8 GB a call, a fraction of a ms. Row: gqa_repeat (K/V repeat_interleave'd to 9 heads, timed on
   the expanded tensors, gradients folded back for the check).
5. KV_LEN not a multiple of 128 (33000 + 65536): every block's indices are wrapped and its loads masked (both
   passes in 2.13), and the anchor region starting at KV 33000 splits each Q block's own 128 KV rows over two blocks
   (+527 partial). Row: seq128. training/configs/smollm2-gpu.json's 32768 is a multiple: not that config's profile.
6. Mask granularity: a 128-row Q block holds 8 sorted anchors. Rows: unsorted (random order, as before speculators
   sorted them; not compared), mask64 ("all": 64x64 blocks and forward tiles; a refusing backward is recorded).
Not at this shape: flex decoding and FORCE_USE_FLEX_ATTENTION (Q < 128 only). BACKEND="FLASH" (row flash, "all")
needs flash-attn's CuTe kernels installed; a refusal is recorded.
"""
from __future__ import annotations

import re
import statistics
import sys
import time

import torch

from core.errors import Parser, UsageError, cli_exit

TILE = 128  # create_block_mask's default BLOCK_SIZE, as speculators builds its masks
VARIANTS = {  # name: (kernel_options, what it tests)
    "default": ({}, "speculators' call: no kernel_options (torch's tiles), enable_gqa=True; training passes "
                    "train.flex_kernel_options, 64x64 forward tiles by default (fwd_bm64_bn64)"),
    "fwd_bm64_bn64": ({"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}, "H1: forward tile 64x64"),
    "fwd_bm128_bn64": ({"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64}, "H1: forward tile 128x64"),
    "fwd_bm64_bn128": ({"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128}, "H1: forward tile 64x128"),
    "fwd_warps8": ({"fwd_num_warps": 8}, "H1: forward with 8 warps"),
    "noop_mask_mod": ({}, "H2: same block lists, a mask_mod reading nothing (not compared)"),
    "fwd_stages2": ({"fwd_num_stages": 2}, "H3: forward with 2 pipeline stages"),
    "fwd_tma": ({"fwd_USE_TMA": True}, "H3: forward loads by TMA"),
    "rows_safe": ({"ROWS_GUARANTEED_SAFE": True}, "every query sees its own block: no masked-row check"),
    "gqa_repeat": ({}, "H4: K/V repeat_interleave'd to the query heads, enable_gqa=False"),
    "seq128": ({}, "H5: the other KV_LEN % 128 case: tokens rounded down to a multiple of 128, or 104 fewer if one"),
    "unsorted": ({}, "H6: anchors in random order, as before speculators sorted them (not compared)"),
    "mask64": ({"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}, "H6: 64x64 mask blocks, 64x64 forward tiles"),
    "flash": ({"BACKEND": "FLASH"}, "flash-attn CuTe backend (needs flash-attn installed)"),
}
DEFAULT_SET = "default,fwd_bm64_bn64,fwd_warps8,noop_mask_mod,fwd_bm128_bn64,gqa_repeat,unsorted,seq128"
KIND = {"seq128": "seq128", "unsorted": "unsorted", "noop_mask_mod": "noop", "mask64": "mask64"}  # another batch/mask


def packed_row(tokens: int, doc_len: int, prompt_share: float, seed: int):
    """document_ids and loss_mask [1, tokens] of one packed SFT row as speculators' collate builds it: documents of
    doc_len/2 .. 3*doc_len/2 tokens (the last cut short), a padding tail of -1 ids, the first prompt_share (+-0.15)
    of each document out of the loss."""
    g = torch.Generator().manual_seed(seed)
    pad = int(torch.randint(0, doc_len // 2 + 1, (1,), generator=g))
    docs, loss = torch.full((tokens,), -1, dtype=torch.long), torch.zeros(tokens, dtype=torch.long)
    pos, d = 0, 0
    while pos < tokens - pad:
        n = min(int(torch.randint(max(1, doc_len // 2), doc_len * 3 // 2 + 1, (1,), generator=g)), tokens - pad - pos)
        share = min(max(prompt_share + 0.3 * (float(torch.rand(1, generator=g)) - 0.5), 0.0), 0.95)
        docs[pos:pos + n] = d
        loss[pos + int(n * share):pos + n] = 1
        pos, d = pos + n, d + 1
    return docs.unsqueeze(0), loss.unsqueeze(0)


def useful_pairs(document_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> int:
    """Unmasked (query, key) pairs of speculators' anchor mask, counted, not evaluated: each anchor's `block` queries
    see the earlier tokens of the anchor's document and their own block."""
    ids, a = document_ids.reshape(-1).cpu(), anchors.reshape(-1).cpu()
    starts = torch.full((int(ids.max().clamp(min=0)) + 1,), ids.numel(), dtype=torch.long)
    starts.scatter_reduce_(0, ids[ids >= 0], torch.arange(ids.numel())[ids >= 0], "amin")  # each document's start
    doc = ids[a]
    prefix = torch.where(doc >= 0, a - starts[doc.clamp(min=0)], torch.zeros_like(a))
    return int(block * (prefix.sum() + block * a.numel()))


def mask_stats(bm, useful: int, heads: int, head_dim: int) -> dict:
    """Block counts of a BlockMask (partial: mask_mod runs on it; full: it does not) and the FLOPs they imply."""
    partial, fk, (bq, bkv) = int(bm.kv_num_blocks.sum()), bm.full_kv_num_blocks, bm.BLOCK_SIZE
    full = int(fk.sum()) if fk is not None else 0
    per_q = bm.kv_num_blocks.reshape(-1) + (fk.reshape(-1) if fk is not None else 0)
    q_blocks, kv_blocks = bm.kv_num_blocks.shape[-1], -(-bm.seq_lengths[1] // bkv)
    computed, f = (partial + full) * bq * bkv, 4 * head_dim * heads / 1e9
    return {"block_size": [bq, bkv], "q_blocks": q_blocks, "kv_blocks": kv_blocks, "partial_blocks": partial,
            "full_blocks": full, "block_density": (partial + full) / (q_blocks * kv_blocks),
            "kv_blocks_per_q_block": {"mean": float(per_q.float().mean()), "max": int(per_q.max())},
            "computed_pairs": computed, "useful_pairs": useful, "useful_share_of_computed": useful / max(computed, 1),
            "fwd_gflop_computed": f * computed, "fwd_gflop_useful": f * useful}


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V for enable_gqa=False: query head h reads KV head h // groups."""
    return x.repeat_interleave(groups, dim=1)


def flex_kernels(seen: set) -> list[dict]:
    """Best effort (private inductor attributes): the flex attention Triton kernels loaded since the last call, with
    the binary's registers, spills and shared memory and the template's constants."""
    out: list[dict] = []
    try:
        from torch._inductor.codecache import PyCodeCache
        mods = list(getattr(PyCodeCache, "modules", [])) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
        for name, k in ((n, k) for m in mods for n, k in list(vars(m).items())):
            if "flex" not in name or not hasattr(k, "launchers") or id(k) in seen:
                continue
            seen.add(id(k))
            src = getattr(getattr(k, "fn", None), "src", "") or ""
            c = dict(re.findall(r"^\s*(BLOCK_\w+|IS_DIVISIBLE|USE_TMA|GQA_SHARED_HEADS|SPARSE_\w+|HAS_FULL_BLOCKS)\s*:"
                                r"\s*tl\.constexpr\s*=\s*(\d+|True|False)", src, re.M))
            for ln in k.launchers or [None]:
                w = getattr(cfg := getattr(ln, "config", None), "num_warps", None)
                tile = [int(c[m]) * int(c[n]) // (32 * w) for m, n in (("BLOCK_M", "BLOCK_N"), ("BLOCK_M1", "BLOCK_N1"))
                        if m in c and n in c and w]
                out.append({"kernel": name, "n_regs": getattr(ln, "n_regs", None), "num_warps": w,
                            "n_spills": getattr(ln, "n_spills", None), "shared_bytes": getattr(ln, "shared", None),
                            "num_stages": getattr(cfg, "num_stages", None), **c,
                            "tile_elems_per_thread": tile[0] if tile else None})
    except Exception as e:  # noqa: BLE001 (private API: what was found, and why it stopped)
        out.append({"error": f"{type(e).__name__}: {e}"[:200]})
    return out


def default_configs(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    """The forward and backward tiles inductor picks without autotuning on this device (private; best effort)."""
    if device.type != "cuda":
        return {}
    try:
        from torch._inductor.choices import InductorChoices
        c = InductorChoices()
        return {"fwd": [str(x) for x in c.get_flex_attention_fwd_configs(head_dim, dtype, "cuda")],
                "bwd": [str(x) for x in c.get_flex_attention_bwd_configs(head_dim, dtype, "cuda")]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def _stamp(cuda: bool):
    """A CUDA event recorded now on the current stream, or the host clock."""
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


class Bench:
    def __init__(self, a, device: torch.device, dtype: torch.dtype):
        from speculators.models.dflash.attention import create_anchor_block_mask_mod
        from speculators.models.dflash.utils import select_anchors
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.a, self.device, self.dtype = a, device, dtype
        self.cuda = self.grad = device.type == "cuda"  # grad: time and check the backward too (no CPU backward)
        self._mod, self._select, self.batches = create_anchor_block_mask_mod, select_anchors, {}
        self._cbm, self.flex = create_block_mask, flex_attention
        if self.cuda:
            import speculators.models.attention as attention
            import speculators.models.dflash.core as core
            from training.compiling import compile_attention_only
            self._cbm = getattr(core, "_compiled_create_block_mask", None) or torch.compile(create_block_mask)
            compile_attention_only()  # the training's compiled flex_attention, put in speculators' module
            self.flex = attention.flex_attention
            cfg = torch._dynamo.config  # one graph a variant; never a silent eager (dense) fallback
            for k in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, k):
                    setattr(cfg, k, max(64, getattr(cfg, k)))
            if hasattr(cfg, "fail_on_recompile_limit_hit"):
                cfg.fail_on_recompile_limit_hit = True

    def batch(self, kind: str) -> dict:
        """Row, anchors, block mask, its statistics and q/k/v for a kind (default, seq128, unsorted, noop, mask64)."""
        if kind in self.batches:
            return self.batches[kind]
        a, tokens = self.a, self.a.tokens
        if kind == "seq128":
            tokens = tokens - tokens % TILE if tokens % TILE else tokens - 104
        docs, loss = (x.to(self.device) for x in packed_row(tokens, a.doc_len, a.prompt_share, a.seed))
        torch.manual_seed(a.seed)
        anchors, _valid = self._select(loss, a.anchors, a.block_size)
        if kind == "unsorted":
            anchors = anchors[torch.randperm(anchors.numel(), generator=torch.Generator().manual_seed(a.seed + 1))
                              .to(anchors.device)]
        mask_mod, q_len, kv_len = self._mod(docs.squeeze(0), tokens, anchors, a.block_size)
        bm = self._cbm(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=self.device,
                       BLOCK_SIZE=64 if kind == "mask64" else TILE)
        if kind == "noop":
            from torch.nn.attention.flex_attention import BlockMask, noop_mask
            bm = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                          BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=noop_mask, seq_lengths=bm.seq_lengths)
        stats = mask_stats(bm, useful_pairs(docs, anchors, a.block_size), a.heads, a.head_dim)
        stats.update(tokens=tokens, q_len=q_len, kv_len=kv_len, kv_len_multiple_of_128=kv_len % TILE == 0,
                     documents=int(docs.max()) + 1, loss_tokens=int(loss.sum()))
        g = torch.Generator(device=self.device).manual_seed(a.seed)
        rnd = lambda h, n: torch.randn(1, h, n, a.head_dim, generator=g, device=g.device, dtype=self.dtype)  # noqa
        self.batches[kind] = {"bm": bm, "stats": stats, "q": rnd(a.heads, q_len), "k": rnd(a.kv_heads, kv_len),
                              "v": rnd(a.kv_heads, kv_len), "go": rnd(a.heads, q_len)}
        return self.batches[kind]

    def _ms(self, fn, reps: int) -> list[list[float]]:
        """reps runs of fn, which calls mark() after each of its phases: per run, the ms of each phase. One sync at
        the end, so the host launches ahead and the device's time holds no launch gaps (but the first run's)."""
        runs = []
        for _ in range(reps):
            runs.append([_stamp(self.cuda)])
            fn(lambda: runs[-1].append(_stamp(self.cuda)))
        if self.cuda:
            torch.cuda.synchronize()
        return [[x.elapsed_time(y) if self.cuda else (y - x) * 1e3 for x, y in zip(m, m[1:])] for m in runs]

    def run(self, name: str) -> tuple[dict, dict]:
        """One variant: its row, and its output and gradients for the check."""
        a, (opts, what) = self.a, VARIANTS[name]
        b = self.batch(KIND.get(name, "default"))
        groups, gqa, grad = a.heads // a.kv_heads, name != "gqa_repeat", self.grad
        k, v = (b["k"], b["v"]) if gqa else (expand_kv(b["k"], groups), expand_kv(b["v"], groups))
        kw = {"block_mask": b["bm"], "enable_gqa": gqa and groups > 1, "scale": a.head_dim ** -0.5,
              **({"kernel_options": dict(opts)} if opts else {})}  # the default passes none, as speculators
        q, k, v = (x.detach().requires_grad_(grad) for x in (b["q"], k, v))
        res: dict = {}

        def call(mark, backward: bool):
            with torch.set_grad_enabled(grad):
                res["out"] = self.flex(q, k, v, **kw)
            mark()
            if backward:
                res["grads"] = torch.autograd.grad(res["out"], (q, k, v), b["go"])
                mark()

        row = {"variant": name, "tests": what, "batch": KIND.get(name, "default"), "kernel_options": opts,
               "enable_gqa": kw["enable_gqa"], "kv_heads_in_kernel": k.shape[1], "kv_len": b["stats"]["kv_len"]}
        t0 = time.perf_counter()
        for backward in (False, True)[:1 + grad]:
            self._ms(lambda m: call(m, backward), a.warmup)  # noqa: B023
        row["warmup_s"] = round(time.perf_counter() - t0, 2)
        row["fwd_ms"] = statistics.median(r[0] for r in self._ms(lambda m: call(m, False), a.reps))
        if grad:
            fb = self._ms(lambda m: call(m, True), a.reps)
            bwd = statistics.median(r[1] for r in fb)
            row.update(fwd_bwd_ms=statistics.median(sum(r) for r in fb), bwd_ms=bwd, bwd_over_fwd=bwd / row["fwd_ms"])
        s = b["stats"]
        for key, t, flop in (("fwd", row["fwd_ms"], 4), ("bwd", row.get("bwd_ms"), 10)):
            if t:
                row[f"{key}_tflops_computed"] = flop * a.head_dim * a.heads * s["computed_pairs"] / t / 1e9
                row[f"{key}_tflops_useful"] = flop * a.head_dim * a.heads * s["useful_pairs"] / t / 1e9
        got = {"out": res["out"].detach()}
        if grad:
            gq, gk, gv = res["grads"]
            if not gqa:  # the expanded heads' gradients summed back onto their KV head
                gk, gv = (x.view(1, a.kv_heads, groups, *x.shape[2:]).sum(2) for x in (gk, gv))
            got.update(dq=gq, dk=gk, dv=gv)
        return row, got


def compare(got: dict, ref: dict, dtype: torch.dtype) -> dict:
    """max |a - b| / max |b| per tensor; a match within 8 eps of the dtype (bf16 0.0625, fp32 9.5e-7)."""
    tol = 8 * torch.finfo(dtype).eps
    err = {k: float((got[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max().clamp(min=1e-12))
           for k in ref if k in got}
    return {"rel_err": err, "tolerance": tol, "matches": all(e <= tol for e in err.values())}


def measure(a) -> dict:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[a.dtype]
    names = list(VARIANTS) if a.variants == "all" else [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants: unknown {', '.join(unknown)} (known: all, {', '.join(VARIANTS)})")
    small = [k for k in ("tokens", "doc_len", "anchors", "block_size", "heads", "kv_heads", "head_dim", "reps",
                         "warmup", "layers_equivalent") if getattr(a, k) < 1]
    if small or a.heads % a.kv_heads or a.tokens <= a.block_size or not 0 <= a.prompt_share < 1:
        raise UsageError(f"{' '.join('--' + k.replace('_', '-') for k in small) or 'the shape'}: counts must be >= 1, "
                         "--heads a multiple of --kv-heads, --tokens > --block-size, --prompt-share in [0, 1)")
    names = ["default"] + [n for n in names if n != "default"]
    bench, start, seen, rows, ref = Bench(a, device, dtype), time.monotonic(), set(), [], None
    for name in names:
        if device.type != "cuda" and name == "flash":
            rows.append({"variant": name, "skipped": "CUDA only"})
            continue
        if time.monotonic() - start > a.budget_s:
            rows.append({"variant": name, "skipped": f"time budget (--budget-s {a.budget_s}) spent before it"})
            continue
        try:
            row, got = bench.run(name)
        except Exception as e:  # noqa: BLE001 (a variant this torch refuses is a result: its row says why)
            rows.append({"variant": name, "tests": VARIANTS[name][1], "error": f"{type(e).__name__}: {e}"[:600]})
            continue
        row["kernels"] = flex_kernels(seen)
        if name == "default":
            ref = got
        elif row["batch"] in ("default", "mask64") and ref is not None:
            row["check"] = compare(got, ref, dtype)
        rows.append(row)
    mode = ("torch.compile(flex_attention, dynamic=False) as training/compiling.py; block masks by speculators' "
            "compiled create_block_mask" if device.type == "cuda" else
            f"CPU: eager flex_attention, forward only under no_grad (torch {torch.__version__} as written: no flex "
            "attention backward on CPU; eager ignores kernel_options), uncompiled create_block_mask: checks, not speed")
    return {"label": "synthetic packed row, random q/k/v", "mode": mode, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "shape": {k: getattr(a, k) for k in ("tokens", "doc_len", "prompt_share", "anchors", "block_size", "heads",
                                                 "kv_heads", "head_dim", "seed")},
            "reps": a.reps, "warmup": a.warmup, "layers_equivalent": a.layers_equivalent,
            "default_configs": default_configs(device, dtype, a.head_dim),
            "masks": {k: v["stats"] for k, v in bench.batches.items()}, "rows": rows,
            "all_match": all(r.get("check", {}).get("matches", True) for r in rows),
            "elapsed_s": round(time.monotonic() - start, 1)}


def table(r: dict) -> str:
    n, s = r["layers_equivalent"], r["shape"]
    L = [f"# flex attention alone: {r['gpu'] or r['device']}, {r['dtype']}, torch {r['torch']} ({r['label']})", "",
         f"{r['mode']}.", "", f"Q {s['anchors']}x{s['block_size']}, KV {s['tokens']}+Q, {s['heads']}/{s['kv_heads']} "
         f"heads, d {s['head_dim']}; ms for {n} layer call(s); TFLOP/s on computed blocks / on useful pairs.", ""]
    for k, m in r["masks"].items():
        L.append(f"- mask {k}: {m['q_blocks']}x{m['kv_blocks']} blocks of {m['block_size']}, {m['partial_blocks']} "
                 f"partial + {m['full_blocks']} full (density {m['block_density']:.4f}, "
                 f"{m['kv_blocks_per_q_block']['mean']:.2f} a Q block, max {m['kv_blocks_per_q_block']['max']}), "
                 f"useful {m['useful_share_of_computed']:.3f} of computed, fwd {m['fwd_gflop_computed']:.1f} GFLOP "
                 f"computed, KV_LEN multiple of 128: {m['kv_len_multiple_of_128']}")
    L += ["", "| variant | fwd ms | bwd ms | fwd+bwd ms | bwd/fwd | fwd TFLOP/s | bwd TFLOP/s | check |",
          "|---|---|---|---|---|---|---|---|"]
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for w in r["rows"]:
        if "fwd_ms" not in w:
            L.append(f"| {w['variant']} | {(w.get('error') or w['skipped'])[:240].replace('|', '/')} |||||||")
            continue
        c = w.get("check")
        chk = "-" if c is None else ("ok" if c["matches"] else "DIFFERS") + f" {max(c['rel_err'].values()):.1e}"
        L.append(f"| {w['variant']} | {f(w['fwd_ms'] * n)} | {f(w.get('bwd_ms') and w['bwd_ms'] * n)} | "
                 f"{f(w.get('fwd_bwd_ms') and w['fwd_bwd_ms'] * n)} | {f(w.get('bwd_over_fwd'))} | "
                 f"{f(w.get('fwd_tflops_computed'), 1)} / {f(w.get('fwd_tflops_useful'), 1)} | "
                 f"{f(w.get('bwd_tflops_computed'), 1)} / {f(w.get('bwd_tflops_useful'), 1)} | {chk} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m training.bench_flex", description=__doc__.splitlines()[0])
    p.add_argument("--device")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    for flag, default in (("--tokens", 33000), ("--doc-len", 350), ("--anchors", 4096), ("--block-size", 16),
                          ("--heads", 9), ("--kv-heads", 3), ("--head-dim", 64), ("--seed", 0), ("--reps", 10),
                          ("--warmup", 2), ("--layers-equivalent", 1)):  # --tokens: base tokens a row (total_seq_len)
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--prompt-share", type=float, default=0.3, help="mean share of a document out of the loss")
    p.add_argument("--variants", default=DEFAULT_SET, help=f"comma list or 'all' ({', '.join(VARIANTS)})")
    p.add_argument("--budget-s", type=float, default=150.0, help="start no variant after this many seconds")
    p.add_argument("--out", help="JSON path; the markdown table goes beside it (.md)")
    a = p.parse_args(argv)
    done: dict = {}

    def work():
        r = done["r"] = measure(a)
        text = table(r)
        print(text)
        if a.out:
            from harness.protocol.results_io import write_record
            write_record(a.out, r, text)
    rc = cli_exit(work)
    if rc or done["r"]["all_match"]:
        return rc
    bad = [w["variant"] for w in done["r"]["rows"] if not w.get("check", {}).get("matches", True)]
    print(f"error: variants differ from the default beyond the dtype's tolerance: {', '.join(bad)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
