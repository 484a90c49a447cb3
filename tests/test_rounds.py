"""Interleaved rounds: counts, rotation order and balance, paired ratios (REFERENCE.md 1.3, appendix B.6)."""
import math
from collections import Counter

import pytest

from core.errors import UsageError
from harness.protocol.rounds import default_rounds, paired_ratios, rotation, validate_rounds

ARMS = ["AR", "drafter-only", "Markov", "xPress(K=4)", "xPress(K=6)"]


def test_default_rounds_is_warmup_plus_one_per_arm():
    assert default_rounds(5, 1) == 6
    assert default_rounds(4, 0) == 4


def test_rotation_rotates_left_by_round_minus_one():
    assert rotation(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # the reference's default at T=0: 5 variants, 6 rounds -> shifts 0, 1, 2, 3, 4, 0
    order = rotation(ARMS, 6)
    assert [ARMS.index(r[0]) for r in order] == [0, 1, 2, 3, 4, 0]
    assert rotation([], 2) == [[], []]


@pytest.mark.parametrize("n,warmup", [(1, 1), (3, 1), (5, 1), (4, 2), (3, 0)])
def test_every_arm_in_every_slot_once_over_the_measured_rounds(n, warmup):
    arms = ARMS[:n] if n <= len(ARMS) else [f"a{i}" for i in range(n)]
    measured = rotation(arms, default_rounds(n, warmup))[warmup:]
    assert len(measured) == n
    for slot in range(n):
        assert Counter(r[slot] for r in measured) == Counter(arms)  # each arm exactly once in this slot
    for r in measured:
        assert sorted(r) == sorted(arms)  # every round runs every arm once


def test_validate_rounds():
    assert validate_rounds(6, 1, 5) is None
    assert validate_rounds(11, 1, 5) is None  # two full rotations
    warn = validate_rounds(5, 1, 5)
    assert "not a multiple of 5" in warn and "--fair-interleave 6" in warn
    assert "--fair-interleave 11" in validate_rounds(7, 1, 5)
    with pytest.raises(UsageError) as e:
        validate_rounds(1, 1, 5)
    msg = str(e.value)
    assert "\n" not in msg and "no measured round" in msg and ">= 2" in msg and "6" in msg
    with pytest.raises(UsageError):
        validate_rounds(3, 0, 0)
    with pytest.raises(UsageError):
        validate_rounds(3, -1, 2)


def test_paired_ratios_within_rounds():
    tput = {3: {"AR": 50.0, "X": 250.0}, 2: {"AR": 100.0, "X": 200.0}}
    out = paired_ratios(tput, "AR")
    assert out == {"AR": [1.0, 1.0], "X": [2.0, 5.0]}  # ascending rounds, ratios inside each round


def test_a_round_missing_any_arm_is_dropped_for_every_arm():
    tput = {
        2: {"AR": 100.0, "X": 200.0, "Y": 300.0},
        3: {"AR": 100.0, "X": 250.0},                  # Y missing
        4: {"AR": 50.0, "X": 100.0, "Y": None},        # Y failed
        5: {"AR": 50.0, "X": math.nan, "Y": 100.0},    # X undefined
        6: {"AR": 80.0, "X": 160.0, "Y": 80.0},
    }
    out = paired_ratios(tput, "AR")
    assert out == {"AR": [1.0, 1.0], "X": [2.0, 2.0], "Y": [3.0, 1.0]}
    assert paired_ratios({2: {"AR": 0.0, "X": 1.0}}, "AR") == {"AR": [], "X": []}
    with pytest.raises(KeyError, match="Markov"):
        paired_ratios(tput, "Markov")


def test_an_unbalanced_schedule_is_detected_and_quantified():
    """Guards (issue 27): 8 arms in 2 measured rounds (the old embedded CUDA size) ran AR in slots 8 and 7 with no
    number saying how unbalanced that was."""
    from harness.protocol.rounds import balance, balance_note, imbalance, slot_counts
    arms = [f"a{i}" for i in range(8)]
    measured = rotation(arms, 3)[1:]
    assert slot_counts(measured)["a0"] == [0, 0, 0, 0, 0, 0, 1, 1]  # slots 7 and 8
    assert imbalance(measured) == 1
    design = balance(measured)
    assert design["latin_square"] is False and "unbalanced by 1" in balance_note(design)
    assert "unbalanced by 1" in validate_rounds(3, 1, 8)
    doubled = [["a", "b"], ["a", "b"], ["a", "b"]]                   # a always first: 3 - 0
    assert imbalance(doubled) == 3
    full = rotation(arms, 17)[1:]                                     # two rotations: every slot twice
    assert imbalance(full) == 0 and balance(full)["latin_square"] and balance_note(balance(full)) is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_default_schedules_are_balanced_latin_squares(temperature):
    """Guards (issue 27): the embedded default (CUDA and CPU) and --preset paper measure a Latin square over their
    arms, and on CUDA at T>0 give tau >= 5 sampling replicates (every round, warmup included; the CPU main job's 4
    rounds trade that for its wall time)."""
    from harness.protocol import setups
    from harness.protocol.config import RunConfig
    from harness.protocol.rounds import MIN_SEEDS, imbalance
    for name, d in ((setups.EMBEDDED, dict(setups.EMBEDDED_CUDA)), (setups.PAPER, None), ("cpu", setups.EMBEDDED_CPU)):
        d = setups.defaults(name, "cuda", temperature) if name == setups.PAPER else d
        k_list = [int(k) for k in d["fair_k_list"].split(",")]
        n_arms = 3 + len(k_list)                                      # AR, drafter-only, Markov, xPress per K
        warmup = d.get("fair_warmup_rounds", RunConfig.__dataclass_fields__["fair_warmup_rounds"].default)
        rounds = d["fair_interleave"] or default_rounds(n_arms, warmup)
        arms = [f"a{i}" for i in range(n_arms)]
        assert validate_rounds(rounds, warmup, n_arms) is None, name
        assert imbalance(rotation(arms, rounds)[warmup:]) == 0, name
        assert rounds >= MIN_SEEDS or name == "cpu", name
