"""One check of --attn-implementation (core.attention.check_attn_impl), torch-free, and load_target runs it before
it reads a tokenizer or weights (it used to load the model first and fail in the Target)."""
import ast
from pathlib import Path

import pytest

from core.attention import ATTENTION_IMPLS, check_attn_impl
from core.errors import UsageError
from harness.decode.loading import load_target
from tiny import CPU32

ROOT = Path(__file__).resolve().parents[1]


def test_known_implementations_pass_and_others_are_one_line():
    assert [check_attn_impl(i) for i in ATTENTION_IMPLS] == ["sdpa", "eager"]
    with pytest.raises(UsageError, match=r"^--attn-implementation 'flash_attention_2': use sdpa or eager") as e:
        check_attn_impl("flash_attention_2")
    assert "\n" not in str(e.value)


def test_the_check_imports_no_torch():
    tree = ast.parse((ROOT / "core" / "attention.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "core.errors"}, names


def test_load_target_refuses_an_unknown_attention_before_reading_anything(tmp_path):
    with pytest.raises(UsageError, match="--attn-implementation 'flash'"):
        load_target(str(tmp_path / "no-such-model"), CPU32, attn_impl="flash")
