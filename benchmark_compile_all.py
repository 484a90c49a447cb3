#!/usr/bin/env python3
"""xpress-bench entry point: AR and speculative decoding of a benchmark with an HF target and a dFlash drafter.

    python benchmark_compile_all.py --model-name-or-path TARGET --draft-name-or-path DRAFTER \
        --dataset gsm8k --data-dir ../shared/data/eval --max-samples 8 --max-new-tokens 256
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from harness.errors import UsageError
    try:
        from harness.config import parse_args
        from harness.runner import run
        run(parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
