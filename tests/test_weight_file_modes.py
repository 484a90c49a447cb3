"""Weights the project writes get the mode the umask gives any other file: safetensors creates its files 0600
(owner only), so exported, shipped or made-up weights were unreadable to the rest of a shared machine."""
import os
import stat

import torch

from core.checkpoints import save_tensors, write_safetensors_dir


def _modes(write) -> list[int]:
    old = os.umask(0o022)
    try:
        files = write()
    finally:
        os.umask(old)
    return [stat.S_IMODE(os.stat(f).st_mode) for f in files]


def test_weights_get_the_umask_mode(tmp_path):
    def write():
        save_tensors({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
        write_safetensors_dir(tmp_path / "d", {"k": 1}, {"a": torch.zeros(2)})
        return [tmp_path / "x.safetensors", tmp_path / "d" / "model.safetensors"]
    assert _modes(write) == [0o644, 0o644]


def test_exported_shards_get_the_umask_mode(tmp_path):
    import training_fixtures  # noqa: F401  (skips without the training extras, as the training tests do)
    from training.export import write_dir

    def write():
        write_dir(tmp_path / "e", {"k": 1}, {"a": torch.zeros(64), "b": torch.zeros(64)}, limit_bytes=300)
        return sorted((tmp_path / "e").glob("*.safetensors"))
    assert _modes(write) == [0o644, 0o644]  # two shards
