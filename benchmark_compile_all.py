#!/usr/bin/env python3
"""xpress-bench entry point: AR and speculative decoding of a benchmark with an HF target and a dFlash drafter.

    python benchmark_compile_all.py            # the embedded default (SmolLM2-135M, shipped weights, data/eval)
    python benchmark_compile_all.py --model-name-or-path TARGET --draft-name-or-path DRAFTER \
        --dataset gsm8k --data-dir data/eval --max-samples 8 --max-new-tokens 256

The arguments are parsed before anything heavy is imported, so --help and argument errors come at once.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from core.errors import cli_exit

    def work():
        from harness.protocol.flags import parse_args
        cfg = parse_args(argv)
        from harness.protocol.sweep_points import is_sweep
        if is_sweep(cfg):  # --batch-sizes / --context-lengths: every point in one process
            from harness.protocol.sweep import run
        else:
            from harness.protocol.runner import run  # torch and transformers: only once the arguments are good
        run(cfg)
    return cli_exit(work)


if __name__ == "__main__":
    code = main()
    from harness.protocol.distributed import leave
    leave(code)  # a rank of torchrun / accelerate launch ends here, without the interpreter's finalization
    sys.exit(code)
