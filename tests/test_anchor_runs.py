"""training.anchor_runs' arithmetic on hand-made runs, and its refusals (before any model loads)."""
import pytest

import random

from training.anchor_runs import auc_lower, main, replay, summary


def test_replay_jumps_run_plus_one_and_stops_without_a_whole_block():
    runs = {10: 2, 11: 0, 12: 0, 13: 5, 14: 1, 15: 0, 16: 0, 17: 0, 18: 0, 19: 3}
    assert replay(runs, 10) == [2, 5, 3]  # 10 -> 13 -> 19 -> 23 (no anchor: the decode's tail is not replayed)
    assert replay(runs, 11) == [0, 0, 5, 3]


def test_summary_counts():
    # prompt 1: anchors 0..4; the decode accepted 3 at anchor 0, then 2 at anchor 4, then 1 at 7 (no whole block
    # there: left out); prompt 2: anchors 0..1, the decode accepted 0 at 0, then 1 at 1
    q = [{"runs": {0: 3, 1: 0, 2: 1, 3: 0, 4: 2}, "replay": [3, 2], "decode_accepted": [3, 2, 1],
          "decode_lengths": [4, 3, 2], "replay_equals_decode": True},
         {"runs": {0: 0, 1: 1}, "replay": [0, 1], "decode_accepted": [0, 1], "decode_lengths": [1, 2],
          "replay_equals_decode": False}]
    s = summary(q, block=4)
    assert s["anchors"] == 7 and s["all_anchor_eal"] == round((4 + 1 + 2 + 1 + 3 + 1 + 2) / 7, 4)
    assert s["replayed_tau"] == round((4 + 3 + 1 + 2) / 4, 4) and s["decoded_tau"] == round(12 / 5, 4)
    assert s["decode_steps"] == 5 and s["replayed_steps"] == 4
    assert s["decode_anchors_after_first"] == 2 and s["decode_anchor_eal"] == 2.5  # accepted 2 (at 4) and 1 (at 1)
    assert s["first_anchor_eal"] == 2.5  # accepted 3 and 0 at the starts
    assert s["p_first_draft_accepted"] == {"all_anchors": round(4 / 7, 4), "decode_anchors": 1.0}
    assert s["run_reaches_slot"] == [round(4 / 7, 4), round(2 / 7, 4), round(1 / 7, 4)]
    assert (s["replay_equals_decode"], s["replay_prompts"], s["prompts"]) == (1, 2, 2)
    assert s["decode_anchor_auc_target_prob"] is None  # no target_prob recorded
    q[0]["target_prob"] = {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.2, 4: 0.6}  # decode anchors: 0 (the start, left out), 4
    s = summary(q, block=4)  # anchor 4 (0.6) against 1, 2, 3 (0.8, 0.7, 0.2): below two of three
    assert s["decode_anchor_auc_target_prob"] == round(2 / 3, 4)
    # the decode's own anchors, not the replay's: a decode that accepted differently (bf16) is what is counted
    q[0]["decode_accepted"] = [1, 0, 0]  # anchors 0, 2, 3
    s = summary(q, block=4)
    assert s["decode_anchors_after_first"] == 3 and s["decode_anchor_eal"] == round((1 + 1 + 2) / 3, 4)
    # every anchor after the first visited: nothing to compare against, no AUC (it raised before)
    one = [{"runs": {0: 0, 1: 0}, "replay": [0, 0], "decode_accepted": [0, 0], "decode_lengths": [1, 1],
            "replay_equals_decode": True, "target_prob": {0: 0.5, 1: 0.4}}]
    assert summary(one, block=4)["decode_anchor_auc_target_prob"] is None


def test_replay_takes_a_whole_blocks_jump():
    runs = {p: 3 for p in range(20)}  # every block accepted whole (block 4): jumps of 4
    assert replay(runs, 0) == [3] * 5 and replay(runs, 2) == [3] * 5
    from training.anchor_runs import decode_anchors
    assert decode_anchors([3, 0, 2], 10) == [10, 14, 15]


def test_auc_counts_pairs_and_half_ties():
    rng = random.Random(0)
    for _ in range(50):
        pos = [rng.choice([0.1, 0.2, 0.3, 0.5]) for _ in range(rng.randint(1, 9))]
        neg = [rng.choice([0.2, 0.3, 0.4, 0.9]) for _ in range(rng.randint(1, 9))]
        brute = sum(1.0 if a < b else 0.5 if a == b else 0.0 for a in pos for b in neg) / (len(pos) * len(neg))
        assert abs(auc_lower(pos, neg) - brute) < 1e-12
    assert auc_lower([], [1.0]) is None


@pytest.mark.parametrize("args, says", [
    (["--weights", "/nonexistent"], "no drafter/config.json"),
    (["--dataset", "../x"], "bare name"),
    (["--max-new-tokens", "15"], "under the drafter's block of 16"),
    (["--max-samples", "0"], "--max-samples must be >= 1"),
    (["--refiner", "xpress", "--passes", "0"], "--passes must be >= 1"),
    (["--passes", "3"], "--passes 3 refines with xPress only; add --refiner xpress"),
    (["--refiner", "markov", "--passes", "3"], "--passes 3 refines with xPress only"),
    (["--topc", "5"], "--topc 5 refines with xPress only; add --refiner xpress"),
    (["--refiner", "xpress", "--topc", "-1"], "--topc must be 0 (the full vocabulary) or a shortlist of 1..1024"),
    (["--refiner", "xpress", "--topc", "1025"], "--topc must be 0"),
    (["--refiner", "xpress", "--weights", "EMPTY"], "is not a folder"),
])
def test_refusals_say_what_and_write_nothing(tmp_path, capsys, monkeypatch, args, says):
    import harness.decode.loading as loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")
    monkeypatch.setattr(loading, "load_target", no_load)
    monkeypatch.setattr(loading, "load_target_config", no_load)
    out = tmp_path / "runs.json"
    if "EMPTY" in args:  # a weights folder with a drafter and no heads
        import shutil
        from harness.protocol.setups import REPO
        shutil.copytree(REPO / "weights" / "smollm2-135m" / "drafter", tmp_path / "w" / "drafter")
        args = [str(tmp_path / "w") if a == "EMPTY" else a for a in args]
    assert main(["--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0]
    assert not out.exists()


def test_an_existing_out_is_refused(tmp_path, capsys):
    out = tmp_path / "runs.json"
    out.write_text("{}")
    assert main(["--out", str(out)]) == 2 and "exists" in capsys.readouterr().err
    assert out.read_text() == "{}"


def test_input_norms_are_the_two_halves_of_a_pass_and_leave_the_latent_unchanged():
    """InputNorms.watch: per slot, the mean norm of the head's block_cache row (the drafter's half of x) and of
    in_proj's token half applied to w1(prev), over the passes seen; the latent it wraps returns what the head's own
    method does, and `del head.latent` restores the method. Power: the halves swapped, or summed without the
    in_proj slice, differ from the sums computed here by far more than fp32 rounding."""
    import torch
    from refiners.xpress import random_xpress_head
    from training.anchor_runs import InputNorms
    head = random_xpress_head(50, 12, 6, 4, seed=0, std=0.3).fold().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    cases = [(head.block_cache(torch.randn(4, 12, generator=g)), torch.randint(0, 50, (4,), generator=g))
             for _ in range(2)]
    want = [head.latent(c, p) for c, p in cases]
    norms = InputNorms(4)
    norms.watch(head)
    got = [head.latent(c, p) for c, p in cases]
    del head.latent
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and "latent" not in vars(head)
    tok = [torch.nn.functional.linear(head.w1(p), head.in_proj.weight[:, 12:]) for _, p in cases]
    rec = norms.record()
    assert rec["passes"] == 2
    for k in range(4):
        h = sum(float(c[k].norm()) for c, _ in cases) / 2
        t = sum(float(x[k].norm()) for x in tok) / 2
        assert rec["hidden_norm"][k] == pytest.approx(h, abs=1e-4) and rec["token_norm"][k] == pytest.approx(t, abs=1e-4)
        assert rec["token_share"][k] == pytest.approx(t / (t + h), abs=1e-3)


def test_miss_rank_counts_the_tokens_above_the_truth_as_argmax_breaks_ties():
    """A block's first wrong draft and where the true token stood: a hit block has none; a runner-up is rank 1; a
    tie with a lower id counts above (argmax would pick it). Power: ranking from the hit's row, counting ties the
    other way or from 0 each changes one assertion."""
    import torch
    from training.anchor_runs import miss_rank
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0],    # slot 0: drafted 1, truth 1 (a hit)
                           [3.0, 1.0, 2.0, 0.0],    # slot 1: drafted 0, truth 2 (runner-up: rank 1)
                           [1.0, 1.0, 1.0, 1.0]])   # slot 2: four equal logits
    assert miss_rank(logits, torch.tensor([1, 2, 2]), run=1) == [1, 1]
    assert miss_rank(logits, torch.tensor([1, 0, 2]), run=2) == [2, 2]  # ties 0 and 1 rank above, 3 does not
    assert miss_rank(logits, torch.tensor([1, 0, 1]), run=2) == [2, 1]
    assert miss_rank(logits, torch.tensor([1, 0, 0]), run=3) is None
    # a shortlist of two (-inf elsewhere): a truth off it has no rank, whatever its id
    inf = float("-inf")
    short = torch.tensor([[inf, 2.0, inf, 1.0, inf, inf]])
    assert miss_rank(short, torch.tensor([0]), run=0) == [0, None] == miss_rank(short, torch.tensor([5]), run=0)
    assert miss_rank(short, torch.tensor([3]), run=0) == [0, 1]


def test_miss_ranks_split_the_first_slot_from_the_later_ones():
    from training.anchor_runs import miss_ranks
    # ranks 4/5 and 15/16 sit on the top-5 and top-16 edges (rank counts the tokens above: top 5 is rank <= 4)
    q = [{"first_miss": {0: [0, 1], 1: [0, 5], 2: [3, 1]}}, {"first_miss": {5: [1, 16], 6: [2, 4], 7: [0, 2],
                                                                           8: [4, 15]}}]
    s = miss_ranks(q)
    assert s["first_slot"] == {"misses": 3, "runner_up": round(1 / 3, 4), "top5": round(2 / 3, 4), "top16": 1.0,
                               "median_rank": 2, "off_shortlist": 0}
    assert s["later_slots"] == {"misses": 4, "runner_up": 0.25, "top5": 0.5, "top16": 0.75,
                                "median_rank": 4, "off_shortlist": 0}  # ranks 1, 4, 15, 16: the lower median
    # off a shortlist: in no top-k share, ranked past the others (here the median), counted apart
    off = miss_ranks([{"first_miss": {0: [2, None], 1: [2, 1], 2: [3, None]}}])["later_slots"]
    assert off == {"misses": 3, "runner_up": round(1 / 3, 4), "top5": round(1 / 3, 4), "top16": round(1 / 3, 4),
                   "median_rank": None, "off_shortlist": 2}
    assert miss_ranks([{"runs": {}}]) is None and miss_ranks([{"first_miss": {}}])["first_slot"] == {"misses": 0}
