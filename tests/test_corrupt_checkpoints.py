"""A truncated or corrupt weights file is one line naming the file and what to do (core.checkpoints), on the
header path (shapes, checked before any model loads) and on the tensor path (the load itself). It used to end in
safetensors' traceback ("incomplete metadata, file not fully covered", "header too large") that names no file."""
import pytest
import torch
from safetensors.torch import save_file

from core.checkpoints import read_tensors, shard_files, tensor_shapes
from core.errors import UsageError
from drafters.dflash import load_dflash, read_dflash_config, save_dflash
from tiny import CPU32, tiny_drafter, tiny_target


def spoil(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"<html>404 Not Found</html>" * 40)


@pytest.fixture()
def weights(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(8)}, str(f))
    return f


def assert_one_line_naming(e, f):
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: not a readable safetensors file (")
    assert "truncated or corrupt: download it again or re-export it" in msg


@pytest.mark.parametrize("how", ["truncated", "garbage"])
@pytest.mark.parametrize("read", [tensor_shapes, read_tensors], ids=["header", "tensors"])
def test_a_spoiled_file_is_one_line_naming_it(weights, how, read):
    spoil(weights, how)
    with pytest.raises(UsageError) as e:
        read([weights])
    assert_one_line_naming(e, weights)


def test_a_sound_file_still_reads(weights):
    assert tensor_shapes([weights]) == {"a": (64, 64), "b": (8,)}
    assert set(read_tensors([weights], {"b"})) == {"b"}


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_drafter_folder_with_a_spoiled_file_is_refused_before_loading(tmp_path, how):
    save_dflash(tiny_drafter(tiny_target("qwen3"), block=4).model, tmp_path / "drafter")
    f = tmp_path / "drafter" / "model.safetensors"
    spoil(f, how)
    with pytest.raises(UsageError) as e:
        load_dflash(tmp_path / "drafter", read_dflash_config(tmp_path / "drafter"), CPU32)
    assert_one_line_naming(e, f)


def test_a_truncated_shard_index_is_one_line_naming_it(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model-00001-of-00002.safe')
    with pytest.raises(UsageError, match="download it again or re-export") as e:
        shard_files(tmp_path, "--draft-name-or-path")
    assert str(index) in str(e.value) and "\n" not in str(e.value)
