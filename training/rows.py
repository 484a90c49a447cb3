"""The hidden stage's arrow dataset held in memory, for speculators 0.9.0's `ArrowDataset`.

Its `_get_raw_data` reads a sample's row from the `datasets` table three times (the transfer's token ids, the
`torch.equal` check against `input_ids`, then `loss_mask`), each a full row formatted to torch through the split's
index mapping. At 32K-token steps (about 87 sequences) that was most of the 130-170 ms "fetch" of a step on the
H200 (num_workers 0). `Rows` reads the columns once into flat int64 tensors (the dtype the torch format gives
integer columns) with offsets, and `install` puts a view of it in place of each loader's `dataset.data`: a row is
then two tensor slices. The batches are the same tensors (tests/test_training_rows.py). Memory: 16 bytes a token
(input_ids and loss_mask), 0.35 GB for 22 M tokens, held once for every model a process trains. A spawned loader
worker gets the tensors through torch's pickling.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_LOADED: dict = {}  # Rows.load's one cached dataset: {"key": ..., "rows": Rows}


class Rows:
    """input_ids / loss_mask / seq_len of rows lo..hi of a dataset saved by `datasets`, from memory."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, offsets: np.ndarray, lo: int = 0, hi: int | None = None):
        self.ids, self.mask, self.offsets = ids, mask, offsets
        self.lo, self.hi = lo, len(offsets) - 1 if hi is None else hi

    @classmethod
    def load(cls, path: str) -> "Rows":
        """The saved dataset at `path`, read once a process: every model of a train stage shares it (the key is
        the folder and its files' sizes and times, so a rewritten dataset is read again)."""
        folder = Path(path).resolve()
        key = (str(folder), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir())
                                  if f.is_file()))
        if _LOADED.get("key") != key:
            _LOADED.clear()
            _LOADED.update(key=key, rows=cls._read(str(folder)))
        return _LOADED["rows"]

    @classmethod
    def _read(cls, path: str) -> "Rows":
        import pyarrow.compute as pc
        from datasets import load_from_disk
        ds = load_from_disk(path)
        table = ds.with_format(None).data  # the saved table (no index mapping: the hidden stage writes it whole)
        lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

        def flat(name):
            values = np.ascontiguousarray(pc.list_flatten(table.column(name)).to_numpy(zero_copy_only=False),
                                          dtype=np.int64)
            # arrow's zero-copy buffer is read-only, which torch warns about on every run: own a copy instead
            return torch.from_numpy(values if values.flags.writeable else values.copy())
        ids, mask = flat("input_ids"), flat("loss_mask")
        if len(ids) != offsets[-1] or len(mask) != offsets[-1]:
            raise ValueError(f"{path}: input_ids and loss_mask differ in length")
        return cls(ids, mask, offsets)

    def view(self, lo: int, hi: int) -> "Rows":
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"rows {lo}..{hi} of {len(self)}")
        return Rows(self.ids, self.mask, self.offsets, self.lo + lo, self.lo + hi)

    def __len__(self) -> int:
        return self.hi - self.lo

    def span(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return int(self.offsets[self.lo + i]), int(self.offsets[self.lo + i + 1])

    def input_ids(self, i: int) -> torch.Tensor:
        a, b = self.span(i)
        return self.ids[a:b]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.span(i)
        return {"input_ids": self.ids[a:b], "loss_mask": self.mask[a:b], "seq_len": torch.tensor(b - a)}


def install(loader, rows: Rows) -> None:
    """Serve `loader`'s ArrowDataset (speculators 0.9.0: `.data`, a `datasets` split from `start_file_idx`) from
    `rows`, the whole saved dataset."""
    ds = loader.dataset
    start, n = ds.start_file_idx, len(ds.data)
    ds.data = rows.view(start, start + n)
