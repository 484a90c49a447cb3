"""Weights the project writes get the mode the umask gives any other file: safetensors creates its files 0600
(owner only), so exported, shipped or made-up weights were unreadable to the rest of a shared machine."""
import os
import stat

import torch

from core.checkpoints import save_tensors, write_safetensors_dir


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_weights_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        save_tensors({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
        write_safetensors_dir(tmp_path / "d", {"k": 1}, {"a": torch.zeros(2)})
        from training.export import write_dir
        write_dir(tmp_path / "e", {"k": 1}, {"a": torch.zeros(64), "b": torch.zeros(64)}, limit_bytes=300)
    finally:
        os.umask(old)
    files = [tmp_path / "x.safetensors", tmp_path / "d" / "model.safetensors",
             *sorted((tmp_path / "e").glob("*.safetensors"))]
    assert len(files) == 4 and all(_mode(f) == 0o644 for f in files), [oct(_mode(f)) for f in files]
