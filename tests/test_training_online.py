"""hidden.mode=online (training/online.py): the training step computes the tapped target layers from the token ids;
it must hand speculators the very tensors the offline files would, so the loss is the offline loss. Both runs use
steps of 8192 tokens (total_seq_len > 4096), each row packing many sequences."""
import json
import shutil

import pytest
import torch

from training_fixtures import copy_stages, run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")
WIDE = 8192


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One offline and one online run of the same config (the online one reuses the prompts and responses)."""
    root = tmp_path_factory.mktemp("online")
    words = "apples pears plums figs limes dates kiwis melons".split()
    (root / "train.jsonl").write_text("".join(json.dumps({"question": (
        f"Sam has {a} {w} and buys {b} more every day for {a + b} days; then he gives {b} of them to each of his "
        f"{a} friends. How many {w} does Sam have left at the end?")}) + "\n" for a in range(3, 9) for b in range(1, 7)
        for w in words[a - 3:a - 2]))
    cfg = write_config(root, tiny_models(heads=False),
                       train={"total_seq_len": WIDE, "epochs": 3, "eval_prompts": 0, "train_ratio": 0.8})
    assert run_cli("all", "--config", cfg, "--workdir", root / "off") == 0
    for stage in ("prompts", "responses"):
        shutil.copytree(root / "off" / stage, root / "on" / stage)
    assert run_cli("all", "--config", cfg, "--workdir", root / "on", "--set", "hidden.mode=online") == 0
    return root, cfg


def _losses(work):
    rows = [json.loads(line) for line in (work / "train" / "drafter" / "metrics.jsonl").read_text().splitlines()]
    return [r["train"]["loss"] for r in rows if "train" in r], [r["val"]["loss_epoch"] for r in rows if "val" in r]


def test_online_hidden_stage_writes_token_ids_only(pair):
    root, _ = pair
    m = json.loads((root / "on" / "hidden" / "manifest.json").read_text())
    assert m["complete"] and m["mode"] == "online" and m["layer_ids"] == [1, 3, 5]
    assert not (root / "on" / "hidden" / "hidden_states").exists()
    assert (root / "off" / "hidden" / "hidden_states").is_dir()


def _first_batches(cfg_path, work):
    from training.config import load_config
    from training.hidden import out_dir
    from training.store import read_manifest
    from training.train import make_loaders
    cfg = load_config(str(cfg_path), workdir=str(work))
    hm = read_manifest(out_dir(cfg))
    assert hm["mode"] == "offline"
    off = next(iter(make_loaders(cfg, str(cfg_path.parent / "target"), hm, torch.float32)[0]))
    on = next(iter(make_loaders(cfg, str(cfg_path.parent / "target"), {**hm, "mode": "online"}, torch.float32)[0]))
    return cfg, hm, off, on


def test_online_and_offline_give_the_same_loss_on_the_same_batch(pair):
    """One packed 8192-token batch, offline (hidden_states/ files) and online (ids only + the target in the step):
    same ids and masks, the same hidden states to fp32 rounding, and the same loss for the same anchors. Power: the
    target run over the packed row as one sequence (positions not restarting, attention across sequences) gives
    hidden states far outside the tolerance."""
    from training.online import OnlineTaps
    from training.target import load_hf
    from training.train import build_model, trainer_kwargs
    from speculators.model import SpeculatorModel
    root, cfg_path = pair
    cfg, hm, off, on = _first_batches(cfg_path, root / "off")
    for k in ("input_ids", "loss_mask", "document_ids", "position_ids"):
        assert torch.equal(off[k], on[k]), k
    assert off["input_ids"].shape == (1, WIDE) and on["hidden_states"].shape == (1, WIDE, 0)
    real = int((off["document_ids"] >= 0).sum())
    assert real > 4096 and int(off["document_ids"].max()) >= 10  # > 4096 real tokens from many sequences
    target, _ = load_hf(cfg["target"], torch.device("cpu"))
    taps = OnlineTaps(target, hm["layer_ids"], torch.float32, torch.float32)
    scale = off["hidden_states"].abs().max()
    tol = 64 * torch.finfo(torch.float32).eps * scale
    for groups in (4, 1):  # train.target_groups: the row as four padded batches of similar lengths, then as one
        taps.groups = groups
        hs, last = taps.compute(on["input_ids"], on["position_ids"], on["document_ids"])
        assert (hs - off["hidden_states"]).abs().max() <= tol, groups
        assert (last - off["verifier_last_hidden_states"]).abs().max() <= tol, groups
    one = torch.where(on["document_ids"] >= 0, 0, -1)  # the row as one sequence: attention across sequences
    naive, _ = taps.compute(on["input_ids"], on["position_ids"], one)
    assert (naive - off["hidden_states"]).abs().max() > 1000 * tol
    m = cfg["models"]["drafter"]
    model = build_model(cfg, "drafter", str(cfg_path.parent / "target"), hm["layer_ids"], "eager")
    model.register_forward_pre_hook(taps, with_kwargs=True)
    kwargs, _ = SpeculatorModel.registry["dflash"].get_trainer_kwargs(**trainer_kwargs(m))
    losses = []
    for batch in (off, on):
        torch.manual_seed(7)  # the anchors
        with torch.no_grad():
            losses.append(model(**batch, **kwargs)[1])
    taps.close()
    assert torch.isfinite(losses[0]) and losses[0] > 0
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=0), losses


def test_online_run_trains_as_the_offline_run(pair):
    """Every logged step's loss and each epoch's validation loss of the two whole runs agree (fp32, CPU)."""
    root, _ = pair
    (t_off, v_off), (t_on, v_on) = _losses(root / "off"), _losses(root / "on")
    assert len(t_off) == len(t_on) >= 3 and len(v_off) == len(v_on) == 3
    assert t_on == pytest.approx(t_off, rel=1e-4) and v_on == pytest.approx(v_off, rel=1e-4)
    box = json.loads((root / "on" / "train" / "drafter" / "box.json").read_text())
    assert box["total_seq_len"] == WIDE and box["hidden_mode"] == "online"
    assert box["packed_tokens"] / box["steps"] > 4096  # steps of more than 4096 tokens


def test_a_cached_run_trains_as_the_online_run(pair):
    """train.taps_cache_gib (training/online.py TapsCache): the online run again with the target's output kept
    across epochs logs the same losses (fp32 compute, bf16 store: each sequence's kept numbers are those of the
    batch it was first computed in), and its box record says the later epochs were served from the cache: every
    train and val sequence computed once, then copied. Power: a cache that served nothing would record no hits."""
    root, cfg = pair
    for stage in ("prompts", "responses"):
        shutil.copytree(root / "off" / stage, root / "cache" / stage)
    assert run_cli("all", "--config", cfg, "--workdir", root / "cache", "--set", "hidden.mode=online",
                   "--set", "train.taps_cache_gib=1") == 0
    (t_on, v_on), (t_c, v_c) = _losses(root / "on"), _losses(root / "cache")
    assert t_c == pytest.approx(t_on, rel=1e-4) and v_c == pytest.approx(v_on, rel=1e-4)
    box = json.loads((root / "cache" / "train" / "drafter" / "box.json").read_text())
    rec = box["taps_cache"]
    assert rec["budget_gib"] == 1 and rec["refused_sequences"] == 0 and rec["sequences"] > 0
    # the reserve a slab leaves free is the stage's: 4 GiB and the drafter's fp32 logits and gradient at its most
    # anchors over the tiny target's vocab (TapsCache.step_reserve; without it, FREE_RESERVE's 4 GiB)
    from training.config import load_config
    from training.target import target_config
    c = load_config(str(cfg))
    m, vocab = c["models"]["drafter"], target_config(c["target"]).vocab_size
    assert rec["reserve_gib"] == round((4 * 2**30 + 2 * m["max_anchors"] * m["block_size"] * vocab * 4) / 2**30, 3)
    # 3 epochs: the first computes every token of its rows, the next two copy them (validation likewise)
    assert rec["hit_tokens"] == pytest.approx(2 * rec["computed_tokens"], rel=0.02)
    plain = json.loads((root / "on" / "train" / "drafter" / "box.json").read_text())
    assert plain["taps_cache"] is None


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_a_biased_drafter_trains_and_draws_toward_the_unsure_tokens(pair, monkeypatch, mode):
    """models.drafter.anchor_bias=1 (training/anchors.py) through the whole pipeline, with the hidden states online
    and from the offline files: every training step drew with the bias (validation steps did not: a draw that fell
    back to speculators' own counts no step); each step's u is 1 - the target's largest probability, recomputed
    here from the step's verifier states through the target's own norm and lm_head (u from another tensor, or
    random, fails it); speculators' own draw is back in place after the train stage. That the draw follows u is the
    unit tests' (tests/test_training_anchor_bias.py): here about 80 anchors over 6 steps of a tiny target are too
    few to show the shift (a measured gap of 1.2 standard errors at bias 1)."""
    from speculators.models.dflash import core
    from speculators.models.dflash.utils import select_anchors
    from training import anchors
    from training.target import load_hf
    root, cfg = pair
    seen, steps = [], []
    hook, select = anchors.AnchorBias.__call__, anchors.AnchorBias.select

    def recording_hook(self, module, args, kwargs):
        out = hook(self, module, args, kwargs)
        if self.unsure is not None:
            steps.append((kwargs["verifier_last_hidden_states"].detach().clone(), self.unsure.clone()))
        return out

    def recording_select(self, loss_mask, num_anchors, block_size):
        u = self.unsure
        anchors_, flags = select(self, loss_mask, num_anchors, block_size)
        if u is not None:
            valid = loss_mask[0].bool().clone()
            valid[-block_size:] = False
            seen.append((u[anchors_[flags]].tolist(), u[valid].tolist()))
        return anchors_, flags
    monkeypatch.setattr(anchors.AnchorBias, "__call__", recording_hook)
    monkeypatch.setattr(anchors.AnchorBias, "select", recording_select)
    work = root / f"bias_{mode}"
    src = root / ("on" if mode == "online" else "off")
    copy_stages(src, work)
    assert run_cli("all", "--config", cfg, "--workdir", work, "--set", f"hidden.mode={mode}",
                   "--set", "models.drafter.anchor_bias=1") == 0
    box = json.loads((work / "train" / "drafter" / "box.json").read_text())
    plain = json.loads((src / "train" / "drafter" / "box.json").read_text())
    assert box["anchor_bias"] == {"bias": 1.0, "biased_steps": box["steps"]} and box["steps"] == plain["steps"] > 0
    assert plain["anchor_bias"] is None and len(seen) == len(steps) == box["steps"]
    target, _ = load_hf(str(root / "target"), torch.device("cpu"))
    with torch.no_grad():
        for last, u in steps:
            p = target.lm_head(target.model.norm(last[0].float())).softmax(-1)
            want = torch.cat([torch.zeros(1), 1 - p[:-1].max(-1).values])
            torch.testing.assert_close(u, want, atol=64 * torch.finfo(torch.float32).eps, rtol=0)
    assert all(len(d) == min(16, len(v)) for d, v in seen)  # models.drafter.max_anchors per step
    assert core.select_anchors is select_anchors


def test_length_groups_are_the_fewest_positions():
    """length_groups against every way to cut the sorted lengths into at most k runs (brute force): the same
    fewest positions (rows x longest length, summed), every sequence once, longest first. Power: cutting into runs
    of equal row counts, the obvious shortcut, computes more positions on these lengths."""
    import itertools
    import random
    from training.online import length_groups
    rng = random.Random(3)
    for trial in range(40):
        lengths = [rng.choice([rng.randint(1, 40), 512, rng.randint(100, 300)]) for _ in range(rng.randint(1, 9))]
        for k in (1, 2, 3, 4):
            groups = length_groups(lengths, k)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            assert 1 <= len(groups) <= k
            cost = sum(len(g) * lengths[g[0]] for g in groups)
            assert all(lengths[g[0]] == max(lengths[i] for i in g) for g in groups)
            s = sorted(lengths, reverse=True)
            best = min(sum((b - a) * s[a] for a, b in zip((0, *cuts), (*cuts, len(s))))
                       for r in range(min(k, len(s))) for cuts in itertools.combinations(range(1, len(s)), r))
            assert cost == best, (lengths, k, groups)
    lengths = [512, 500, 490, 60, 50, 40, 30, 20]
    even = sum(len(g) * max(g) for g in ([512, 500, 490, 60], [50, 40, 30, 20]))
    assert sum(len(g) * lengths[g[0]] for g in length_groups(lengths, 2)) < even


def test_online_target_runs_unmasked_batches_of_similar_lengths():
    """What the target sees for one packed row with train.target_groups = 3: three right-padded batches, no
    attention mask, widths the groups' longest sequences, every sequence once from position 0; the packed-back
    states equal one masked forward of each sequence alone (fp32 rounding). Power: a left-padded or shuffled
    unpacking, or a mask that lets a row see another, breaks the per-sequence equality."""
    from tiny import tiny_hf_model
    from training.online import OnlineTaps
    torch.manual_seed(0)
    target = tiny_hf_model("llama", seed=2).eval()
    lengths = [37, 5, 120, 118, 9, 60, 64]
    total = sum(lengths) + 11  # the row's padding at the end (document id -1)
    ids = torch.randint(0, target.config.vocab_size, (1, total))
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)] + [torch.full((11,), -1)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(11)])[None]
    seen = []
    hook = target.model.register_forward_pre_hook(lambda m, a, kw: seen.append(
        (tuple(kw["input_ids"].shape), kw.get("attention_mask"))), with_kwargs=True)
    taps = OnlineTaps(target, [1, 2], torch.float32, torch.float32)
    taps.groups = 3
    hs, last = taps.compute(ids, pos, doc)
    hook.remove()
    assert [m for _, m in seen] == [None] * 3
    assert sorted(seen, key=lambda s: s[0]) == sorted([((2, 120), None), ((3, 64), None), ((2, 9), None)],
                                                     key=lambda s: s[0])
    ref = OnlineTaps(target, [1, 2], torch.float32, torch.float32)
    start = 0
    for d, n in enumerate(lengths):
        one = ids[:, start:start + n]
        with torch.no_grad():
            target.model(input_ids=one, attention_mask=torch.ones_like(one), use_cache=False)
        full = ref.capture.stacked()[0]
        ref.capture.store.clear()
        tol = 64 * torch.finfo(torch.float32).eps * full.abs().max()
        assert (hs[0, start:start + n] - full[:, :-1].flatten(1)).abs().max() <= tol, d
        assert (last[0, start:start + n] - full[:, -1]).abs().max() <= tol, d
        start += n
    assert hs[0, start:].abs().max() == 0 and last[0, start:].abs().max() == 0  # the row's padding stays zero
    taps.close()
    ref.close()
