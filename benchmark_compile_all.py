#!/usr/bin/env python3
"""xpress-bench entry point: AR and speculative decoding of a benchmark with an HF target and a dFlash drafter.

    python benchmark_compile_all.py --model-name-or-path TARGET --draft-name-or-path DRAFTER \
        --dataset gsm8k --data-dir ../shared/data/eval --max-samples 8 --max-new-tokens 256
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from harness.errors import cli_exit

    def work():
        from harness.protocol.config import parse_args
        from harness.protocol.runner import run
        run(parse_args(argv))
    return cli_exit(work)


if __name__ == "__main__":
    sys.exit(main())
