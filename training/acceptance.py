"""Held-out acceptance with the harness's own decode loop (harness.decode.loop.generate): a speculators model in
memory is turned into the harness's drafter and refiner (the same name mapping the checkpoint loaders use), and
greedy tau (tau/step, harness.protocol.metrics) is measured on held-out prompts for drafter-only and, when the
model has one, its Markov or xPress head. With `max_seconds` the drafter-only arm decodes prompts in order until its
share of the cap (1 / number of arms) is spent (one prompt at least), and every arm then uses those prompts. Each
result keeps every prompt's accepted tokens and steps per arm ("per_prompt", keyed by the prompt's ids), so two
results on the same prompts compare with a paired CI (training/compare_tau.py).

Which prompts: during training (periodic and final evaluations), the first `train.eval_prompts` of the selection
set (prompts/selection.jsonl); after training (training/evaluate.py), every final model on the whole selection set
and the whole held-out set. Every result names its set.

Sampled tau: `measure(..., temperatures=(1.0,))` also decodes every arm at each temperature T > 0 (target and drafts
at T, rejection-sampling verification: the harness's T>0 path) on the same prompts, as keys with a suffix
(`tau_drafter_T1`, `tau_xpress_K1_T0p7`: `temperature_suffix`). Prompt i draws from its own stream, seeded by
SAMPLED_SEED + i, so two models measured on the same prompts see the same random numbers, and their per-prompt counts
pair in training/compare_tau.py like the greedy ones. A greedy tau says nothing of how a drafter's whole
distribution overlaps the target's, which is what a sampled draft's acceptance is (the argmax-only `ce` loss can raise
the one and lower the other)."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import torch

from drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel
from core.devices import Backend
from harness.decode.loop import DecodeSettings, generate
from harness.decode.target import Target
from harness.protocol.metrics import tau_per_step
from refiners.markov import MarkovRefiner, markov_head_from_state
from core.speculators_layout import split_tensors, zlab_config
from refiners.xpress import XPressRefiner, xpress_head_from_state
from training.store import ids_digest


def speculators_config_dict(model) -> dict:
    return json.loads(model.config.to_json_string())


def harness_models(cfg_dict: dict, state: dict, backend: Backend, num_target_layers: int = 0):
    """(DFlashModel, refiner factory or None, kind) from a speculators config dict and state dict."""
    zl = zlab_config(cfg_dict, "model")
    zl["num_target_layers"] = zl["num_target_layers"] or num_target_layers
    dcfg = DFlashConfig.from_dict(zl, "model")
    drafter = DFlashModel(dcfg)
    want = dcfg.expected_shapes()
    drafter.load_state_dict({k: state[k].float() for k in want}, strict=True)
    drafter = drafter.to(device=backend.device, dtype=backend.dtype).eval()
    if cfg_dict["speculators_model_type"] == "dflash":
        return drafter, None, None
    kind, _, head, variant = split_tensors(cfg_dict, state, "model")
    head = {k: v.float() for k, v in head.items()}
    if kind == "xpress":
        h = xpress_head_from_state(head, mixer="raw", device=backend.device, dtype=backend.dtype)
        return drafter, (lambda k: XPressRefiner(h, k)), kind
    m = markov_head_from_state(head, variant, device=backend.device, dtype=backend.dtype)
    return drafter, (lambda k: MarkovRefiner(m)), kind


def acceptance_dtype(name: str, device: torch.device) -> torch.dtype:
    """acceptance.dtype: auto is bfloat16 on CUDA (as the harness's tables decode there), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class HeldOut:
    """Built once per training run: the target (harness Target over the HF model) and the held-out prompt ids."""

    def __init__(self, hf_model, prompts: list[list[int]], stops: list[int], backend: Backend,
                 max_new_tokens: int, k_list=(1,), use_graph: bool = False):
        self.hf, self.prompts, self.backend = hf_model, prompts, backend
        self.settings = DecodeSettings(max_new_tokens=max_new_tokens,
                                       max_model_len=max(len(p) for p in prompts) + max_new_tokens + 64,
                                       stop_ids=tuple(stops), use_graph=use_graph)
        self.k_list = tuple(k_list)
        self.target = Target(hf_model, backend, capacity=self.settings.max_model_len)

    def _lengths(self, prompt, drafter, refiner=None, settings=None, seed=None):
        gen = None if seed is None else self.backend.generator(seed)
        return generate(self.target, prompt, settings or self.settings, self.backend, drafter=drafter,
                        refiner=refiner, generator=gen).accept_lengths

    def _tau(self, prompts, drafter, refiner=None) -> float:
        return tau_per_step([self._lengths(p, drafter, refiner) for p in prompts])

    def _first_arm(self, prompts, drafter, seconds: float) -> list[list[int]]:
        """Drafter-only accept lengths of as many prompts (in order) as `seconds` allows (0: all)."""
        deadline, lengths = time.perf_counter() + seconds, []
        for p in prompts:
            lengths.append(self._lengths(p, drafter))
            if seconds and time.perf_counter() > deadline:
                break
        return lengths

    @torch.no_grad()
    def __call__(self, model, max_seconds: float = 0.0) -> dict:
        cfg = speculators_config_dict(model)
        return self.measure(cfg, {k: v.detach() for k, v in model.state_dict().items()}, max_seconds)

    @torch.no_grad()
    def measure(self, cfg: dict, state: dict, max_seconds: float = 0.0, prompts=None, groups=None,
                temperatures=()) -> dict:
        """tau of a speculators config dict + state dict on `prompts` (default: the ones given at construction;
        each must fit the capacity those set). `groups`: one name per prompt (its source); the result then has
        each group's pooled tau under "by_source". `temperatures`: each T > 0 measured too (the module's
        docstring), on the prompts the greedy drafter arm reached within its share of the cap, which they leave as
        it was: the greedy records are those of a run without them, and a capped set takes up to about
        (1 + len(temperatures)) times its cap."""
        prompts = self.prompts if prompts is None else prompts
        dmodel, make, kind = harness_models(cfg, state, self.backend, self.hf.config.num_hidden_layers)
        self.target.set_taps(dmodel.config.target_layer_ids)
        drafter = DFlashDrafter(dmodel, self.target.embed, self.target.lm_head, self.backend)
        heads = {"markov": {"tau_markov": 0}, "xpress": {f"tau_xpress_K{k}": k for k in self.k_list}}.get(kind, {})
        per_arm = {"tau_drafter": self._first_arm(prompts, drafter, max_seconds / (1 + len(heads)))}
        n = len(per_arm["tau_drafter"])
        for arm, k in heads.items():
            per_arm[arm] = [self._lengths(p, drafter, make(k)) for p in prompts[:n]]
        for t in temperatures:
            sampled, sfx = replace(self.settings, temperature=float(t)), temperature_suffix(t)
            for arm, k in {"tau_drafter": None, **heads}.items():
                per_arm[arm + sfx] = [self._lengths(p, drafter, None if k is None else make(k), sampled,
                                                    SAMPLED_SEED + i) for i, p in enumerate(prompts[:n])]
        out = {**{arm: tau_per_step(v) for arm, v in per_arm.items()}, "prompts": n,
               "per_prompt": per_prompt(per_arm, prompts[:n])}
        if groups is not None:
            out["by_source"] = by_group(per_arm, list(groups)[:n])
        return out


SAMPLED_SEED = 1234  # prompt i of a sampled measurement draws from the stream seeded SAMPLED_SEED + i


def temperature_suffix(t: float) -> str:
    """The tau keys' suffix at a sampling temperature: 1 -> "_T1", 0.7 -> "_T0p7" (letters, digits and _ only,
    so `FILE:tau_drafter_T0p7` names an arm in training/compare_tau.py)."""
    return "_T" + f"{float(t):g}".replace(".", "p").replace("-", "m")


def prompt_key(ids) -> str:
    """8 hex digits of a prompt's token ids (training.store.ids_digest): which prompt a record is of."""
    return ids_digest(ids, 4).hex()


def per_prompt(per_arm: dict, prompts) -> dict:
    """{"keys": each prompt's prompt_key, arm: [[accepted tokens summed, steps], ...] per prompt}: what pairs two
    records prompt by prompt (training/compare_tau.py); each arm's tau is its tokens summed over its steps summed."""
    return {"keys": [prompt_key(p) for p in prompts],
            **{arm: [[int(sum(v)), len(v)] for v in lengths] for arm, lengths in per_arm.items()}}


def by_group(per_arm: dict, groups: list[str]) -> dict:
    """{group: {"prompts": n, arm: tau pooled over that group's prompts}} (tau_per_step over the group's steps)."""
    out = {}
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        out[g] = {"prompts": len(idx), **{arm: tau_per_step([v[i] for i in idx]) for arm, v in per_arm.items()}}
    return out


class SetEval:
    """The trainer's evaluation (periodic and final): the first prompts of the selection set, tagged with it."""

    def __init__(self, held: HeldOut, name: str, of: int):
        self.held, self.name, self.of = held, name, of

    def __call__(self, model, max_seconds: float = 0.0) -> dict:
        return {"set": self.name, "of": self.of, **self.held(model, max_seconds)}
