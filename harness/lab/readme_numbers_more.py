"""More README quantities (see `harness.lab.readme_numbers_keys` for the conventions): the bench_step records
under `results/perf/gpu_check/`, the `--trace` A/B of `results/trace_ab/`, and the shipped weights' manifest."""
from __future__ import annotations

from functools import lru_cache

from core.errors import UsageError
from harness.protocol.labels import arm_name
from harness.lab.readme_numbers_keys import _json, arm, end, fmt, quantity, run_dir, sp, tau

GPU_CHECK = "results/perf/gpu_check"
# training.ship's manifest of the shipped weights: heads.json where the folder's manifest.json is the drafter's
# export (weights that a heads run shipped beside a drafter it did not train, as now), else manifest.json (what
# `python -m training.ship --out weights/smollm2-135m` writes for a run that trained all of them)
WEIGHTS_DIR = "weights/smollm2-135m"


def ship_manifest(root) -> dict:
    heads = root / WEIGHTS_DIR / "heads.json"
    return _json(heads if heads.is_file() else root / WEIGHTS_DIR / "manifest.json")


# --- bench_step (`python -m harness.lab.bench_step`, JSON under results/perf/gpu_check/) --------------------------
INVARIANT = "results/perf/batch_invariant_h200"  # bench_step with and without --batch-invariant (issue 28)


def bench(root, name: str, folder: str = GPU_CHECK) -> dict:
    return _json(root / folder / f"{name}.json")


def bench_arm(root, name: str, a: str, folder: str = GPU_CHECK) -> dict:
    want = arm_name(a)
    for row in bench(root, name, folder)["arms"]:
        if row["arm"] == want:
            return row
    raise UsageError(f"readme_numbers: {folder}/{name}.json has no arm {want!r}")


def stage(row: dict, field: str) -> float:
    """`step`: the whole-step graph's device ms; any other FIELD: that stage's own graph (`sg` columns)."""
    return row["graph"]["step_ms"] if field == "step" else row["stage_graphs"][field]


@quantity("step")
def q_step(root, name, a, field="step", d=3):
    """Graphed device ms of an arm's step (FIELD step) or of one stage (draft, refine, verify, accept, observe)."""
    return fmt(stage(bench_arm(root, name, a), field), d)


@quantity("stage_share_end")
def q_stage_share_end(root, name, spec, which):
    """One end of the stages' sum over the whole step, in whole percent (floored), over ARMS."""
    rows = [bench_arm(root, name, a) for a in spec.split(",")]
    return end([100 * r["stage_graphs"]["sum"] / r["graph"]["step_ms"] for r in rows], which, 0, floor=True)


@quantity("roofline")
def q_roofline(root, name, what, d=None):
    """`ratio`: the AR step over the weight roofline; `ms`: the roofline; `gb`: the target's weight bytes (1e9)."""
    b = bench(root, name)
    if what == "ratio":
        return fmt(b["ratios"]["AR_step_over_roofline"], 1 if d is None else d)
    if what == "ms":
        return fmt(b["roofline_ms"], 3 if d is None else d)
    if what == "gb":
        return fmt(b["weight_bytes"] / 1e9, 2 if d is None else d)
    raise UsageError(f"readme_numbers: roofline takes ratio, ms or gb, not {what!r}")


@quantity("invariant_cost")
def q_invariant_cost(root, preset, a, d=1):
    """How much the batch-invariant tiles change an arm's graphed step at PRESET's shapes, in percent, unsigned
    (the prose says faster or slower): results/perf/batch_invariant_h200/h200_PRESET[_invariant].json."""
    fast = stage(bench_arm(root, f"h200_{preset}", a, INVARIANT), "step")
    inv = stage(bench_arm(root, f"h200_{preset}_invariant", a, INVARIANT), "step")
    return fmt(abs(100 * (inv / fast - 1)), d)


def predicted(root, name, folder, a) -> float:
    """τ × AR step / spec step: the speedup a run's τ predicts from bench_step's graphed step times."""
    return tau(arm(root, folder, a)) * stage(bench_arm(root, name, "ar"), "step") / stage(bench_arm(root, name, a),
                                                                                             "step")


@quantity("predicted")
def q_predicted(root, name, folder, a, d=2):
    return fmt(predicted(root, name, folder, a), d)


@quantity("predicted_gap")
def q_predicted_gap(root, name, folder, a, d=0):
    """How far the measured Sp. falls below the prediction, in percent."""
    return fmt(100 * (1 - sp(arm(root, folder, a)) / predicted(root, name, folder, a)), d)


# --- the --trace A/B (results/trace_ab/inprocess.json, cli_ab.json) ----------------------------------------------
def trace_way(root, a: str, way: str) -> dict:
    ways = {"untraced": "untraced", "before": "traced, before", "after": "traced, after"}
    return _json(root / "results/trace_ab/inprocess.json")["per_arm"][arm_name(a)][ways[way]]


@quantity("trace_ms")
def q_trace_ms(root, a, way, d=3):
    """The in-process A/B's median ms per step of an arm, one way (untraced, before, after)."""
    return fmt(trace_way(root, a, way)["median_ms_per_step"], d)


@quantity("trace_ratio")
def q_trace_ratio(root, a, way, d=3):
    """The median paired ratio (traced / untraced) of one way."""
    return fmt(trace_way(root, a, way)["median_paired_ratio_to_untraced"], d)


@quantity("trace_slower")
def q_trace_slower(root, a, way, d=1):
    """The same ratio as a percentage slower than untraced."""
    return fmt(100 * (trace_way(root, a, way)["median_paired_ratio_to_untraced"] - 1), d)


@quantity("trace_reps")
def q_trace_reps(root):
    return str(_json(root / "results/trace_ab/inprocess.json")["reps"])


@quantity("cli_ar_ms_end")
def q_cli_ar_ms_end(root, run, which, d=1):
    """One end of the AR ms/step over the repetitions of one configuration (RUN) of the CLI A/B (cli_ab.json)."""
    reps = _json(root / "results/trace_ab/cli_ab.json")[run]["repetitions"]
    return end([r["AR_ms_per_step"] for r in reps], which, d)


# --- the shipped weights (weights/smollm2-135m/heads.json) ---------------------------------------------------------
def model(root, name: str) -> dict:
    return ship_manifest(root)["models"][name]


def held_out(rec: dict) -> dict:
    """A model's held-out acceptance record: "heldout" in training.ship's manifests since the 64-prompt held-out
    set (its prompts, of and by_source beside the taus), "held_out" in the first shipped weights' manifest."""
    return rec["heldout"] if "heldout" in rec else rec["held_out"]


@quantity("weights_mb")
def q_weights_mb(root, d=1):
    """The shipped files' size in MB (1e6 bytes)."""
    return fmt(ship_manifest(root)["total_bytes"] / 1e6, d)


@quantity("held_out")
def q_held_out(root, name, key, d=2):
    """A trained model's held-out τ as the manifest records it (MODEL drafter, xpress, markov_gated ...)."""
    return fmt(held_out(model(root, name))[key], d)


@quantity("held_out_end")
def q_held_out_end(root, name, prefix, which, d=2):
    """One end of a model's held-out greedy τ over the keys starting with PREFIX (tau_xpress_K: every K); the
    sampled keys (suffix _T<T>, acceptance.sampled_temperatures) are not among them."""
    vals = [v for k, v in held_out(model(root, name)).items() if k.startswith(prefix) and "_T" not in k]
    return end(vals, which, d)


@quantity("steps")
def q_steps(root, name):
    """A trained model's optimizer steps (global_step)."""
    return str(model(root, name)["global_step"])


@quantity("shipped")
def q_shipped(root, role, what):
    """A shipped model's record (ROLE drafter, xpress, markov) field: layers, rank, step."""
    m = ship_manifest(root)
    rec = m["models"][m["shipped"][role]]
    fields = {"layers": "num_layers", "step": "global_step",
              "rank": "markov_rank" if role == "markov" else "xpress_rank"}
    return str(rec[fields[what]])


# --- the shipped weights' model card (results/smollm2-135m/training/card.json) ------------------------------------
CARD = "results/smollm2-135m/training/card.json"


@quantity("card")
def q_card(root, run, name, path, d=3):
    """A model's field in the shipped weights' lineage card: RUN (run2, run3, heads, or a tried run), MODEL (drafter, xpress,
    markov_gated ...), PATH dotted into its record (heldout.tau_drafter, box.box_s, val_loss_per_epoch.2, steps)."""
    return _card_field(root, CARD, run, name, path, d)


@quantity("card_of")
def q_card_of(root, folder, run, name, path, d=3):
    """The same field in the card.json under FOLDER (relative to the repository): the card of weights shipped
    before, kept beside their tables (results/smollm2-135m-v2/training)."""
    return _card_field(root, f"{folder}/card.json", run, name, path, d)


def _card_field(root, card: str, run, name, path, d):
    rec = _json(root / card)  # the lineage's runs, then those tried on its weights and not shipped (--tried)
    lineage = {r["name"]: r["card"] for r in rec["lineage"] + rec.get("tried", [])}
    if run not in lineage:
        raise UsageError(f"readme_numbers: {card} has no run {run!r} (runs: {', '.join(lineage)})")
    rec = next((m for m in lineage[run]["models"] if m["model"] == name), None)
    if rec is None:
        raise UsageError(f"readme_numbers: run {run!r} of {card} has no model {name!r}")
    for k in path.split("."):
        rec = rec[int(k)] if isinstance(rec, list) else rec[k]
    return str(rec) if isinstance(rec, int) else fmt(rec, d)


# --- AR's text in two runs (samples.jsonl.gz) ----------------------------------------------------------------------
def _ar_texts(root, folder: str) -> dict:
    from harness.protocol.results_io import read_folder_rows
    out: dict = {}
    for r in read_folder_rows(run_dir(root, folder)):
        if r["arm"] == "AR" and r["turn"] == 0:
            out.setdefault(r["dataset_row"], []).append(r["tokens"])
    return out


@quantity("ar_self")
def q_ar_self(root, a, b, sep="/"):
    """AR's greedy text in two runs of the same prompts (two processes, maybe other token caps): prompts both ran
    whose every AR row of one equals every AR row of the other through the shorter text, over the prompts both
    ran ("7/7")."""
    ta, tb = _ar_texts(root, a), _ar_texts(root, b)
    common = sorted(set(ta) & set(tb))

    def same(x, y):
        n = min(len(x), len(y))
        return x[:n] == y[:n]
    k = sum(all(same(x, y) for x in ta[q] for y in tb[q]) for q in common)
    return f"{k}{' of ' if sep == 'of' else sep}{len(common)}"



# --- sweeps (results/sweeps/NAME/: sweep.json, and the step breakdown from samples.jsonl.gz) ---------------------
def _sweep_entry(root, folder: str, b: str, c: str, a: str) -> dict:
    for p in _json(root / "results/sweeps" / folder / "sweep.json")["points"]:
        if p["batch_size"] == int(b) and p["context_len"] == int(c):
            if arm_name(a) not in p["arms"]:
                raise UsageError(f"readme_numbers: sweep {folder} has no arm {arm_name(a)!r}")
            return p["arms"][arm_name(a)]
    raise UsageError(f"readme_numbers: sweep {folder} has no point B={b}, context={c}")


@quantity("sweep")
def q_sweep(root, folder, b, c, a, field, d=2):
    """A sweep point's FIELD (speedup, tau, total_tok_s, ...; `lo`/`hi`: the speedup CI's ends) of ARM at B and
    context C: results/sweeps/FOLDER/sweep.json."""
    e = _sweep_entry(root, folder, b, c, a)
    key = "speedup_ci" if field in ("lo", "hi") else field
    if e.get(key) is None:
        raise UsageError(f"readme_numbers: sweep {folder} B={b} C={c} {a} has no {key} (the reference arm has no "
                         "speedup); fix the marker")
    v = e[key][0 if field == "lo" else 1] if key == "speedup_ci" else e[key]
    return fmt(v, d)


@quantity("run_step_ms")
def q_run_step_ms(root, folder, a, d=2):
    """A run folder's decode ms per step of ARM (summary.json's step_s: decode seconds over verify steps)."""
    return fmt(1e3 * arm(root, folder, a)["step_s"], d)


@quantity("bench_wall")
def q_bench_wall(root, path, a, d=2):
    """A bench_step JSON's (results/perf/PATH.json) wall ms per graphed step of ARM, host included."""
    folder, name = path.rsplit("/", 1) if "/" in path else ("", path)
    return fmt(bench_arm(root, name, a, f"results/perf/{folder}".rstrip("/"))["graph"]["wall_per_step_ms"], d)


@quantity("json")
def q_json(root, path, *key_d):
    """One number of a committed JSON file (PATH from the repository's root), at KEY (dotted: `a.b`, a list
    index as a number), then D, the decimals (default 2). A key holding colons (`bench:gsm8k.tau_drafter`) arrives
    split at them and is joined again; a last part of digits alone is D, so a key whose last colon part is digits
    (`a:0`) needs D after it (`json:P:a:0:2`)."""
    parts = [str(x) for x in key_d]
    has_d = len(parts) > 1 and parts[-1].isdigit()
    d, key = (int(parts[-1]) if has_d else 2), ":".join(parts[:-1] if has_d else parts)
    value = _json(root / path)
    for k in key.split("."):
        try:
            value = value[int(k)] if isinstance(value, list) else value[k]
        except (KeyError, IndexError, ValueError):
            raise UsageError(f"readme_numbers: {path} has no {key!r} (at {k!r})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"readme_numbers: {path}'s {key!r} is not a number")
    return fmt(value, d)


@quantity("bench_batch")
def q_bench_batch(root, path, b, c, w, field, d=2):
    """A bench_batch JSON's (results/perf/PATH.json) FIELD (ms, floor_ms, ratio) of the step of width W (1: the
    batched AR step, else the verify) at batch size B and context C."""
    rows = [r for r in _json(root / "results/perf" / f"{path}.json")["rows"]
            if (r["batch"], r["context"], r["width"]) == (int(b), int(c), int(w))]
    if len(rows) != 1:
        raise UsageError(f"readme_numbers: results/perf/{path}.json has {len(rows)} rows at B={b}, C={c}, W={w}")
    return fmt(rows[0][field], d)


@quantity("sweep_same")
def q_sweep_same(root, folder, b, c, a):
    """A sweep point's `same as B=1` count of ARM ("35/80"): requests whose T=0 tokens equal the arm's B=1 ones."""
    e = _sweep_entry(root, folder, b, c, a)["same_as_b1"]
    return f"{e['equal']}/{e['of']}"


@quantity("sweep_step")
def q_sweep_step(root, folder, b, c, a, field, d=2):
    """The step breakdown's FIELD (ms_per_step, tokens_per_step, step_cost, token_gain) of ARM at B and context C,
    recomputed from results/sweeps/FOLDER/samples.jsonl.gz (harness.protocol.sweep_steps)."""
    entry = _sweep_steps(root, folder).get((int(b), int(c), arm_name(a)))
    if entry is None:
        raise UsageError(f"readme_numbers: sweep {folder} has no step entry for {arm_name(a)!r} at B={b}, C={c}")
    return fmt(entry[field], d)


def clear_caches() -> None:
    """Before a check or a write: the files are read anew (one may have changed since the last check in this
    process): the JSON files and the sweeps' step breakdowns, each cached while one check quotes it many times."""
    from harness.lab import readme_numbers_keys
    readme_numbers_keys._json.cache_clear()
    _sweep_steps.cache_clear()


@lru_cache(maxsize=None)  # a sweep's steps are quoted many times and folders alternate (8 re-read rows 43 times)
def _sweep_steps(root, folder: str) -> dict:
    from harness.protocol import sweep_steps
    from harness.protocol.results_io import read_folder_rows
    summary = _json(root / "results/sweeps" / folder / "sweep.json")
    rows = read_folder_rows(root / "results/sweeps" / folder)
    return {(e["batch_size"], e["context_len"], e["arm"]): e
            for e in sweep_steps.breakdown(rows, summary["arms"], summary["reference"])}
