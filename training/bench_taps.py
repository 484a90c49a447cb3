"""The online target forward of a training step (training/online.py, OnlineTaps.compute), eager against
compiled decoder layers (train.compile_target=layers), on one device:

    python -m training.bench_taps --config-json target_hf/config.json --device cuda [--groups N] [--out F.json]

The target is the config's architecture with RANDOM weights (the cost of a forward does not depend on them); the
rows are packed by speculators' collate from simulated lengths like the GPU run's data (training/step_cost.py,
`simulated_lengths`). Reports the median milliseconds a packed row of --total-seq-len tokens over --batches rows
(after --warmup rows, which hold the compile), and how far the compiled hidden states are from the eager ones
(max |diff| over max |eager|, against the dtype's rounding). `--groups` is train.target_groups (a row run as that
many padded batches of similar lengths); `target_positions_per_row` counts what the target computes with it.
Nothing is written but --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from core.errors import Parser, UsageError, cli_exit


def build(config_json: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(config_json)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()


def rows(total: int, n: int, layers: list[int], seed: int, vocab: int) -> list[dict]:
    from training.step_cost import packed_batch
    cfg = {"train": {"total_seq_len": total}, "hidden": {"layer_ids": layers}}
    out = [packed_batch(cfg, seed + i, with_lengths=True) for i in range(n)]
    for b in out:  # packed_batch draws ids below SmolLM2's vocabulary; a smaller one takes them modulo its size
        b["input_ids"] %= vocab
    return out


def positions(lengths: list[int], groups: int) -> int:
    """The positions the target computes for one packed row run as `groups` padded batches."""
    from training.online import length_groups
    return sum(len(g) * lengths[g[0]] for g in length_groups(lengths, groups))


def timed(taps, batches, device) -> tuple[list[float], list[torch.Tensor]]:
    ms, outs = [], []
    for b in batches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        h, last = taps.compute(b["input_ids"], b["position_ids"], b["document_ids"], b["document_lengths"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms.append(1e3 * (time.perf_counter() - t))
        outs.append(torch.cat([h[0], last[0]], dim=-1).float().cpu())
    return ms, outs


SDPA = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def sdpa_context(name: str):
    """--sdpa: the target's attention kernels limited to one SDPA backend (auto: torch's own choice, which on an
    H100 with torch 2.11 was cuDNN's: 27.5 ms of host time a step over its 30 calls in the gsm8k run's profile)."""
    import contextlib
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, SDPA[name]))


def run(args) -> dict:
    with sdpa_context(args.sdpa):
        return _run(args)


def _run(args) -> dict:
    from training.online import OnlineTaps, compile_layers
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build(args.config_json, device, dtype, args.seed)
    n = target.config.num_hidden_layers
    layers = [2, n // 2, n - 3]
    batches = rows(args.total_seq_len, args.warmup + args.batches, layers, args.seed, target.config.vocab_size)
    real = sum(sum(b["document_lengths"]) for b in batches) / len(batches)
    padded = sum(positions(b["document_lengths"], args.groups) for b in batches) / len(batches)
    taps = OnlineTaps(target, layers, dtype, dtype)
    taps.groups = args.groups
    rec = {"config": args.config_json, "weights": "random", "device": str(device), "dtype": args.dtype,
           "backend": args.backend, "sdpa": args.sdpa, "target_groups": args.groups,
           "total_seq_len": args.total_seq_len, "rows_timed": args.batches, "warmup_rows": args.warmup,
           "real_tokens_per_row": round(real, 1), "target_positions_per_row": round(padded, 1)}
    ms_eager, eager = timed(taps, batches, device)
    compile_layers(target, backend=args.backend)
    t = time.perf_counter()
    ms_comp, comp = timed(taps, batches, device)
    rec["compiled_first_rows_s"] = round(sum(ms_comp[:args.warmup]) / 1e3, 2)
    taps.close()
    w = args.warmup
    rec["eager_ms"] = round(statistics.median(ms_eager[w:]), 2)
    rec["compiled_ms"] = round(statistics.median(ms_comp[w:]), 2)
    rec["speedup"] = round(rec["eager_ms"] / rec["compiled_ms"], 3)
    rel = max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)) for a, b in zip(eager, comp))
    rec["max_rel_diff"] = rel
    rec["dtype_eps"] = torch.finfo(dtype).eps
    rec["bench_wall_s"] = round(time.perf_counter() - t, 2)
    return rec


def main(argv=None) -> int:
    p = Parser(prog="python -m training.bench_taps", description=__doc__.split("\n\n")[0])
    p.add_argument("--config-json", required=True, help="an HF config.json (or its folder) of the target")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--total-seq-len", type=int, default=32768)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=1,
                   help="train.target_groups: the padded batches a packed row is run as (1: one)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (the tests use aot_eager)")
    p.add_argument("--sdpa", default="auto", choices=("auto", *SDPA),
                   help="the SDPA backend the target's attention may use (auto: torch's choice)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    def work():
        if args.batches < 1 or args.warmup < 1 or args.total_seq_len < 16 or args.groups < 1:
            raise UsageError("--batches, --warmup and --groups must be >= 1 and --total-seq-len >= 16")
        from pathlib import Path
        cj = Path(args.config_json)
        if not (cj.is_file() or (cj / "config.json").is_file()):
            raise UsageError(f"--config-json {cj}: no such config.json (give an HF config file or its folder)")
        if args.sdpa in ("cudnn", "efficient") and not args.device.startswith("cuda"):
            raise UsageError(f"--sdpa {args.sdpa} runs on CUDA only; use auto, flash or math with --device {args.device}")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device here; use --device cpu")
        rec = run(args)
        text = json.dumps(rec, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
