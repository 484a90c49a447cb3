"""Where the tests find the benchmark JSONL files (../shared beside the repository, as on the CI machines)."""
from pathlib import Path

import pytest

EVAL_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
needs_eval = pytest.mark.skipif(not EVAL_DIR.is_dir(),
                                reason=f"benchmark JSONL files not found at {EVAL_DIR} (expected ../shared beside "
                                       f"the repo)")
