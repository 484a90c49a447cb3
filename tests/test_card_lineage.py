"""`python -m training.card --lineage NAME=DIR ...`: one model card over weights that several runs made in turn (the
candidate's drafter from random weights in one session, warm-started in the next, heads trained on it in a third),
read from the flat records folders results/perf keeps (or from workdirs). Guards issue 26 item 7 ("the model card
gives the data, steps, GPU time, box accounting, loss curves and held-out tau for every model tried") for weights
no single run made, and the step count of records that log every 20th step."""
import contextlib
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def write_run(folder: Path, flat: bool, models: dict, stages=True, key=None):
    """models: name -> (first_step, last_step): train rows logged every 20 steps, a box.json and acceptance.json."""
    for m, (first, last) in models.items():
        d = folder if flat else folder / "train" / m
        d.mkdir(parents=True, exist_ok=True)
        pre = f"{m}_" if flat else ""
        rows = [{"train": {"loss": 1.0 / (1 + s)}, "profile": {"step_ms": 100.0 + s % 7}, "global_step": s}
                for s in range(first, last, 20)] + [{"val": {"loss_epoch": 0.25}}]
        (d / f"{pre}metrics.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
        (d / f"{pre}manifest.json").write_text(json.dumps({"global_step": last, "planned_steps": last,
                                                          "truncated": False}))
        (d / f"{pre}box.json").write_text(json.dumps({
            "wall_s": 10.0, "train_wall_s": 9.9, "parts_s": {"startup": 1.0, "steps": 8.9}, "unaccounted_s": 0.0,
            "steps_share": 0.9, "steps_per_s": 3.0, "packed_tokens": 1000, "loss_tokens": 800, "tokens_per_s": 100.0,
            "box_s": 12.0, "steps": last - first, "first_step": first, "last_step": last,
            "steady_tokens_per_s": 120.0}))
        (d / f"{pre}acceptance.json").write_text(json.dumps({
            "heldout": {"set": "heldout", "of": 64, "prompts": 64, "seconds": 1.0, "tau_drafter": 2.3 + first / 1e4}}))
    (folder / ("responses_manifest.json" if flat else "responses/manifest.json")).parent.mkdir(exist_ok=True)
    (folder / ("responses_manifest.json" if flat else "responses/manifest.json")).write_text(
        json.dumps({"sequences": 7, "response_tokens": 700, "prompt_tokens": 70, **({"key": key} if key else {})}))
    if stages:
        (folder / "stages.json").write_text(json.dumps({"train": {"seconds": 10.0}}))


def ship_manifest(path: Path):
    path.write_text(json.dumps({"shipped": {"drafter": "w/drafter", "xpress": "xpress", "markov": "markov_gated"},
                                "total_bytes": 69_316_729, "markov_choice": "the best selection tau",
                                "drafter_from": {"init_from": "w/drafter", "train_state": {"global_step": 2248}}}))


def card_cli(*args):
    return subprocess.run([sys.executable, "-m", "training.card", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT)


def card_main(*args):
    """training.card's main in this process (its exit code and stderr, as card_cli gives them): the CLI's own
    process is tested by the lineage card's test; the others check what main does (~2 s a process saved)."""
    from training import card
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = card.main([str(a) for a in args])
        except SystemExit as e:  # argparse's refusals
            rc = e.code
    return subprocess.CompletedProcess(args, rc, "", err.getvalue())


@pytest.fixture
def no_curves(monkeypatch):
    """For the cards whose checks read no loss-curve figure (about 0.4 s of CPU a figure): the figures are drawn
    and checked by the lineage card's test (its CLI process) and the tried-run test (loss_curves_cons.png)."""
    from training import card_curves
    monkeypatch.setattr(card_curves, "plot", lambda named, out, title: None)


@pytest.fixture
def lineage(tmp_path):
    write_run(tmp_path / "run2", True, {"drafter": (0, 914)})
    write_run(tmp_path / "run3", False, {"drafter": (914, 2248)})  # a workdir, not flat records
    write_run(tmp_path / "heads", True, {"xpress": (0, 494), "markov_gated": (0, 594)}, stages=False)
    ship_manifest(tmp_path / "heads.json")
    return tmp_path


def test_a_lineage_card_gives_every_run_in_order_with_the_steps_each_made(lineage):
    pytest.importorskip("matplotlib")
    t, out, md = lineage, lineage / "out", lineage / "CARD.md"
    r = card_cli("--lineage", f"run2={t / 'run2'}", "--lineage", f"run3={t / 'run3'}", "--lineage",
                 f"heads={t / 'heads'}", "--ship", t / "heads.json", "--out", out, "--markdown", md, "--title", "cand")
    assert r.returncode == 0, r.stderr
    card = json.loads((out / "card.json").read_text())
    assert [x["name"] for x in card["lineage"]] == ["run2", "run3", "heads"]
    run3 = card["lineage"][1]["card"]["models"][0]
    # the step reached is the manifest's, not the 67 logged rows; this run's own steps and start come from box.json
    assert run3["steps"] == 2248 and run3["box"]["steps"] == 1334 and run3["box"]["first_step"] == 914
    assert card["lineage"][2]["card"]["stages"] == {}  # a run without stages.json says n/a, it is not invented
    assert card["shipped"]["drafter_from"] == "w/drafter" and card["shipped"]["drafter_step"] == 2248
    text = md.read_text()
    heads = [line for line in text.splitlines() if line.startswith("## Run")]
    assert heads == ["## Run `run2`", "## Run `run3`", "## Run `heads`"]
    assert "| drafter | 2248 | 2248 | 1334 (from 914) |" in text and "| drafter | 914 | 914 | 914 (from 0) |" in text
    assert f"per-step records: `{t / 'run3'}`" in text and "(step 2248)" in text and "69.3 MB" in text
    assert "### Device time" in text and "n/a (no stages.json)" in text and "GPU time" not in text
    assert "Device: not recorded" in text  # these box records name no device: the card does not guess one
    # the lineage in numbers: each run's generated responses and its models' steps and packed tokens, then the sums
    assert "| `run3` | 7 | 700 | drafter: 1334, 1000 |" in text
    assert "| all | 21 | 2100 | drafter: 2000; markov_gated: 1000; xpress: 1000 |" in text
    for n in ("run2", "run3", "heads"):
        assert (out / f"loss_curves_{n}.png").stat().st_size > 0
    again = lineage / "again.md"
    assert card_main("--from-json", out / "card.json", "--markdown", again).returncode == 0
    assert again.read_text() == text  # the card is card.json's rendering


def test_a_run_on_a_carried_responses_stage_is_not_counted_as_new_data(tmp_path, no_curves):
    """Runs that trained on the responses another run made (the stage carried between sessions: the same key) did
    not generate them: the lineage's totals count that stage once, and the row names the run that made it."""
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "a", True, {"drafter": (0, 914)}, key="k1")
    write_run(tmp_path / "b", True, {"drafter": (914, 2248)}, key="k2")
    write_run(tmp_path / "c", True, {"drafter": (2248, 3000)}, key="k2")
    write_run(tmp_path / "h", True, {"xpress": (0, 494)}, key="k2")
    ship_manifest(tmp_path / "heads.json")
    md = tmp_path / "CARD.md"
    r = card_main(*[x for n in "abch" for x in ("--lineage", f"{n}={tmp_path / n}")], "--ship", tmp_path / "heads.json",
                 "--out", tmp_path / "out", "--markdown", md)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert "| `b` | 7 | 700 | drafter: 1334, 1000 |" in text
    assert "| `c` | none: `b`'s (7, carried) | none | drafter: 752, 1000 |" in text
    assert "| all | 14 | 1400 | drafter: 3000; xpress: 1000 |" in text  # not 28 sequences: b's stage counted once


def test_a_tried_run_is_listed_after_the_lineage_and_outside_its_count_and_totals(lineage, monkeypatch):
    """--tried: a recipe run on the shipped weights that lost (its models not shipped) is in the card, as the issue's
    "every model tried" asks, without being counted as a run that made the weights."""
    pytest.importorskip("matplotlib")
    from training import card_curves
    asked, real = [], card_curves.plot  # only the tried run's figure (the one checked) is drawn; each run's asked

    def plot(named, out, title):
        asked.append(out.name)
        return real(named, out, title) if out.name == "loss_curves_cons.png" else None
    monkeypatch.setattr(card_curves, "plot", plot)
    t, out, md = lineage, lineage / "out", lineage / "CARD.md"
    write_run(t / "cons", True, {"xpress": (0, 353), "xpress_cw1": (0, 701)})
    box = json.loads((t / "cons" / "xpress_box.json").read_text())  # the box fit cut its plan: the card says so
    (t / "cons" / "xpress_box.json").write_text(json.dumps({**box, "fit": {"planned_steps": 702, "fitted_steps": 353}}))
    r = card_main("--lineage", f"run2={t / 'run2'}", "--lineage", f"heads={t / 'heads'}", "--tried",
                 f"cons={t / 'cons'}", "--ship", t / "heads.json", "--out", out, "--markdown", md)
    assert r.returncode == 0, r.stderr
    card = json.loads((out / "card.json").read_text())
    assert [x["name"] for x in card["lineage"]] == ["run2", "heads"] and [x["name"] for x in card["tried"]] == ["cons"]
    text = md.read_text()
    assert "made by 2 runs in turn" in text and "## Tried on these weights, not shipped" in text
    assert text.index("## Run `heads`") < text.index("## Tried run `cons`")
    assert "| all | 14 | 1400 | drafter: 1000; markov_gated: 1000; xpress: 1000 |" in text  # cons is not summed
    assert "| xpress | 353 | 353 (fitted from 702) |" in text and "| xpress_cw1 | 701 | 701 |" in text
    assert "| xpress_cw1 | 701 |" in text and (out / "loss_curves_cons.png").stat().st_size > 0
    tried = text[text.index("## Tried run `cons`"):]
    assert "Nothing of this run was shipped" in tried and "(the Markov variant shipped)" not in tried
    assert sorted(asked) == ["loss_curves_cons.png", "loss_curves_heads.png", "loss_curves_run2.png"]
    assert card_main("--from-json", out / "card.json", "--markdown", lineage / "again.md").returncode == 0
    assert (lineage / "again.md").read_text() == text
    # a tried run needs the lineage it was tried on, and its name must differ from the lineage's
    for args, says in ((["--tried", f"cons={t / 'cons'}"], "--tried needs --lineage"),
                       (["--lineage", f"cons={t / 'run2'}", "--tried", f"cons={t / 'cons'}"], "must differ")):
        r = card_main(*args, "--out", t / "out2")
        assert r.returncode != 0 and says in r.stderr and not (t / "out2").exists(), r.stderr


@pytest.mark.parametrize("args, says", [
    (["--lineage", "run2"], "give NAME=DIR"),
    (["--lineage", "a={run2}", "--lineage", "a={run2}"], "must differ"),
    (["--lineage", "a={run2}", "--lineage", "b={tmp}/nothing"], "no such folder"),
    (["--lineage", "a={run2}", "--lineage", "b={tmp}/empty"], "not a run's records"),
    (["--lineage", "a={run2}", "--ship", "{run2}/drafter_box.json"], "not training.ship's manifest"),
])
def test_bad_lineages_fail_in_one_line_and_write_nothing(lineage, args, says):
    (lineage / "empty").mkdir()
    out = lineage / "out"
    args = [a.format(run2=lineage / "run2", tmp=lineage) for a in args]
    r = card_main(*args, "--out", out)
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def _prompts(folder: Path, train: int, pinned: str | None = None):
    (folder / "prompts_manifest.json").write_text(json.dumps({
        "train": train, "selection": 32, "heldout": 64, "magpie_generated": 52000, "dropped": {"duplicate": 3},
        "sources": {"heldout": {"magpie:chat": 64}},
        **({"eval_sets": {"path": "sets", "digest": pinned}} if pinned else {})}))


@pytest.mark.parametrize("train, pinned, says", [
    (58691, None, "its selection set is the one the shipped models were chosen on"),
    (58656, None, "its selection and held-out sets differ from the shipped runs'"),
    (58656, "d1", "its selection set is the one the shipped models were chosen on"),  # pinned alike: other pools
    (58691, "d2", "its selection and held-out sets differ from the shipped runs'"),
    (None, None, "whether its selection set is the shipped models' is not recorded")])
def test_a_tried_run_says_whether_its_prompt_sets_are_the_shipped_runs(lineage, train, pinned, says, no_curves):
    """The fourteenth session's run regenerated the Magpie pool (other engine numerics: 58,656 train prompts where the
    shipped runs had 58,691), so its held-out prompts were not theirs; its card said they were. Its box's device and
    compile mode, recorded since 2026-12-05, were dropped from the card too."""
    pytest.importorskip("matplotlib")
    t, out, md = lineage, lineage / "out", lineage / "CARD.md"
    _prompts(t / "run2", 58691, "d1" if pinned else None)
    write_run(t / "r2", True, {"drafter": (914, 1000)})
    if train:
        _prompts(t / "r2", train, pinned)
    box = json.loads((t / "r2" / "drafter_box.json").read_text())
    (t / "r2" / "drafter_box.json").write_text(json.dumps({**box, "device": "NVIDIA H200", "compile": "layers"}))
    bench = {"set": "bench:gsm8k", "of": 32, "prompts": 2, "seconds": 1.0, "tau_drafter": 3.0,
             "per_prompt": {"keys": ["a", "b"], "tau_drafter": [[10, 3], [10, 4]]}}
    acc = json.loads((t / "r2" / "drafter_acceptance.json").read_text())
    (t / "r2" / "drafter_acceptance.json").write_text(json.dumps({**acc, "bench:gsm8k": bench}))
    warm = {**bench, "tau_drafter": 2.5, "per_prompt": {"keys": ["a", "b"], "tau_drafter": [[10, 4], [10, 4]]}}
    (t / "r2" / "drafter_acceptance_warm.json").write_text(json.dumps({"global_step": 914, "bench:gsm8k": warm}))
    r = card_main("--lineage", f"run2={t / 'run2'}", "--lineage", f"heads={t / 'heads'}", "--tried", f"r2={t / 'r2'}",
                 "--ship", t / "heads.json", "--out", out, "--markdown", md)
    assert r.returncode == 0, r.stderr
    tried = md.read_text()[md.read_text().index("## Tried run `r2`"):]
    assert says in tried
    assert "Device: NVIDIA H200; torch.compile (train.compile): drafter layers." in tried
    # the benchmarks' fixed prompts, the same in every run: their tau and its gain over the warm start
    assert "| drafter | bench:gsm8k | 2 | 32 | 1.0 | 3.0 |" in tried and "bench:gsm8k τ 2.5" in tried
    assert "bench:gsm8k 1.143x [" in tried  # 20 tokens in 7 steps over 20 in 8


def test_the_card_says_how_each_model_trained_from_the_export_manifest(lineage, no_curves):
    """A head co-trained with its drafter (training/cotrain.py) and one on a frozen drafter read alike in every
    other table of the card; the recipe table, from the records' export_manifest.json, tells them apart. Records
    without that file get no table (nothing is guessed)."""
    pytest.importorskip("matplotlib")
    t, out, md = lineage, lineage / "out", lineage / "CARD.md"
    write_run(t / "cot", True, {"xpress": (0, 1402), "xpress_frozen": (0, 986), "markov": (0, 1015)})
    head = {"type": "xpress", "init_from": "weights/smollm2-135m/drafter", "lr": 0.01, "epochs": 3,
            "max_minutes": 9, "consistency_passes": 3, "consistency_weight": 0.3, "base_anchor_weight": 0.6,
            "xpress_rank": 80, "markov_rank": 64, "xpress_mlp_ratio": 2, "loss_fn": '{"ce": 0.1, "tv": 0.9}',
            "gamma": 4.0}  # no per_position_loss_weight: a record from before the field, exp decay at gamma
    # the export's config carries both heads' defaults: only the model's own is its rank (and the MLP ratio xPress's)
    (t / "cot" / "export_manifest.json").write_text(json.dumps({"models": {
        "xpress": {**head, "freeze_backbone": False, "backbone_lr_scale": 0.06},
        "xpress_frozen": {**head, "freeze_backbone": True, "xpress_rank": 160, "xpress_mlp_ratio": 8, "loss_fn": "ce",
                          "consistency_passes": 4, "per_position_loss_weight": "dpace", "dpace_alpha": 0.3},
        "markov": {**head, "type": "dspark", "freeze_backbone": True, "lr": 0.03}}}))
    (t / "run2" / "export_manifest.json").write_text(json.dumps({"models": {
        "drafter": {"type": "dflash", "init_from": None, "freeze_backbone": False, "lr": None, "epochs": 3,
                    "max_minutes": 12}}}))
    r = card_main("--lineage", f"run2={t / 'run2'}", "--lineage", f"heads={t / 'heads'}", "--tried",
                  f"cot={t / 'cot'}", "--ship", t / "heads.json", "--out", out, "--markdown", md)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    tried = text[text.index("## Tried run `cot`"):]
    frm = "| weights/smollm2-135m/drafter |"
    loss, decay = "ce 0.1 + tv 0.9", "exp decay, gamma 4.0"
    rest = "| 0.01 | 3 | 9 |"  # lr, epochs, box minutes
    assert f"| xpress | xpress {frm} co-trained at lr x 0.06 | 80 | 2 | {loss} | {decay} {rest} 3 | 0.3 | 0.6 |" \
        in tried
    assert f"| xpress_frozen | xpress {frm} frozen | 160 | 8 | ce | D-PACE, alpha 0.3 {rest} 4 | 0.3 | n/a |" in tried
    assert f"| markov | dspark {frm} frozen | 64 | n/a | {loss} | {decay} | 0.03 | 3 | 9 | n/a | n/a | n/a |" in tried
    run2 = text[text.index("## Run `run2`"):text.index("## Run `heads`")]
    # no gamma in the record: no slot weights printed
    assert "| drafter | dflash | random weights | trained | n/a | n/a | n/a | n/a | n/a | 3 | 12 | n/a | n/a | n/a |" \
        in run2
    heads = text[text.index("## Run `heads`"):text.index("## Tried")]
    assert "Recipe" not in heads  # no export_manifest.json among its records
    card = json.loads((out / "card.json").read_text())
    assert "recipe" not in card["lineage"][1]["card"]["models"][0]
    assert card_main("--from-json", out / "card.json", "--markdown", t / "again.md").returncode == 0
    assert (t / "again.md").read_text() == text
