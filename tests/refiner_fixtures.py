"""What the refiner-checkpoint tests share: tiny heads, a tiny drafter, .pt and serving-directory writers."""
import argparse
import collections
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from drafters.dflash import config_for_target, random_dflash, save_dflash
from tiny import tiny_config

ROOT = Path(__file__).resolve().parent.parent
V, H, R, B, M = 128, 64, 8, 4, 16


class TaggedDict(collections.OrderedDict):
    """A harmless class a weights-only load must still refuse (it is not allow-listed)."""


def xpress_head(seed=0, vocab=V, hidden=H, rank=R, block=B, mlp=M):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g)

    return {"w1.weight": rnd(vocab, rank), "down_h.weight": rnd(rank, hidden), "down_g.weight": rnd(rank, hidden),
            "in_proj.weight": rnd(rank, 3 * rank), "mix.L": rnd(rank, block, block),
            "mlp.gate_proj.weight": rnd(mlp, rank), "mlp.up_proj.weight": rnd(mlp, rank),
            "mlp.down_proj.weight": rnd(rank, mlp), "w2.weight": rnd(vocab, rank)}


def markov_head(seed=0, vocab=V, rank=R):
    g = torch.Generator().manual_seed(seed)
    return {"w1.weight": torch.randn(vocab, rank, generator=g), "w2.weight": torch.randn(vocab, rank, generator=g)}


def xpress_args(**over):
    a = argparse.Namespace(markov_rank=R, mlp_ratio=M // R, markov_only=False, no_mixer=False, no_residual=True,
                           input_mode="concat", lr=1e-4)
    for k, v in over.items():
        setattr(a, k, v)
    return a


@pytest.fixture(scope="module")
def drafter():
    cfg = config_for_target(tiny_config(), 2, B, 127)
    return cfg, random_dflash(cfg, seed=1)


@pytest.fixture()
def base_dir(tmp_path, drafter):
    save_dflash(drafter[1], tmp_path / "base")
    return tmp_path / "base"


def draft_state(drafter):
    return {k: v.clone() for k, v in drafter[1].state_dict().items()}


def save_pt(path, drafter, kind="xpress", head=None, args=None, step=403000, **extra):
    if head is None:
        head = xpress_head() if kind == "xpress" else markov_head()
    if args is None:
        args = xpress_args() if kind == "xpress" else argparse.Namespace(markov_rank=R)
    content = {"draft_state_dict": draft_state(drafter), "refiner_state_dict": head, "args": args,
               "global_step": step, **extra}
    torch.save(content, path)
    return path


def assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def listing(d: Path):
    return sorted(p.name for p in d.iterdir())


def write_serving(d: Path, drafter, head: dict, prefix="xpress_head.", **cfg_extra):
    d.mkdir()
    cfg = {**drafter[0].to_dict(), "architectures": ["Qwen3XPressModel"], **cfg_extra}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({**draft_state(drafter), **{prefix + k: v for k, v in head.items()}}, str(d / "model.safetensors"))
    return d


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text
