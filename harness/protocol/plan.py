"""The run plan: a RunConfig resolved once, before any weights load, into everything the run reads.

`RunPlan` is frozen and made once (harness.protocol.build.prepare, called by the runner with this rank's device,
the results folder and the resume folder): the backend, the checked configs and refiner checkpoints, K and C as
the Spyre contract resolved them, the arms, the rounds, the block and the context limit. The runner, the arms'
builders and the report read it; nothing replaces the run config afterwards (config.json keeps the settings as
given at the top level and the plan's resolved values under "resolved").

Also here: the results folder of a run (`run_folder`), the check that a resumed run keeps its settings
(`check_resume`), and the record of every resume in the folder (`record_resume`, resumes.json).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass
from typing import Mapping

from core.errors import UsageError
from harness.protocol.config import RunConfig
from harness.protocol.results_io import atomic_write, rows_file
from harness.protocol.rounds import complete_rounds

# Flags that may differ between an interrupted run and its --resume.
RESUME_FREE = ("resume", "run_id", "results_dir", "answer_file", "trace", "explain", "reference_dtype",
               "given", "quiet")  # given: which flags were typed
RESUMES = "resumes.json"
# Flags added after runs were made: a config.json without one ran with its value here (so --resume still matches).
ADDED_LATER = {"batch_invariant": False, "batch_sizes": None, "context_lengths": None, "refill": False}


@dataclass(frozen=True)
class ArmSpec:
    name: str
    method: str               # ar | drafter-only | markov | xpress
    K: int | None = None
    weights: str | None = None  # None: the base drafter; else the refiner kind whose co-trained drafter it uses


@dataclass(frozen=True)
class RunPlan:
    config: RunConfig                 # the settings as given (typed, resumed or from a setup); never replaced
    backend: object                   # core.devices.Backend: device and dtype
    target_config: object
    draft_config: object | None       # DFlashConfig (None: AR only, or random weights)
    block_size: int
    max_model_len: int
    refiners: Mapping[str, object]    # kind -> RefinerCheckpoint
    arms: tuple[ArmSpec, ...]
    rounds: int
    warmup_rounds: int
    passes: int                       # K outside the paired protocol (--device spyre: as its contract resolved it)
    topc: int                         # C, the xPress shortlist (--device spyre: min(C, V) as resolved)
    rotation_note: str | None = None
    draft_path: str | None = None     # the drafter's local directory (a hub id resolved to the HF cache)
    spyre: object | None = None       # harness.protocol.spyre_contract.SpyrePlan on --device spyre
    device: str | None = None         # this rank's --device (cuda:LOCAL_RANK under a launcher)
    folder: str | None = None         # the results folder (None: a plan made without one, e.g. a check)
    resume: str | None = None         # the folder this run continues (--resume, or a restarted torchrun group)

    @property
    def k_list(self) -> list[int]:
        """xPress K values as arms: --fair-k-list, else the resolved K."""
        return self.config.k_list if self.config.fair_k_list is not None else [self.passes]

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    @property
    def run_id(self) -> str:
        return os.path.basename(os.path.normpath(self.folder))

    def resolved(self) -> dict:
        """The plan's own values for config.json's "resolved" section (the runner adds what loading found)."""
        return {"block_size": self.block_size, "max_model_len": self.max_model_len, "rounds": self.rounds,
                "warmup_rounds": self.warmup_rounds, "arms": self.arm_names, "device": str(self.backend.device),
                "dtype": str(self.backend.dtype).removeprefix("torch."), "target": target_source(self.config),
                # the K each xPress arm ran; xpress_refine_passes only where no --fair-k-list replaced it
                "xpress_ks": [a.K for a in self.arms if a.method == "xpress"],
                "xpress_refine_passes": self.passes if self.config.fair_k_list is None else None,
                "xpress_topc": self.topc,
                "draft_temperature": self.config.draft_temperature_used,
                "refiners": {k: {"source": c.source, "step": c.step, "rank": c.rank, "mixer": c.mixer,
                                 "variant": c.variant} for k, c in self.refiners.items()},
                "trained_block_size": self.draft_config.block_size if self.draft_config else None,
                "weights": self.weights, **invariant_record(self.config)}

    @functools.cached_property
    def weights(self) -> dict:
        """The drafter's and refiners' digests (harness.protocol.assets.weights_digest: None where not local), so a
        folder says which weights it measured whatever path they were carried to; hashed once a process (a resume
        checks them before config.json records them). The target is named by its source (a GGUF is sha256-checked
        when fetched); hashing a 16 GB target would cost seconds a run."""
        from harness.protocol.assets import weights_digest
        if self.config.random_weights:  # every model built from the preset's config with fixed seeds
            return {"random_weights": self.config.random_weights}
        return {"drafter": weights_digest(self.draft_path),
                **{k: weights_digest(c.source) for k, c in self.refiners.items()}}


def invariant_record(cfg: RunConfig) -> dict:
    """--batch-invariant only: whether a GPU run has verified the batch-invariant kernels
    (core.kernels.invariant.VERIFIED_ON_GPU: its date and commit, None while none has), for config.json."""
    if not cfg.batch_invariant:
        return {}
    from core.kernels.invariant import VERIFIED_ON_GPU
    return {"batch_invariant_verified_on_gpu": VERIFIED_ON_GPU}


def target_source(cfg: RunConfig) -> dict:
    """Where the target's weights come from: the path or hub id, and the quantization a .gguf file stored them in
    (de-quantized to the run dtype on load); random weights name their config."""
    if cfg.random_weights:
        return {"source": f"random {cfg.random_weights}", "quantization": None}
    from harness.decode.gguf_cache import quantization
    return {"source": cfg.model_name_or_path, "quantization": quantization(cfg.model_name_or_path)}


def run_folder(cfg: RunConfig, resume: str | None = None) -> str:
    """The results folder: the resumed one, --run-id's, or a new dataset_T<temperature>_<time> one."""
    if resume:
        return resume
    taken = lambda f: rows_file(f) is not None or os.path.exists(os.path.join(f, "config.json"))
    if cfg.run_id:
        folder = os.path.join(cfg.results_dir, cfg.run_id)
        if taken(folder):
            if cfg.batch_sizes or cfg.context_lengths or _holds_sweep(folder):
                raise UsageError(f"{folder} already holds a sweep (finished or interrupted), and a sweep cannot be resumed: "
                                 f"delete {folder} to run it again, or pick another --run-id")
            raise UsageError(f"{folder} already holds a run; pass --resume {folder} to continue it, or a new --run-id")
        return folder
    base = os.path.join(cfg.results_dir, f"{cfg.dataset}_T{cfg.temperature:g}_{time.strftime('%Y%m%d-%H%M%S')}")
    folder, n = base, 1
    while taken(folder):
        n += 1
        folder = f"{base}-{n}"
    return folder


def check_run_folder(folder: str) -> None:
    """A single run's results folder, for the report (its tables, --rebuild): it exists and holds no sweep, whose
    rows pool batch sizes and contexts that a run's table would mix into one row an arm."""
    if not os.path.isdir(folder):
        raise UsageError(f"{folder}: not a results folder (no such directory)")
    if os.path.isfile(os.path.join(folder, "sweep.json")) or _holds_sweep(folder):
        raise UsageError(f"{folder}: a sweep's folder (--batch-sizes / --context-lengths); its tables are its own "
                         "sweep.md and steps.md, written when it ran; the report reads single runs")


def _holds_sweep(folder: str) -> bool:
    """The folder's config.json is a sweep's (--batch-sizes / --context-lengths), which --resume refuses."""
    try:
        saved = json.loads(open(os.path.join(folder, "config.json"), encoding="utf-8").read())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and bool(saved.get("batch_sizes") or saved.get("context_lengths"))


def check_resume(cfg: RunConfig, folder: str) -> None:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--resume {folder}: config.json is missing; is this a run folder?")
    saved = json.loads(open(path).read())
    now = dataclasses.asdict(cfg)
    diff = sorted(k for k in now if k not in RESUME_FREE and saved.get(k, ADDED_LATER.get(k)) != now[k])
    older = [k for k in diff if k not in saved and k not in ADDED_LATER]
    if older:  # not the user's flags: settings this version has and the folder's config.json never recorded
        names = ", ".join(f"--{k.replace('_', '-')}" for k in older[:4])
        raise UsageError(f"--resume {folder}: its config.json was written by an older version of the harness "
                         f"(it records no {names}), which this one cannot continue; start a new run")
    if diff:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in diff[:4])
        raise UsageError(f"--resume {folder}: the run was started with other settings ({flags}); drop those flags "
                         "(its config.json supplies every setting: --resume DIR alone continues it)")


def check_unfinished(plan: "RunPlan", folder: str, done: set, samples: list, mine: list, launched: bool,
                     provenance: dict) -> None:
    """--resume, before any model loads. Of other prompts than the run started with: refused (check_resume_prompts).
    Of a finished run (every (round, arm, prompt) decode in its rows and its summary.json written, which the run
    does last): nothing would run, and the run's records would be rewritten (env.json with this machine, the tables
    labelled resumed): refused. A run that stopped after its last decode but before its summary (the T=0 marks, the
    report) resumes, and finishes those. (A torchrun rank decides nothing alone: each rank's share, `mine`, is
    checked only in a single process.)"""
    if not plan.resume:
        return
    check_resume_prompts(folder, [s.row for s in samples], provenance)
    qids = [q for q, _ in mine]
    if launched or not os.path.isfile(os.path.join(folder, "summary.json")):
        return
    rounds = list(range(1, plan.rounds + 1))
    if qids and complete_rounds(done, rounds, plan.arm_names, qids) == rounds:
        raise UsageError(f"--resume {folder}: the run is finished (every decode in its rows, its summary.json "
                         f"written), so there is nothing to run; to rewrite its tables, python -m "
                         f"harness.protocol.report --rebuild {folder}")


def check_resume_prompts(folder: str, rows: list[int], now: dict) -> None:
    """--resume on other prompts than the run started with would put two prompt sets' rows in one table: refused
    when the dataset's sha256 differs from config.json's resolved.dataset (a local file edited, or an unpinned hub
    dataset that changed) or the rows chosen differ from its resolved.prompt_rows (the same file, another choice of
    rows: another harness version's subset). `now`: the dataset's provenance in this process (the one config.json
    records). A folder written before either was recorded is not checked for it."""
    saved = saved_resolved(folder)
    before = (saved.get("dataset") or {}).get("sha256")
    if before:
        if now.get("sha256") and now["sha256"] != before:
            what = (f"the dataset file {now['file']} changed since it started" if now["source"] == "local" else
                    f"the hub dataset {now['repo']} (revision {now['revision']}) changed since it started")
            raise UsageError(f"--resume {folder}: {what} (sha256 {now['sha256'][:12]}, not {before[:12]} as "
                             "config.json resolved.dataset records), so its tables would mix two prompt sets; put "
                             "that data back, or start a new run")
    planned = saved.get("prompt_rows")
    if planned is not None and list(planned) != rows:
        i = next((i for i, (a, b) in enumerate(zip(planned, rows)) if a != b), min(len(planned), len(rows)))
        raise UsageError(f"--resume {folder}: this harness picks {len(rows)} dataset row(s) for its prompts, the run "
                         f"planned {len(planned)} (config.json resolved.prompt_rows), first apart at question id {i} "
                         f"({rows[i] if i < len(rows) else 'none'} against "
                         f"{planned[i] if i < len(planned) else 'none'}), so its tables would mix two prompt sets; "
                         "resume it with the harness version that started it, or start a new run")


def check_room(plan: "RunPlan", samples, firsts) -> None:
    """A run with a speculative arm: every first turn leaves room for one speculative step, which the decode loop
    takes only while pos + block < the context limit (harness.decode.loop.generate; pos starts at the prompt's
    length). Without it every speculative arm decodes the prompt with plain target steps, and its speedup is no
    speculative decoding's. A later turn's prompt holds the replies before it: not known before decoding."""
    if plan.resume or all(a.method == "ar" for a in plan.arms):  # a resumed folder goes on as it started
        return
    from harness.decode.capture_plan import room_to_speculate  # the loops' rule (imports torch: only here)
    for qid, (sample, first) in enumerate(zip(samples, firsts)):
        if not room_to_speculate(len(first), plan.block_size, plan.max_model_len):
            need = len(first) + plan.block_size + 1  # the smallest limit at which it holds
            known = int(getattr(plan.target_config, "max_position_embeddings", 0) or 0)
            raise_it = (f"raise --max-model-len to {need} or more, or " if not known or need <= known else
                        f"the target has {known} positions, so ")  # above them the limit is refused (build.py)
            raise UsageError(f"prompt {qid} (dataset row {sample.row}) has {len(first)} tokens: with block "
                             f"{plan.block_size} a speculative step needs {need} positions, over the context limit "
                             f"{plan.max_model_len}, so no speculative arm would speculate; {raise_it}run fewer or "
                             "shorter prompts (--max-samples, another --dataset)")


def saved_resolved(folder: str) -> dict:
    """The "resolved" section of a run folder's config.json (what the run worked out: arms, weights, ...)."""
    return json.loads(open(os.path.join(folder, "config.json")).read()).get("resolved") or {}


def check_resume_weights(folder: str, now: dict) -> None:
    """--resume with other weights at the same paths would mix two models' rows in one table: refused when the
    folder recorded its weights (config.json resolved.weights; folders written before it did are not checked)."""
    saved = saved_resolved(folder).get("weights") or {}
    scheme = lambda d: (d or {}).get("scheme")  # noqa: E731  (digests of another recipe are not compared)
    diff = sorted(k for k in set(saved) | set(now) if scheme(saved.get(k)) == scheme(now.get(k))
                  and saved.get(k) != now.get(k))
    if diff:
        raise UsageError(f"--resume {folder}: the {', '.join(diff)} weights differ from those the run started with "
                         "(config.json resolved.weights); put those weights back, or start a new run")


def check_resume_arms(folder: str, now: list[str]) -> None:
    """--resume of a folder whose arms this version names otherwise (config.json resolved.arms; e.g. an older
    version's "drafter-only (co-trained)" for a refiner that carries no drafter of its own) would rerun those arms
    under the new names beside the old rows: refused, naming both lists."""
    saved = saved_resolved(folder).get("arms")
    if saved is not None and list(saved) != list(now):
        raise UsageError(f"--resume {folder}: this version plans the arms {', '.join(now)}, the run was started with "
                         f"{', '.join(saved)} (config.json resolved.arms); finish it with the version that started "
                         "it, or start a new run")


def record_resume(path: str, reused: int, total: int) -> dict:
    """Append this resume to the folder's resumes.json (a list, oldest first): when, and how many of the
    (round, arm, prompt) decodes it reused from the rows already written."""
    entry = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "time_unix": time.time(),
             "reused_decodes": reused, "total_decodes": total}
    try:
        before = json.loads(open(path, encoding="utf-8").read())
    except (FileNotFoundError, ValueError):
        before = []
    atomic_write(path, json.dumps((before if isinstance(before, list) else []) + [entry], indent=2) + "\n")
    return entry


def resume_count(folder: str) -> int:
    """How many times a folder's run was resumed with decodes already written (its resumes.json, or under torchrun
    each rank's resumes.rank{r}.json: the most of any rank; 0: never), so that its tables say some rounds ran in
    more than one process (harness.protocol.labels.config_labels)."""
    root, ext = os.path.splitext(RESUMES)
    names = [RESUMES] + (sorted(f for f in os.listdir(folder) if f.startswith(root + ".rank") and f.endswith(ext))
                         if os.path.isdir(folder) else [])
    counts = [0]
    for name in names:
        try:
            entries = json.loads(open(os.path.join(folder, name), encoding="utf-8").read())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            continue
        if isinstance(entries, list):  # a resume that reused every decode ran none: no round spans processes
            counts.append(sum(1 for e in entries if isinstance(e, dict) and e.get("reused_decodes") and
                              e.get("reused_decodes") != e.get("total_decodes")))
    return max(counts)
