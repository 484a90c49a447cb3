import sys
from pathlib import Path

# Tests import the project as top-level packages and share tests/tiny.py.
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
