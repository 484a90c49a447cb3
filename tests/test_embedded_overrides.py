"""A drafter or refiner typed alone replaces that piece of the embedded default and keeps the rest, as XPRESS_CKPT
and MK_CKPT do (harness.protocol.setups). It used to drop the whole default: `--draft-name-or-path D` or
`--xpress-refiner-path X` alone was refused with "--model-name-or-path is required"."""
import pytest

from embedded_weights import fake_embedded
from harness.protocol import flags, setups

TARGET = "/fetched/SmolLM2.gguf"


@pytest.fixture()
def shipped(monkeypatch, tmp_path):
    return fake_embedded(monkeypatch, tmp_path, TARGET)


def applied(argv):
    return setups.apply(*flags.typed_values(argv)[:2])


@pytest.mark.parametrize("flag,key", [("--draft-name-or-path", "draft_name_or_path"),
                                      ("--xpress-refiner-path", "xpress_refiner_path"),
                                      ("--markov-refiner-path", "markov_refiner_path")])
def test_one_typed_piece_replaces_only_that_piece(shipped, tmp_path, flag, key):
    mine = tmp_path / "mine"
    got = applied(["--device", "cpu", flag, str(mine)])
    assert got["preset"] == setups.EMBEDDED and got["model_name_or_path"] == TARGET
    assert got[key] == str(mine)
    for other, sub in setups.SHIPPED.items():
        if other != key:
            assert got[other] == str(shipped / sub)
    assert got["max_new_tokens"] == setups.EMBEDDED_CPU["max_new_tokens"]


def test_the_typed_piece_need_not_look_like_the_shipped_one(monkeypatch, tmp_path):
    """The shipped-weights check reads only what the default fills in: a typed drafter folder is checked under
    its own flag later, and the shipped drafter may be absent when another is typed."""
    fake_embedded(monkeypatch, tmp_path, TARGET, subs=("xpress", "markov"))
    got = applied(["--device", "cpu", "--draft-name-or-path", "z-lab/some-drafter"])
    assert got["draft_name_or_path"] == "z-lab/some-drafter" and got["model_name_or_path"] == TARGET


def test_the_full_parse_accepts_a_drafter_alone(shipped, tmp_path, monkeypatch):
    target = tmp_path / "SmolLM2.gguf"
    target.write_bytes(b"")
    monkeypatch.setattr(setups, "embedded_target", lambda: str(target))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    cfg = flags.parse_args(["--device", "cpu", "--draft-name-or-path", str(drafter),
                            "--results-dir", str(tmp_path / "r")])
    assert cfg.model_name_or_path == str(target) and cfg.draft_name_or_path == str(drafter)
    assert cfg.xpress_refiner_path == str(shipped / "xpress") and cfg.dataset == "gsm8k"


def test_a_typed_target_still_means_no_setup(shipped):
    named = applied(["--model-name-or-path", "x/y", "--draft-name-or-path", "x/d"])
    assert named.get("preset") is None and named["xpress_refiner_path"] is None


def test_a_typed_ar_only_drops_the_defaults_drafter_refiners_and_rounds(shipped, tmp_path, monkeypatch):
    """`--ar-only` on the embedded default was refused with "drop the refiner paths" though none was typed: the
    setup's drafter, refiners and paired rounds now give way to it."""
    got = applied(["--device", "cpu", "--ar-only"])
    assert got["model_name_or_path"] == TARGET and got["max_samples"] == setups.EMBEDDED_CPU["max_samples"]
    assert all(got[k] is None for k in (*setups.SHIPPED, "fair_interleave", "fair_k_list"))
    target = tmp_path / "SmolLM2.gguf"
    target.write_bytes(b"")
    monkeypatch.setattr(setups, "embedded_target", lambda: str(target))
    cfg = flags.parse_args(["--device", "cpu", "--ar-only", "--results-dir", str(tmp_path / "r")])
    assert cfg.ar_only and not cfg.fair and cfg.draft_name_or_path is None


def test_a_typed_k_wins_over_the_defaults_k_list(shipped):
    """`--xpress-refine-passes 4` alone ran the setup's K=2 (its fair_k_list) and config.json showed K=4."""
    got = applied(["--device", "cpu", "--xpress-refine-passes", "4"])
    assert got["fair_k_list"] is None and got["fair_interleave"] == setups.EMBEDDED_CPU["fair_interleave"]
    both = applied(["--device", "cpu", "--xpress-refine-passes", "4", "--fair-k-list", "1,3"])
    assert both["fair_k_list"] == "1,3"


def test_a_typed_k_list_sizes_the_setups_rounds_to_its_arms(shipped):
    """--fair-k-list 1,2 on the embedded default adds an arm: the setup's 4 rounds left every K sweep unbalanced
    (and labelled so); the rounds follow the arms now (warmup + one an arm), unless --fair-interleave is typed."""
    assert applied(["--device", "cpu"])["fair_interleave"] == setups.EMBEDDED_CPU["fair_interleave"]
    assert applied(["--device", "cpu", "--fair-k-list", "1,2"])["fair_interleave"] == 0
    assert applied(["--device", "cpu", "--fair-k-list", "1,2", "--fair-interleave", "4"])["fair_interleave"] == 4
