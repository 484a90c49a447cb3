"""Stage 4, train: each configured model with speculators (its model classes, losses, data loader and Trainer),
in dependency order (a model with `init_from` starts from that drafter's final weights; with `freeze_backbone`
only its head trains, so every arm shares one drafter and one set of drafter weights ships).

Checkpoints: <workdir>/train/<model>/<epoch>/ (speculators' layout) plus a fingerprint of what trained them; a
run resumes from the latest one, and one from another config is refused before anything is loaded or written."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from core.errors import UsageError
from training import compiling
from training.anchors import AnchorBias, installed
from training.config import model_fingerprint, train_order
from training.hidden import out_dir as hidden_dir
from training.store import read_manifest, write_json
from training.trainer import FINGERPRINT, MetricsFile, PipelineTrainer, StopRequested


def model_dir(cfg: dict, name: str) -> Path:
    return Path(cfg["workdir"]) / "train" / name


def final_dir(cfg: dict, name: str) -> Path | None:
    d = model_dir(cfg, name)
    m = read_manifest(d)
    return d / m["final"] if m and m.get("complete") and m.get("key") == model_fingerprint(cfg, name) else None


def device_of(cfg: dict) -> torch.device:
    from training.target import target_device
    return target_device(cfg)


def check_resume(cfg: dict, name: str) -> None:
    """A checkpoint directory trained with another fingerprint is refused (nothing is overwritten)."""
    d = model_dir(cfg, name)
    f = d / FINGERPRINT
    has_ckpt = d.is_dir() and any(p.is_dir() and p.name.isdigit() for p in d.iterdir())
    if not has_ckpt:
        return
    found = json.loads(f.read_text()).get("key") if f.is_file() else None
    if found != model_fingerprint(cfg, name):
        raise UsageError(f"train: {d} holds checkpoints of another config (fingerprint {found}, this config "
                         f"{model_fingerprint(cfg, name)}); resuming from them would mix two runs. Use another "
                         "--workdir or delete that directory")


def check_target_fit(cfg: dict, name: str, tcfg) -> None:
    m = cfg["models"][name]
    n = tcfg.num_hidden_layers
    if m["num_layers"] > n:
        raise UsageError(f"config models.{name}: num_layers {m['num_layers']} exceeds the target's {n} layers")
    mask = cfg["train"].get("mask_token_id")
    if mask is not None and not 0 <= mask < tcfg.vocab_size:
        raise UsageError(f"config train.mask_token_id {mask} is outside the target vocab ({tcfg.vocab_size})")


def build_model(cfg: dict, name: str, verifier: str, layer_ids: list[int], attn_impl: str):
    from speculators.model import SpeculatorModel
    from speculators.train.cli import create_transformer_layer_config
    m = cfg["models"][name]
    tl = create_transformer_layer_config(verifier, m["num_layers"], "qwen3", None, 4096,
                                         list(range(m["num_layers"])))
    if m["intermediate_size"]:
        tl.intermediate_size = m["intermediate_size"]
    kwargs = dict(verifier_name_or_path=verifier, target_layer_ids=layer_ids, block_size=m["block_size"],
                  draft_vocab_size=tl.vocab_size, mask_token_id=cfg["train"].get("mask_token_id", tl.vocab_size - 1),
                  sample_from_anchor=False, draft_attn_impl=attn_impl)
    if m["type"] == "xpress":
        kwargs.update(xpress_rank=m["xpress_rank"], xpress_mlp_ratio=m["xpress_mlp_ratio"],
                      num_jacobi_passes=m["num_jacobi_passes"])
    elif m["type"] == "dspark":
        kwargs.update(markov_rank=m["markov_rank"], markov_head_type=m["markov_head_type"],
                      enable_confidence_head=m["enable_confidence_head"])
    if kwargs["mask_token_id"] is None:
        kwargs["mask_token_id"] = tl.vocab_size - 1
    model = SpeculatorModel.registry[m["type"]].from_training_args(tl, **kwargs)
    if m["init_from"]:
        state = init_state(cfg, name, layer_ids)
        own = model.state_dict()
        if m["grow"]:  # the source's tensors in a larger model that computes what it did (training/grow.py)
            from training.grow import grown
            from training.config import init_export
            from training.grow import folder_taps
            taps = folder_taps(init_export(cfg, name)) or list(layer_ids)
            state, model.grown_from = grown(state, own, f"models.{name}", (taps, list(layer_ids)))
        bad = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
        if bad:
            k = bad[0]
            raise UsageError(f"models.{name}: {m['init_from']}'s tensor {k} {tuple(state[k].shape)} does not fit "
                             f"this model ({tuple(own[k].shape) if k in own else 'no such tensor'})")
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
        if m["freeze_backbone"]:
            for k, p in model.named_parameters():
                if k in state:
                    p.requires_grad_(False)
    return model


def init_state(cfg: dict, name: str, layer_ids: list[int]) -> dict:
    """The drafter a model starts from: a model of this config that finished training, or an exported drafter
    folder (bf16 shards as the export stage or training.ship wrote them; its taps must be the hidden stage's)."""
    from training.config import init_export
    m, d = cfg["models"][name], init_export(cfg, name)
    if d is None:
        src = final_dir(cfg, m["init_from"])
        if src is None:
            raise UsageError(f"models.{name}: init_from {m['init_from']!r} has not finished training")
        from safetensors.torch import load_file
        return load_file(str(src / "model.safetensors"))
    from core.checkpoints import read_tensors, shard_files
    from training.grow import check_taps, folder_taps
    check_taps(f"models.{name}", m, folder_taps(d), list(layer_ids), str(d), "the hidden stage wrote")
    return read_tensors(shard_files(d, f"models.{name}.init_from"))


def loss_impl(tc: dict, device: torch.device) -> str:
    """train.loss_impl resolved: auto is speculators' fused Triton losses on CUDA (no [tokens, vocab] fp32
    intermediates) and its eager ones elsewhere."""
    if tc["loss_impl"] == "auto":
        return "fused" if device.type == "cuda" else "eager"
    if tc["loss_impl"] == "fused" and device.type != "cuda":
        raise UsageError(f"config train.loss_impl fused runs on CUDA only, and this run trains on {device.type}; "
                         "use eager or auto")
    return tc["loss_impl"]


def trainer_kwargs(m: dict, impl: str = "eager") -> dict:
    base = dict(loss_fn=m["loss_fn"], loss_implementation=impl, dflash_decay_gamma=m["gamma"],
                max_anchors=m["max_anchors"], per_position_loss_weight=m["per_position_loss_weight"],
                dpace_alpha=m["dpace_alpha"])
    if m["type"] == "xpress":
        base.update(consistency_weight=m["consistency_weight"], consistency_passes=m["consistency_passes"],
                    base_anchor_weight=0.0 if m["freeze_backbone"] else m["base_anchor_weight"])
    return base


def make_loaders(cfg: dict, verifier: str, hm: dict, dtype: torch.dtype):
    """speculators' train/val loaders over the hidden stage's output; online: token ids only (training/online.py).
    Validation is bounded to train.val_batches packed batches (0: the whole val split)."""
    from speculators.train.dataloader import create_train_val_loaders
    from training.online import IdsOnly
    from training.rows import Rows, install
    tc = cfg["train"]
    data = str(hidden_dir(cfg))
    rows = Rows.load(data) if tc["rows_in_memory"] else None
    transfer = IdsOnly(data, len(hm["layer_ids"]), rows) if hm.get("mode") == "online" else None
    train_loader, val_loader = create_train_val_loaders(
        data_path=data, total_seq_len=tc["total_seq_len"], hidden_states_dtype=dtype, transfer=transfer,
        vllm_endpoint="http://unused", on_missing="raise", verifier_name_or_path=verifier, request_timeout=None,
        max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=hm["hidden_size"], num_target_layers=len(hm["layer_ids"]), num_workers=tc["num_workers"],
        prefetch_factor=2, preprocess=None, train_data_ratio=tc["train_ratio"], seed=cfg["seed"])
    val_loader.batch_sampler.max_batches = tc["val_batches"] or None  # speculators 0.9.0's sampler bound
    if rows is not None:  # every row from memory, not three formatted reads of the arrow table (training/rows.py)
        install(train_loader, rows)
        install(val_loader, rows)
    if transfer is not None:  # online: each batch carries its sequence lengths, so the taps never read the device
        from training.online import carry_lengths
        carry_lengths(train_loader)
        carry_lengths(val_loader)
    return train_loader, val_loader


def train_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _setup(cfg: dict, name: str, verifier: str, held_out, max_seconds: float, box, taps):
    from speculators.model import SpeculatorModel
    from speculators.train.trainer import TrainerConfig
    from training import warm
    m, tc = cfg["models"][name], cfg["train"]
    check_resume(cfg, name)
    device = device_of(cfg)
    attn = tc["attn_impl"] if tc["attn_impl"] != "auto" else ("simple_flex_attention" if device.type == "cuda"
                                                                else "eager")
    hm = read_manifest(hidden_dir(cfg))
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg, name, verifier, hm["layer_ids"], attn)
    mode = compiling.apply(model, tc["compile"], device.type, tc["flex_kernel_options"])
    if device.type == "cuda":
        print(f"train {name}: torch.compile covers {mode} (train.compile={tc['compile']})")
    src = warm.source(cfg, name)
    warm_step = warm.load(model, src, name) if src is not None else 0
    if taps is not None:
        model.register_forward_pre_hook(taps, with_kwargs=True)
    bias = None
    if m["anchor_bias"]:  # after the taps' hook, whose verifier states it reads (training/anchors.py)
        bias = AnchorBias(m["anchor_bias"])
        model.register_forward_pre_hook(bias, with_kwargs=True)
    dtype = train_dtype(device)
    train_loader, val_loader = make_loaders(cfg, verifier, hm, dtype)
    cls = SpeculatorModel.registry[m["type"]]
    impl = loss_impl(tc, device)
    train_kw, val_kw = cls.get_trainer_kwargs(**trainer_kwargs(m, impl))
    if device.type == "cuda":
        print(f"train {name}: speculators' {impl} losses (train.loss_impl={tc['loss_impl']})")
    steps_per_epoch = len(train_loader)
    epochs = m["epochs"] or tc["epochs"]
    extend = tc["warm_mode"] != "resume" and warm_step > 0
    # the steps where this data's epoch 0 and the LR schedule began: extend, the warm step (data); restart, both;
    # resume, the warmed run's own, so that a cut run continues where it was in its data and schedule
    data_start, schedule_start = warm.starts(tc["warm_mode"], warm_step, src)
    total = m["max_steps"] or data_start + epochs * steps_per_epoch
    if warm_step >= total:
        raise UsageError(f"train.warm_start: {src} is at step {warm_step}, the end of this run's {total} steps; "
                         "nothing is left to train (" + ("train.max_steps counts from step 0: raise it" if extend else
                                                         "raise train.epochs, set train.warm_mode=extend for fresh "
                                                         "data, or train from scratch") + ")")
    save_every = tc["save_every"]
    out = model_dir(cfg, name)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / FINGERPRINT, {"key": model_fingerprint(cfg, name)})
    # speculators 0.9.0 runs every epoch of num_epochs past max_steps (each a step, a validation and a checkpoint more)
    tconf = TrainerConfig(lr=m["lr"] or tc["lr"], num_epochs=min(epochs, -(-(total - data_start) // steps_per_epoch)),
                          save_path=str(out), resume_from_checkpoint=True,
                          train_call_kwargs=train_kw, val_call_kwargs=val_kw, weight_decay=tc["weight_decay"],
                          scheduler_type=tc["scheduler"], scheduler_warmup_ratio=tc["warmup_ratio"],
                          scheduler_total_steps=total, checkpoint_freq=min(1.0, save_every / steps_per_epoch)
                          if save_every else 1, hidden_states_dtype=dtype, log_freq=tc["log_every"],
                          max_steps=m["max_steps"])
    trainer = PipelineTrainer(model, tconf, train_loader, val_loader, device=device, seed=cfg["seed"],
                              eval_fn=held_out, eval_every=tc["eval_every"], stop_after_step=tc["stop_after_step"],
                              metrics_file=out / "metrics.jsonl", max_seconds=max_seconds, box=box,
                              eval_max_seconds=tc["eval_max_seconds"], eval_share=tc["eval_share"],
                              warm_step=warm_step, data_start=data_start, schedule_start=schedule_start,
                              backbone_lr_scale=m["backbone_lr_scale"],
                              fit=fit_plan(tc, total), cut_at_step=tc["cut_at_step"], profile=_profile(tc, out, device))
    trainer.compile_mode, trainer.loss_impl, trainer.anchor_bias = mode, impl, bias
    trainer.flex_options = model.xb_flex_kernel_options  # None where our compiled flex attention is not in place
    trainer.grown_from = getattr(model, "grown_from", None)
    if trainer.grown_from:
        print(f"train {name}: grown from {m['init_from']}: layers {trainer.grown_from['num_layers']}, MLP width "
              f"{trainer.grown_from['intermediate_size'] or 'unchanged'} (training/grow.py)")
    if trainer.warm_started:
        print(f"train {name}: warm start from {src} at step {warm_step} of {total} (fresh optimizer"
              + (f"; {epochs} epochs of this data after it, train.warm_mode={tc['warm_mode']})" if extend else ")"))
    return trainer, total, out


def _profile(tc: dict, out: Path, device: torch.device):
    from training.profiling import StepProfile
    # before the fit's probe, which starts after it (PipelineTrainer._fit_probe): never inside the timed probe, and
    # its time is spent before the fit measures what the box has left; train.profile_start steps after the
    # process's first, so the compile's warm-up is not what it measures
    return StepProfile(out / "profile.json", tc["profile_steps"], device, tc["profile_start"]) \
        if tc["profile_steps"] else None


def fit_plan(tc: dict, total: int) -> dict | None:
    """train.fit_box's probe (training/fit.py), or None."""
    if not tc["fit_box"]:
        return None
    return {"probe": tc["fit_probe_steps"], "reserve": tc["fit_reserve"],
            "planned": total, "warmup_ratio": tc["warmup_ratio"]}


def train_one(cfg: dict, name: str, verifier: str, held_out, max_seconds: float = 0.0, taps=None,
              started: float | None = None) -> Path | None:
    from training.box import FILE, Box, earlier_boxes, write
    tc = cfg["train"]
    key = model_fingerprint(cfg, name)
    if final_dir(cfg, name) is not None:
        print(f"train {name}: up to date ({final_dir(cfg, name)})")
        return final_dir(cfg, name)
    box = Box(device_of(cfg), started)
    with box.timed("startup"):
        trainer, total, out = _setup(cfg, name, verifier, held_out, max_seconds, box, taps)
    handler = MetricsFile(out / "metrics.jsonl")
    mlog = logging.getLogger("speculators.metrics")
    mlog.addHandler(handler)
    mlog.setLevel(logging.INFO)
    start_step = trainer.global_step
    earlier = earlier_boxes(out / FILE, key, start_step)

    def record(status: str) -> dict:  # this process's box, after the earlier processes' it continued
        return box.record({"key": key, "status": status, "first_step": start_step, "last_step": trainer.global_step,
                           "box_s": max_seconds or None, "hidden_mode": cfg["hidden"]["mode"],
                           "total_seq_len": tc["total_seq_len"], "compile": trainer.compile_mode,
                           "flex_kernel_options": trainer.flex_options,
                           "loss_impl": trainer.loss_impl,
                           "profiled_steps": trainer.step_profile.profiled if trainer.step_profile else None,
                           "compile_target": getattr(taps, "compile", None),
                           "target_groups": getattr(taps, "groups", None),
                           "taps_cache": taps.cache.record() if taps is not None else None,
                           "anchor_bias": trainer.anchor_bias.record() if trainer.anchor_bias else None,
                           "fit": trainer.fit_record, **({"earlier": earlier} if earlier else {})})
    try:
        with installed(trainer.anchor_bias):
            trainer.run_training()
    except KeyboardInterrupt:  # what this process did is kept for the one that resumes it
        write(out / FILE, record("interrupted"), name)
        raise
    except StopRequested as stop:
        if trainer.fit_reached and not trainer.deadline_hit:
            print(f"train {name}: finished the plan fitted to the box at step {stop.args[0]} (of {total} planned "
                  "before the fit)")
        elif trainer.cut_hit:
            print(f"train {name}: train.cut_at_step reached at step {stop.args[0]} of {trainer.planned_steps or total}; "
                  "that checkpoint is the final model, exported with its step (a later session's train.warm_start "
                  "continues the schedule)")
        elif not (trainer.deadline_hit and tc["on_deadline"] == "finish"):
            print(f"train {name}: stopped after step {stop.args[0]} with a checkpoint; run again to resume")
            write(out / FILE, record("stopped"), name)
            return None
        else:
            print(f"train {name}: train.max_minutes reached at step {stop.args[0]} of {trainer.planned_steps or total};"
                  " that checkpoint is the final model (train.on_deadline=finish)")
    finally:
        mlog.removeHandler(handler)
    if held_out is not None:
        trainer.log_eval()
    with box.timed("finish"):
        last = max(int(p.name) for p in out.iterdir() if p.is_dir() and p.name.isdigit())
        write_json(out / "manifest.json", {"key": key, "complete": True, "final": str(last),
                                           "global_step": trainer.global_step,
                                           "planned_steps": trainer.planned_steps or total,
                                           "data_start": trainer.data_start,
                                           "schedule_start": trainer.schedule_start,
                                           "grown_from": trainer.grown_from,
                                           "truncated": trainer.deadline_hit, "evals": trainer.evals,
                                           "fit": trainer.fit_record})
    write(out / FILE, record("finished"), name)
    return out / str(last)


def online_taps(cfg: dict, load):
    """The forward pre-hook that computes the hidden states in the step (hidden.mode=online), else None."""
    from training.hidden import DTYPES, target_in_dtype
    from training.online import OnlineTaps, TapsCache
    hm = read_manifest(hidden_dir(cfg))
    if hm.get("mode") != "online":
        return None
    if load is None:
        raise UsageError("train: hidden.mode=online needs the target model (run through the pipeline)")
    from training.online import compile_layers, resolve_compile
    target = target_in_dtype(load()[0], DTYPES[cfg["hidden"]["target_dtype"]])
    taps = OnlineTaps(target, hm["layer_ids"], DTYPES[cfg["hidden"]["dtype"]], train_dtype(device_of(cfg)))
    taps.compile = resolve_compile(cfg["train"]["compile_target"], device_of(cfg).type)
    taps.groups = cfg["train"]["target_groups"]
    reserve = TapsCache.step_reserve([cfg["models"][n] for n in train_order(cfg)], target.config.vocab_size,
                                     train_dtype(device_of(cfg)))
    taps.cache = TapsCache(int(cfg["train"]["taps_cache_gib"] * 2**30), reserve)
    if taps.compile == "layers":  # 163 -> 40 ms a 32K-token row on the H200 (training/bench_taps.py)
        compile_layers(target)
        print(f"train: the online target's {len(target.model.layers)} decoder layers are compiled "
              f"(train.compile_target={cfg['train']['compile_target']})")
    return taps


def run(cfg: dict, verifier: str, held_out_factory=None, only: list[str] | None = None, load=None) -> dict:
    """`load`: the pipeline's target loader (hidden.mode=online runs the target in the training step)."""
    from training.target import target_config
    started = time.perf_counter()  # the stage's shared set-up counts in the first trained model's box
    tcfg = target_config(cfg["target"])
    names = [n for n in train_order(cfg) if not only or n in only]
    for n in names:  # every config and resume check before any training starts
        check_target_fit(cfg, n, tcfg)
        if final_dir(cfg, n) is None:
            check_resume(cfg, n)
    held = held_out_factory() if held_out_factory else None
    todo = [n for n in names if final_dir(cfg, n) is None]
    cc = cfg["train"]["compile_cache"] if todo else ""
    cache = compiling.load_cache(cc) if cc else None  # before anything compiles
    taps = online_taps(cfg, load) if todo else None
    budget = cfg["train"]["max_minutes"] * 60
    deadline = time.monotonic() + budget
    done, saved = {}, False  # saved: the cache file holds everything compiled so far
    try:
        for n in names:  # train.max_minutes bounds the whole stage: a model cut short resumes on the next run
            left = deadline - time.monotonic()
            if budget and left <= 0 and final_dir(cfg, n) is None:
                print(f"train: out of time (train.max_minutes={cfg['train']['max_minutes']}); run again to continue "
                      f"with {n}")
                break
            own = (cfg["models"][n]["max_minutes"] or 0) * 60  # a model's own box, inside the stage's
            box_s = min(left, own) if budget and own else (left if budget else own)
            saved = False
            done[n] = train_one(cfg, n, verifier, held, max(box_s, 1e-3) if box_s else 0.0, taps,
                                started if todo and n == todo[0] else None)
            if done[n] is None:
                break
            if cache is not None and n != names[-1]:  # before the next model: survives a job that dies later
                cache, saved = compiling.save_cache(cc, cache), True
    finally:
        if taps is not None:
            taps.close()
        if cache is not None:  # after the last model, or one that stopped or failed: its compiled graphs are kept
            cache = cache if saved else compiling.save_cache(cc, cache)
            write_json(Path(cfg["workdir"]) / "train" / "compile_cache.json", cache)
            print(f"train: compile cache {cc}: loaded {cache['loaded_bytes']} bytes, saved {cache['saved_bytes']}"
                  + (f" ({cache['note']})" if "note" in cache else ""), flush=True)
    return done
