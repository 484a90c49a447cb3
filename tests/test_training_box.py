"""Box accounting (train/<model>/box.json) on a time-boxed run, and the warm start from an exported drafter."""
import json
import math
import shutil

import pytest
import torch

from training_fixtures import copy_stages, make_stages, run_cli, run_on, step_lrs, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")
BOX_MINUTES = 0.05  # 3 s


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The prompts, responses and hidden stages, made once for the module's runs (each run made its own before:
    the same data, as the stages are seeded). Their keys hold the target's and the prompt files' paths, so every
    config below names this root's (`box_config`); a run copies the stages into its workdir (`staged`)."""
    root = tmp_path_factory.mktemp("box_data")
    make_stages(write_config(root, tiny_models(heads=False)), root / "w")
    return root


def box_config(data, tmp_path, **train):
    """write_config's tiny config in tmp_path with these train settings, on the module's target and prompt files."""
    return write_config(tmp_path, tiny_models(heads=False), target=str(data / "target"),
                        prompts={"jsonl": [str(data / "train.jsonl")], "eval_dir": str(data / "eval")}, train=train)


def staged(data, work):
    """`work` with the module's data stages copied in: `all` there trains and exports (the stages are up to date)."""
    return copy_stages(data / "w", work)


def test_box_accounting_sums_to_the_box(data, tmp_path, capsys):
    """A 3-second time-boxed run with checkpoints, validation each epoch and held-out evaluation every 2 steps:
    box.json's parts, each timed on its own, add up to its wall time (the gaps between them under 2% + 0.15 s), the
    steps fill most of it, and the rates follow from the counts. Without the accounting there is no box.json."""
    cfg = box_config(data, tmp_path, epochs=200, save_every=3, eval_every=2, eval_share=0.1,
                     max_minutes=BOX_MINUTES, on_deadline="finish")
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    box = json.loads((tmp_path / "w" / "train" / "drafter" / "box.json").read_text())
    parts = box["parts_s"]
    assert box["device"] == "cpu"  # the card's "Device time" names it (training/card_md.py)
    assert box["compile"] == "none" and box["flex_kernel_options"] is None  # no compiled flex attention on a CPU
    assert set(parts) == {"startup", "steps", "validation", "held_out", "checkpoints", "finish", "export"}
    assert all(v > 0 for k, v in parts.items() if k != "finish"), parts
    assert abs(box["wall_s"] - sum(parts.values())) <= 0.02 * box["wall_s"] + 0.15, box
    assert box["wall_s"] == pytest.approx(box["train_wall_s"] + parts["export"], abs=1e-3)
    # box_s is what was left of the stage's box when the model started: the stage's box less the microseconds
    # between the two clock reads (CI once saw 2.9999966 s), so it is compared at a millisecond
    assert box["train_wall_s"] >= BOX_MINUTES * 60 and box["box_s"] == pytest.approx(BOX_MINUTES * 60, abs=1e-3)
    manifest = json.loads((tmp_path / "w" / "train" / "drafter" / "manifest.json").read_text())
    assert manifest["truncated"] and box["steps"] == manifest["global_step"] > 2
    assert box["steps_share"] == pytest.approx(parts["steps"] / box["wall_s"], abs=1e-3) and box["steps_share"] > 0.4
    assert box["tokens_per_s"] == pytest.approx(box["packed_tokens"] / parts["steps"], rel=1e-3)
    assert 0 < box["loss_tokens"] < box["packed_tokens"]
    # no train.profile_steps: no profile, no profile part
    assert box["profiled_steps"] is None and "profile" not in parts
    assert not (tmp_path / "w" / "train" / "drafter" / "profile.json").exists()
    # the first step apart (on the H200 it held 118.9 s of compile and loader start): the steady rate excludes it
    first = box["first_step_s"]
    assert 0 < first < parts["steps"]
    assert box["steady_steps_per_s"] == pytest.approx((box["steps"] - 1) / (parts["steps"] - first), rel=1e-3)
    assert box["steady_tokens_per_s"] == pytest.approx(
        box["packed_tokens"] * (box["steps"] - 1) / box["steps"] / (parts["steps"] - first), rel=1e-3)
    # per pass of the loop (each epoch): the passes' steps, seconds and tokens sum to the box's; the first pass's
    # steady rate leaves the process's first step out, the others are their plain rates
    ep = box["epochs"]
    assert len(ep) >= 2 and sum(e["steps"] for e in ep) == box["steps"]
    assert sum(e["packed_tokens"] for e in ep) == box["packed_tokens"]
    assert sum(e["steps_s"] for e in ep) == pytest.approx(parts["steps"], abs=1e-3 * len(ep))
    e0 = ep[0]
    assert [e["epoch"] for e in ep] == list(range(len(ep))) and e0["first_step"] == 0
    assert all(b["first_step"] == a["first_step"] + a["steps"] for a, b in zip(ep, ep[1:]))
    # steps_s and first_step_s are written to 1e-4 s: their rounding bounds the recomputed rate's error
    assert e0["steady_tokens_per_s"] == pytest.approx(
        e0["packed_tokens"] * (e0["steps"] - 1) / e0["steps"] / (e0["steps_s"] - first),
        rel=1e-4 / (e0["steps_s"] - first) + 1e-5, abs=0.1)
    assert all(e["steady_tokens_per_s"] == e["tokens_per_s"] for e in ep[1:] if e["steps"] > 0)
    # held-out evaluations are capped by eval_share: far fewer than one every 2 steps would be, but the final one runs
    assert 1 <= len(manifest["evals"]) < box["steps"] // 2
    # each evaluation's log line names the split and the prompts it measured (it once said "held-out" for the
    # selection split's first 8 prompts)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("acceptance during training @")]
    last = manifest["evals"][-1]
    assert len(lines) == len(manifest["evals"]) and last["set"] != "held-out"
    assert f"({last['set']}, {last['prompts']} of {last['of']} prompts)" in lines[-1], lines[-1]


def _rows(work, name="drafter"):
    text = (work / "train" / name / "metrics.jsonl").read_text()
    return [r for r in map(json.loads, text.splitlines()) if "train" in r]


def test_resume_from_exported_weights_continues_the_schedule(data, tmp_path):
    """A run cut short by its box (on_deadline=finish) exports bf16 weights and the step it reached; a new run with
    train.warm_start = that export starts from those weights and at that step: the LR at every step after the warm
    start equals the uninterrupted run's LR at that step (warm-up + cosine), and it ends at the same step. (The
    optimizer is fresh, so the losses are not asserted equal.) Before warm starts the key was unknown."""
    from training.config import load_config
    from training.train import build_model
    from training.warm import load
    cfg = box_config(data, tmp_path, epochs=3, warmup_ratio=0.3, eval_prompts=0)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "full")) == 0
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "cut"),
                   "--set", "train.max_minutes=1e-6", "--set", "train.on_deadline=finish") == 0
    export = tmp_path / "cut" / "export"
    state = json.loads((export / "drafter" / "train_state.json").read_text())
    assert state["truncated"] and state["global_step"] == 1
    copy_stages(tmp_path / "cut", tmp_path / "warm")  # the same data as the session before
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "warm", "--set",
                   f"train.warm_start={export}") == 0
    full = {r["global_step"]: r["lr"] for r in _rows(tmp_path / "full")}
    warm = {r["global_step"]: r["lr"] for r in _rows(tmp_path / "warm")}
    assert min(warm) == state["global_step"] and max(warm) == max(full) == state["planned_steps"] - 1
    assert len(set(full.values())) > 3  # the schedule moves
    assert warm == {g: full[g] for g in warm}
    # the warm start's weights are the exported ones (bf16 -> fp32 exactly), i.e. the cut run's up to bf16 rounding
    c = load_config(str(cfg), [f"train.warm_start={export}"], str(tmp_path / "warm"))
    model = build_model(c, "drafter", c["target"], [1, 3, 5], "eager")
    assert load(model, export / "drafter", "drafter") == 1
    from core.checkpoints import read_tensors, shard_files
    from safetensors.torch import load_file
    exported = read_tensors(shard_files(export / "drafter", "drafter"))
    m = json.loads((tmp_path / "cut" / "train" / "drafter" / "manifest.json").read_text())
    cut = load_file(str(tmp_path / "cut" / "train" / "drafter" / m["final"] / "model.safetensors"))
    own = model.state_dict()
    assert exported and all(torch.equal(own[k], v.float()) for k, v in exported.items())
    for k, v in exported.items():
        assert torch.allclose(v.float(), cut[k], rtol=2 ** -8, atol=0), k


def test_warm_mode_extend_runs_its_epochs_after_the_warm_step(data, tmp_path, capsys):
    """train.warm_mode=extend (a drafter continued on fresh data): a run cut at step W = E + 2 (off an epoch's
    boundary), warm-started with 2 more epochs, trains 2 whole passes (epochs 0 and 1) from W to W + 2E, with the LR
    at every step of one schedule over W + 2E steps; the same extend run cut at W + E + 3 and continued from its
    export with resume (the default) ends where the uncut one does, on the same LRs, its data where it was (3 steps
    into epoch 1: data_start recorded). Power: resume from W with the same 2 epochs plans 2E steps from step 0 and
    trains one partial pass; a resume that ignored data_start plans 2E too; skipping W mod E batches shortens the
    first pass."""
    cfg = box_config(data, tmp_path, epochs=2, warmup_ratio=0.3, eval_prompts=0)

    def run(work, *sets, data="cut"):
        return run_on(tmp_path, cfg, work, *sets, data=data)

    def passes(work):
        box = json.loads((tmp_path / work / "train" / "drafter" / "box.json").read_text())
        return [(p["epoch"], p["first_step"], p["steps"]) for p in box["epochs"]]

    def lrs(work):
        return step_lrs(tmp_path / work)

    staged(data, tmp_path / "one")
    assert run("one", data=None) == 0
    e = passes("one")[0][2]
    w = e + 2
    assert e >= 4 and run("cut", f"train.cut_at_step={w}", data="one") == 0
    export = tmp_path / "cut" / "export"
    assert json.loads((export / "drafter" / "train_state.json").read_text())["global_step"] == w
    assert run("ext", f"train.warm_start={export}", "train.warm_mode=extend") == 0
    assert passes("ext") == [(0, w, e), (1, w + e, e)]
    ext = lrs("ext")
    assert min(ext) == w and max(ext) == w + 2 * e - 1 and len(set(ext.values())) > 3
    m = json.loads((tmp_path / "ext" / "train" / "drafter" / "manifest.json").read_text())
    assert m["planned_steps"] == w + 2 * e and m["data_start"] == w
    # the extend run cut short, then continued with resume from its export
    assert run("ext_cut", f"train.warm_start={export}", "train.warm_mode=extend",
               f"train.cut_at_step={w + e + 3}") == 0
    export2 = tmp_path / "ext_cut" / "export"
    assert json.loads((export2 / "drafter" / "train_state.json").read_text())["data_start"] == w
    assert run("cont", f"train.warm_start={export2}") == 0
    assert passes("cont") == [(1, w + e + 3, e - 3)]
    cont = lrs("cont")
    assert max(cont) == max(ext) and cont == {g: ext[g] for g in cont}
    # resume from the first cut: its 2 epochs count from step 0, so one partial pass is left
    assert run("res", f"train.warm_start={export}") == 0
    assert passes("res") == [(1, w, e - 2)]
    shutil.rmtree(tmp_path / "res" / "train")
    capsys.readouterr()
    assert run("res", f"train.warm_start={export}", "train.epochs=1", data=None) == 2
    err = capsys.readouterr().err
    assert "nothing is left to train" in err and "train.warm_mode=extend" in err, err


@pytest.mark.parametrize("item, message", [
    ("hidden.mode=ram", "hidden.mode 'ram': use online"),
    ("hidden.target_dtype=fp8", "hidden.target_dtype 'fp8' is not one of"),
    ("train.total_seq_len=0", "train.total_seq_len must be an integer >= 1"),
    ("train.val_batches=-1", "train.val_batches must be an integer >= 0"),
    ("train.eval_share=2", "train.eval_share must be a fraction in [0, 1]"),
    ("train.warm_start=/no/such/export", "neither an export folder (manifest.json) nor shipped weights"),
    ("train.loss_impl=liger", "train.loss_impl 'liger': use one of auto, fused, eager"),
    ("train.loss_impl=fused", "fused runs on CUDA only"),
    ("acceptance.dtype=fp8", "acceptance.dtype 'fp8': use auto or one of"),
    ("acceptance.bench_prompts=0", "acceptance.bench_prompts must be an integer >= 1"),
    ('acceptance.bench=["gsm8k"]', "gsm8k"),
    ("acceptance.bench_max_seconds=-1", "acceptance.bench_max_seconds must be a number of seconds >= 0"),
    ("acceptance.sampled_temperatures=[0]", "acceptance.sampled_temperatures [0]: a list of distinct temperatures"),
    ("acceptance.sampled_temperatures=[1e-06]", "temperatures >= 1e-05 (below it the decode is greedy)"),
    ("acceptance.sampled_temperatures=[1,1]", "acceptance.sampled_temperatures [1, 1]: a list of distinct"),
    ("train.rows_in_memory=1", "train.rows_in_memory must be true or false"),
    ("train.profile_steps=-1", "train.profile_steps must be an integer >= 0"),
    ("train.compile_target=all", "train.compile_target 'all': use one of auto, layers, none"),
    ("train.warm_mode=rewind", "train.warm_mode 'rewind': use resume"),
    ("train.target_groups=0", "train.target_groups must be an integer in 1..64"),
    ("train.target_groups=65", "train.target_groups must be an integer in 1..64"),
    ("train.profile_start=0", "train.profile_start must be an integer >= 1"),
])
def test_bad_step_and_hidden_settings_are_refused(tmp_path, capsys, item, message):
    """The new keys are checked before any model loads: one error line, exit 2, nothing written."""
    cfg = write_config(tmp_path, tiny_models(heads=False))
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w", "--set", item) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "w").exists()


def test_fit_box_plans_the_steps_the_box_holds_and_anneals(data, tmp_path, monkeypatch):
    """train.fit_box on a 3-second box with 200 epochs planned (far more than fit): after 3 timed steps the plan
    becomes what the box holds (here set to 12 steps past the probe, so that neither a loaded CI machine nor a fast
    one moves it: a rate measured on a loaded machine once fitted fewer than 12); the run ends there untruncated, inside the box, with the cosine schedule
    re-planned so that its LR has decayed to near zero at the last step (without the fit the box cuts the run with
    the LR still near its peak: the truncated manifest of test_box_accounting_sums_to_the_box)."""
    import training.fit
    real, seen = training.fit.fitted_total, []

    def capped(step, rate, left_s, reserve, planned):
        seen.append((step, rate, left_s, reserve, planned))
        assert real(step, rate, left_s, reserve, planned) > step  # the arithmetic itself: test_fitted_total_arithmetic
        return step + 12 if len(seen) == 1 else 16  # the probes after it find the same plan (tests below)
    monkeypatch.setattr(training.fit, "fitted_total", capped)
    cfg = box_config(data, tmp_path, epochs=200, eval_prompts=0, max_minutes=BOX_MINUTES, on_deadline="finish",
                     fit_box=True, fit_probe_steps=3, fit_reserve=0.2, warmup_ratio=0.1)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    d = tmp_path / "w" / "train" / "drafter"
    manifest = json.loads((d / "manifest.json").read_text())
    box = json.loads((d / "box.json").read_text())
    fit = manifest["fit"]
    step, rate, left, reserve, planned = seen[0]
    assert len(seen) >= 2 and step == 4 and rate > 0 and 0 < left < BOX_MINUTES * 60 and reserve == 0.2
    assert fit == box["fit"] and fit["probe_steps"] == [1, 4] and fit["planned_steps"] == planned
    assert fit["fitted_steps"] == 16 < planned and manifest["planned_steps"] == 16 and fit["warmup_steps"] == 2
    assert fit["refit"]["fitted_steps"] == 16 and fit["refit"]["warmup_steps"] is None and "shortened" not in fit
    assert not manifest["truncated"] and manifest["global_step"] == 16
    lr = [v if isinstance(v, float) else next(iter(v.values())) for v in (r["lr"] for r in _rows(tmp_path / "w"))]
    assert max(lr) > 10 * lr[-1]  # annealed by the re-planned cosine


def test_the_next_pass_fits_again_when_the_box_holds_more(data, tmp_path, monkeypatch):
    """The fit cut the plan to 12 steps past its probe; the next pass (epoch) probes again over 3 steps after its
    first and finds the box holds 10 more steps past there (a faster pass: the online target's cache serves the
    epochs after the first): the plan is fitted again, longer, the schedule re-planned over it, and the run ends
    there, annealed. Power: without the second fit the run ends at the first fit's 16 steps."""
    import training.fit
    seen = []

    def fitted(step, rate, left_s, reserve, planned):
        seen.append(step)
        return step + (12 if len(seen) == 1 else 10)
    monkeypatch.setattr(training.fit, "fitted_total", fitted)
    cfg = box_config(data, tmp_path, epochs=200, eval_prompts=0, max_minutes=0.5, on_deadline="finish", fit_box=True,
                     fit_probe_steps=3, fit_reserve=0.2, warmup_ratio=0.1)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    d = tmp_path / "w" / "train" / "drafter"
    manifest = json.loads((d / "manifest.json").read_text())
    box = json.loads((d / "box.json").read_text())
    fit, per_pass = manifest["fit"], box["epochs"][0]["steps"]
    r = fit["refit"]  # its clock starts after the second pass's first step, global step per_pass + 1
    assert seen[0] == 4 and fit["fitted_steps"] == r["probe_steps"][1] + 10 > 16 and "shortened" not in fit
    assert per_pass >= 4  # the fit (after step 4) fell in the first pass, so the second probes again
    assert r["probe_steps"] == [per_pass + 1, per_pass + 4] and r["probe_steps"][1] in seen
    assert seen[-1] > per_pass + 4  # the probes after the fit went on after the refit (finding no shorter plan)
    # the warmup (the first fit's: ceil(0.1 x 16) = 2) is long over: it keeps its length, not 0.1 of the new plan
    assert fit["warmup_steps"] == 2 and math.ceil(0.1 * fit["fitted_steps"]) > 2
    assert r["warmup_steps"] == 2 and r["before"] == 16 and r["fitted_steps"] == fit["fitted_steps"]
    assert manifest["global_step"] == manifest["planned_steps"] == fit["fitted_steps"] and not manifest["truncated"]
    lr = [v if isinstance(v, float) else next(iter(v.values())) for v in (r["lr"] for r in _rows(tmp_path / "w"))]
    assert max(lr) > 10 * lr[-1]


@pytest.mark.parametrize("shorter_at", ["guard", "refit"])
def test_a_slower_stretch_after_the_fit_shortens_the_plan(data, tmp_path, monkeypatch, shorter_at):
    """The fit cut the plan to 16 steps; a later probe finds the box holds only 2 steps past its end (a slower
    stretch: the fit probed steps the online target's cache served). `guard`: one of the probes that follow the
    fit, back to back, in the first pass; `refit`: the next pass's probe. The plan is shortened there, the schedule
    re-planned over it, and the run ends at the shorter plan, annealed and not truncated. Power: without the
    shortening the run goes on to the fit's 16 steps (the 30 s box holds them)."""
    import training.fit
    seen, kept = [], []

    def fitted(step, rate, left_s, reserve, planned):
        seen.append(step)
        kept.append(reserve * left_s)
        if len(seen) == 1:
            return step + 12
        if shorter_at == "guard" and len(seen) == 2:
            return 15  # short of the plan by less than fit.SHORTEN_SLACK's share of its steps left (or 1): kept
        return step + 2
    monkeypatch.setattr(training.fit, "fitted_total", fitted)
    seq = 32 if shorter_at == "guard" else 1024  # small steps: many in a pass; large: a step a pass, the refit first
    cfg = box_config(data, tmp_path, epochs=200, eval_prompts=0, max_minutes=0.5, on_deadline="finish", fit_box=True,
                     fit_probe_steps=3, fit_reserve=0.2, warmup_ratio=0.1, total_seq_len=seq)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    d = tmp_path / "w" / "train" / "drafter"
    manifest = json.loads((d / "manifest.json").read_text())
    box = json.loads((d / "box.json").read_text())
    fit, per_pass = manifest["fit"], box["epochs"][0]["steps"]
    assert seen[0] == 4 and fit["planned_steps"] > 16, (seen, fit)
    # the later probes keep free the seconds the fit reserved (0.2 of what was left then), not 0.2 of what is left
    assert kept[0] > 0 and all(k == pytest.approx(kept[0], rel=1e-9) for k in kept[1:]), kept
    if shorter_at == "guard":  # the windows after the fit's, back to back: clocks from steps 5 and 9, 3 steps each
        assert per_pass > 12 and "refit" not in fit and len(fit["shortened"]) == 1, (per_pass, fit)
        short = fit["shortened"][0]
        assert seen[1:3] == [8, 12] and short["probe_steps"] == [9, 12] and short["before"] == 16
        assert short["warmup_steps"] == 2  # the first fit's warmup kept
    else:  # the refit records its own shortening, once
        short = fit["refit"]
        assert per_pass == 1 and "shortened" not in fit and short["before"] == 16 and short["warmup_steps"] == 2
    assert short["probe_steps"][1] == seen[-1] and short["fitted_steps"] == seen[-1] + 2 < 16
    assert manifest["global_step"] == manifest["planned_steps"] == fit["fitted_steps"] == seen[-1] + 2
    assert not manifest["truncated"]
    lr = [v if isinstance(v, float) else next(iter(v.values())) for v in (r["lr"] for r in _rows(tmp_path / "w"))]
    assert max(lr) > 10 * lr[-1]


def test_the_fit_probe_leaves_out_held_out_evaluations(data, tmp_path, monkeypatch):
    """A held-out evaluation after every step, each made to take 1 s: the fit's rate is the steps' own (tiny CPU
    steps, 5 to 50 a second; CI's loaded machine measured 5.0), within a factor 2 of the box's steady step rate, not
    3 steps over the evaluations' 3 s or more. Power: the probe without the evaluations' time taken out measures at
    most 1 step a second."""
    import time as _time
    import training.fit
    from training import trainer
    monkeypatch.setattr(trainer.PipelineTrainer, "_log_eval", lambda self: _time.sleep(1.0))
    monkeypatch.setattr(training.fit, "fitted_total", lambda step, *a: step + 2)
    cfg = box_config(data, tmp_path, epochs=200, eval_every=1, eval_share=1.0, max_minutes=0.5, on_deadline="finish",
                     fit_box=True, fit_probe_steps=3, fit_reserve=0.2)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    box = json.loads((tmp_path / "w" / "train" / "drafter" / "box.json").read_text())
    rate = box["fit"]["steps_per_s"]
    assert box["parts_s"]["held_out"] >= 3 and rate > 1.5 and rate > 0.5 * box["steady_steps_per_s"], box


def test_the_fit_probe_starts_after_a_profile(data, tmp_path, monkeypatch):
    """train.profile_steps=2 with fit_box: the profile covers the process's steps 4-5 and the probe's clock starts
    after them, so its steps and its summary are spent before the fit measures what the box has left (a profile after
    the probe, as before, was outside the fit's reserve: 90-second boxes on the H200 ran 5 s over). A 30 s box, the
    fit capped at 2 steps past the probe so that the run ends there."""
    import training.fit
    monkeypatch.setattr(training.fit, "fitted_total", lambda step, *a: step + 2)
    cfg = box_config(data, tmp_path, epochs=200, eval_prompts=0, max_minutes=0.5, on_deadline="finish", fit_box=True,
                     fit_probe_steps=3, fit_reserve=0.2, warmup_ratio=0.1, profile_steps=2)
    assert run_cli("all", "--config", cfg, "--workdir", staged(data, tmp_path / "w")) == 0
    box = json.loads((tmp_path / "w" / "train" / "drafter" / "box.json").read_text())
    assert box["profiled_steps"] == [4, 5] and box["fit"]["probe_steps"] == [5, 8]
    assert box["parts_s"]["profile"] > 0


def test_fitted_total_arithmetic():
    from training.fit import fitted_total
    assert fitted_total(100, 20.0, 50.0, 0.1, 10_000) == 100 + 900  # 20 steps/s x 45 s
    assert fitted_total(100, 20.0, 50.0, 0.1, 500) == 500            # the plan fits: unchanged
    assert fitted_total(100, 20.0, 0.0, 0.1, 500) == 101             # no time left: at least one more step


def test_fit_box_needs_a_box(tmp_path):
    from core.errors import UsageError
    from training.config import load_config
    cfg = write_config(tmp_path, tiny_models(heads=False), train={"fit_box": True})
    with pytest.raises(UsageError, match="fit_box needs a box: set train.max_minutes"):
        load_config(str(cfg))


def test_loss_impl_auto_is_fused_on_cuda_only():
    """train.loss_impl auto: speculators' fused Triton losses on CUDA (no [tokens, vocab] fp32 intermediates at
    32K-token steps), the eager ones on the CPU; fused on a CPU run is refused."""
    from core.errors import UsageError
    from training.train import loss_impl
    assert loss_impl({"loss_impl": "auto"}, torch.device("cuda")) == "fused"
    assert loss_impl({"loss_impl": "auto"}, torch.device("cpu")) == "eager"
    assert loss_impl({"loss_impl": "eager"}, torch.device("cuda")) == "eager"
    with pytest.raises(UsageError, match="CUDA only"):
        loss_impl({"loss_impl": "fused"}, torch.device("cpu"))
