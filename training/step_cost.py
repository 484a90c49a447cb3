"""Where a training step's host time goes, counted on the CPU (issue 26 item 3): `python -m training.step_cost`.

One step of `python -m training` at the real model shapes (SmolLM2-135M's config with random weights, the 5-layer
dflash drafter of training/configs/smollm2-gpu.json, hidden.mode=online), replayed call by call as speculators
0.9.0's `Trainer.train_epoch` makes them, with every aten op counted by a TorchDispatchMode and attributed to a
phase: the online target forward (OnlineTaps.compute), the drafter forward (its mask and anchors apart), the loss,
backward, clipping, the optimizer, speculators' loop and our glue (training/trainer.py's hooks, training/box.py).

Counted per op: all dispatched aten ops, those that are views (no kernel on a GPU), and the host-device syncs a
CUDA device would make: `.item()`/int()/bool() (`_local_scalar_dense`), data-dependent shapes (nonzero, boolean
mask indexing, bincount (a min and a max), repeat_interleave without output_size, unique, masked_select) and, at
the Python level, `.tolist()`/`.cpu()`. What a CPU run cannot see: blocking host-to-device copies
(`torch.tensor(list, device=cuda)`: a stream synchronisation each), named in the JSON from reading the code.

The CPU only counts: the kernels' own time on the H200 is not here. `dispatch_us` is this CPU's eager cost of one
small op, a lower bound on the host cost per launch (a CUDA launch adds the driver's few microseconds).
"""
from __future__ import annotations

import contextlib
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.errors import Parser, UsageError, cli_exit

NO_KERNEL = {"detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_strided", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_"}
DATA_DEPENDENT = {"_local_scalar_dense": 1, "nonzero": 1, "masked_select": 1, "bincount": 2, "_unique2": 1,
                  "unique_dim": 1, "unique_consecutive": 1, "equal": 1, "is_nonzero": 1, "nonzero_static": 0}


def sync_weight(func, args, kwargs) -> int:
    """How many host-device syncs this aten call makes on a CUDA device (0 for most)."""
    name = func._overloadpacket.__name__
    if name in DATA_DEPENDENT:
        return DATA_DEPENDENT[name]
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        return int(kwargs.get("output_size") is None)  # the output's length is the repeats' sum
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = args[1] if len(args) > 1 else []
        return int(any(i is not None and i.dtype == torch.bool for i in idx))
    return 0


class StepCounter(TorchDispatchMode):
    """aten ops and would-be syncs by phase (`with counter.phase(name)`); Python-level host reads patched in."""

    def __init__(self, host: tuple[torch.Tensor, ...] = ()):
        """`host`: tensors that stay on the host in a CUDA run (AdamW's step counts): reading them is no sync."""
        super().__init__()
        self.host = {t.data_ptr() for t in host}
        self.host_reads: Counter = Counter()
        self.ops: dict[str, Counter] = defaultdict(Counter)
        self.views: Counter = Counter()
        self.syncs: dict[str, Counter] = defaultdict(Counter)
        self.stack = ["unattributed"]
        self._saved = {}

    @property
    def current(self) -> str:
        return self.stack[-1]

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        self.ops[self.current][name] += 1
        if func.is_view or name in NO_KERNEL:
            self.views[self.current] += 1
        w = sync_weight(func, args, kwargs)
        if w and name == "_local_scalar_dense" and args[0].data_ptr() in self.host:
            self.host_reads[self.current] += 1
        elif w:
            self.syncs[self.current][name] += w
        return func(*args, **kwargs)

    def _host_read(self, what: str):
        orig = getattr(torch.Tensor, what)
        counter = self

        def read(t, *a, **k):
            counter.syncs[counter.current][f"Tensor.{what}"] += 1
            return orig(t, *a, **k)
        self._saved[what] = orig
        setattr(torch.Tensor, what, read)

    def __enter__(self):
        for what in ("tolist", "cpu", "numpy"):
            self._host_read(what)
        return super().__enter__()

    def __exit__(self, *exc):
        for what, orig in self._saved.items():
            setattr(torch.Tensor, what, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    def table(self) -> dict:
        out = {}
        for ph in sorted(set(self.ops) | set(self.syncs)):
            ops = self.ops[ph]
            out[ph] = {"aten_ops": sum(ops.values()), "kernel_ops": sum(ops.values()) - self.views[ph],
                       "syncs": sum(self.syncs[ph].values()), "sync_ops": dict(self.syncs[ph]),
                       "host_reads": self.host_reads[ph],
                       "top_ops": dict(ops.most_common(8))}
        return out


def total_syncs(counter: StepCounter) -> int:
    return sum(sum(c.values()) for c in counter.syncs.values())


def dispatch_us(n: int = 20000) -> dict:
    """This CPU's eager cost of one small op (1-element tensors): plain, and with autograd recording."""
    a, b = torch.ones(1), torch.ones(1)
    w = torch.ones(1, requires_grad=True)
    out = {}
    for name, fn in (("add", lambda: torch.add(a, b)), ("add_autograd", lambda: torch.mul(w, b))):
        for _ in range(1000):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round((time.perf_counter() - t) / n * 1e6, 2)
    return out


def simulated_lengths(count: int, seed: int) -> list[int]:
    """Prompt + response lengths like the GPU run's data: prompts ~70 tokens, responses averaging 377 with 53% at
    the 512 cap (the rest uniform in 16..433, mean 224.5: 0.53 * 512 + 0.47 * 224.5 = 377)."""
    g = torch.Generator().manual_seed(seed)
    prompt = (torch.randn(count, generator=g) * 25 + 70).round().clamp(8, 512).long()
    capped = torch.rand(count, generator=g) < 0.53
    resp = torch.where(capped, 512, torch.randint(16, 434, (count,), generator=g))
    return (prompt + resp).tolist()


def padding_waste(total_seq_len: int, count: int, seed: int) -> dict:
    """OnlineTaps' padded batch against the packed tokens, over speculators' own packing sampler."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    lengths = simulated_lengths(count, seed)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    packed = padded = rows = seqs = 0
    for batch in sampler:
        row, used = [], 0
        for i in batch:  # the collate's cut: the last sequence shortened to the row's end
            take = min(lengths[i], total_seq_len - used)
            row.append(take)
            used += take
            if used == total_seq_len:
                break
        packed, padded, rows, seqs = packed + used, padded + len(row) * max(row), rows + 1, seqs + len(row)
    return {"sequences": count, "mean_length": round(sum(lengths) / count, 1), "rows": rows,
            "sequences_per_row": round(seqs / rows, 2), "packed_tokens_per_row": round(packed / rows, 1),
            "row_fill": round(packed / (rows * total_seq_len), 4),
            "target_positions_per_row": round(padded / rows, 1), "target_padding_share": round(1 - packed / padded, 4),
            "target_positions_per_packed_token": round(padded / packed, 4)}


def build(total_seq_len: int, max_anchors: int, workdir: Path, seed: int = 0):
    """(target, drafter, train kwargs, cfg): SmolLM2-135M's config with random weights (bf16, as
    hidden.target_dtype=bfloat16) and the smollm2-gpu drafter, built by training/train.py's own build_model."""
    from transformers import AutoModelForCausalLM
    from training import compiling
    from training.config import load_config
    from training.target import target_config
    from training.train import build_model, trainer_kwargs
    from speculators.model import SpeculatorModel
    cfg = load_config("training/configs/smollm2-gpu.json", [f"train.total_seq_len={total_seq_len}",
                                                             f"models.drafter.max_anchors={max_anchors}"],
                      workdir=str(workdir))
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(target_config(cfg["target"]), attn_implementation="sdpa",
                                              dtype=torch.float32).eval()
    verifier = workdir / "target_hf"
    if not (verifier / "config.json").is_file():
        target.save_pretrained(verifier)
    model = build_model(cfg, "drafter", str(verifier), cfg["hidden"]["layer_ids"], "eager")
    compiling.apply(model, "none", "cpu")
    m = cfg["models"]["drafter"]
    train_kw, _ = SpeculatorModel.registry[m["type"]].get_trainer_kwargs(**trainer_kwargs(m))
    return target.to(torch.bfloat16), model, train_kw, cfg


def packed_batch(cfg: dict, seed: int, with_lengths: bool) -> dict:
    """One collated row of simulated sequences, through speculators' CollateFn (and LengthsCollate)."""
    from speculators.train.data import CollateFn
    from training.online import LengthsCollate
    total = cfg["train"]["total_seq_len"]
    g = torch.Generator().manual_seed(seed)
    samples, used = [], 0
    for length in simulated_lengths(64, seed):
        prompt = min(70, length // 4)
        samples.append({"hidden_states": torch.empty(length, 0), "verifier_last_hidden_states": torch.empty(length, 0),
                        "input_ids": torch.randint(0, 49152, (length,), generator=g),
                        "loss_mask": torch.cat([torch.zeros(prompt, dtype=torch.long),
                                                torch.ones(length - prompt, dtype=torch.long)]),
                        "lengths": torch.tensor([length]), "position_ids": torch.arange(length)})
        used += length
        if used >= total:
            break
    collate = CollateFn(total, 0, len(cfg["hidden"]["layer_ids"]), dtype=torch.bfloat16)
    return (LengthsCollate(collate) if with_lengths else collate)(samples)


@contextlib.contextmanager
def phased(counter: StepCounter, model, taps, box):
    """The step's hooks and speculators' inner calls attributed to phases (undone on exit)."""
    import speculators.models.dflash.core as core
    metrics_fn, mask_fn = core.compute_metrics, model._build_attention_mask

    def in_phase(name, fn):
        def run(*a, **k):
            with counter.phase(name):
                return fn(*a, **k)
        return run
    hooks = [model.register_forward_pre_hook(in_phase("target (OnlineTaps)", taps), with_kwargs=True),
             model.register_forward_pre_hook(in_phase("glue (box.count hook)", lambda mod, a, k: box.count(
                 k["document_ids"], k["loss_mask"])), with_kwargs=True)]
    core.compute_metrics = in_phase("loss", metrics_fn)
    model._build_attention_mask = in_phase("drafter: anchors + attention mask", mask_fn)
    try:
        yield
    finally:
        core.compute_metrics = metrics_fn
        del model._build_attention_mask
        for h in hooks:
            h.remove()


def one_step(counter: StepCounter, model, batch, train_kw, opt, sched, step: int, log: bool):
    """speculators 0.9.0 Trainer.train_epoch's body for one batch, call for call (CUDA's foreach defaults)."""
    from speculators.train.recovery import BatchRecoveryCoordinator
    with counter.phase("speculators loop"):
        BatchRecoveryCoordinator("training").consume(batch, synchronize=False)
        gpu = {k: v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16), counter.phase("drafter"):
        _, loss, metrics = model(**gpu, **train_kw)
    with counter.phase("optimizer"):
        opt.zero_grad()
    with counter.phase("backward"):
        loss.backward()
    with counter.phase("clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    with counter.phase("speculators loop"):
        metrics["error_records_sum"] = torch.tensor(batch["error_records"], dtype=torch.float32)
        metrics["error_records_total"] = torch.tensor(1.0, dtype=torch.float32)
    with counter.phase("optimizer"):
        opt.step()
        sched.step()
    if log:
        with counter.phase("logging (1 step in train.log_every)"):
            int((gpu["document_ids"] != -1).sum().item())
            {k: v.item() for k, v in metrics.items()}
    with counter.phase("glue (trainer.py _after_step)"):
        torch.manual_seed(step)  # _reseed; box.step_done and the deadline checks are host arithmetic
    return loss


def measure(total_seq_len: int, max_anchors: int, workdir: Path, with_lengths: bool) -> dict:
    from transformers import get_linear_schedule_with_warmup
    from training.box import Box
    from training.online import OnlineTaps
    target, model, train_kw, cfg = build(total_seq_len, max_anchors, workdir)
    taps = OnlineTaps(target, cfg["hidden"]["layer_ids"], torch.bfloat16, torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.01, foreach=True)
    sched = get_linear_schedule_with_warmup(opt, 10, 1000)
    box = Box(torch.device("cpu"))
    result = {}
    for step in range(2):  # the first warms up (lazy state: Adam's moments); the second is counted
        counter = StepCounter(tuple(st["step"] for st in opt.state.values()))
        batch = packed_batch(cfg, step, with_lengths)
        with phased(counter, model, taps, box):
            t = time.perf_counter()
            with counter:
                one_step(counter, model, batch, train_kw, opt, sched, step, log=True)
            wall = time.perf_counter() - t
        result = {"phases": counter.table(), "cpu_wall_s": round(wall, 2),
                  "sequences_in_row": int(batch["document_ids"].max()) + 1,
                  "packed_tokens": int((batch["document_ids"] >= 0).sum())}
    taps.close()
    return result


def summary(phases: dict) -> dict:
    kernels = sum(v["kernel_ops"] for k, v in phases.items() if not k.startswith("logging"))
    syncs = sum(v["syncs"] for k, v in phases.items() if not k.startswith("logging"))
    return {"kernel_ops_per_step": kernels, "syncs_per_step_counted": syncs,
            "kernel_share": {k: round(v["kernel_ops"] / kernels, 3) for k, v in phases.items()
                             if not k.startswith("logging")}}


ASSUMED_LAUNCH_US = (5.0, 10.0)  # an eager CUDA op's host cost: an assumption (not measured here; no GPU)
NOT_SEEN = {"speculators loop": "torch.tensor(error_records, device=cuda) and torch.tensor(1.0, device=cuda): "
            "two blocking host-to-device copies a step (read from speculators 0.9.0 train_epoch)",
            "target (OnlineTaps) before": "six syncs (int(sum), bincount min+max, tolist, a blocking copy of the "
            "lengths, boolean indexing); tests/test_training_step_cost.py counts five of them on the old code"}


def estimate(rec: dict) -> dict:
    run = rec["runs"]["lengths_from_collate"]
    k = run["kernel_ops_per_step"]
    cpu = rec["dispatch_us_this_cpu"]
    return {"host_ms_at_this_cpu_dispatch": [round(k * cpu["add"] / 1e3, 1), round(k * cpu["add_autograd"] / 1e3, 1)],
            "host_ms_at_assumed_cuda_launch": [round(k * us / 1e3, 1) for us in ASSUMED_LAUNCH_US],
            "assumed_launch_us": list(ASSUMED_LAUNCH_US), "goal_step_ms": 33, "measured_h200_median_step_ms": 150,
            "not_seen_on_cpu": NOT_SEEN}


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-seq-len", type=int, default=1024)
    ap.add_argument("--max-anchors", type=int, default=128, help="1024 at 8192 tokens: the same share by default")
    ap.add_argument("--workdir", default="/tmp/xpress_step_cost")
    ap.add_argument("--out", default="results/perf/training_step_cpu_ops.json")
    a = ap.parse_args(argv)
    return cli_exit(lambda: run(a))


def run(a) -> int:
    if a.total_seq_len < 1 or a.max_anchors < 1:  # before the models are built
        raise UsageError(f"--total-seq-len and --max-anchors must be >= 1 (got {a.total_seq_len} and "
                         f"{a.max_anchors})")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = {}
    for name, given in (("lengths_from_collate", True), ("lengths_read_from_device", False)):
        r = measure(a.total_seq_len, a.max_anchors, Path(a.workdir), given)
        runs[name] = {**r, **summary(r["phases"])}
        print(f"{name}: share of the step's kernel ops (a count, not time) by phase "
              f"{json.dumps(runs[name]['kernel_share'])}; host syncs per step (counted) "
              f"{runs[name]['syncs_per_step_counted']} (CPU, random weights)", flush=True)
    rec = {"what": __doc__.strip().split("\n\n")[0], "how": __doc__.strip().split("\n\n", 1)[1],
           "shapes": {"target": "SmolLM2-135M config, random weights, bf16", "drafter": "smollm2-gpu.json drafter "
                      "(5 layers, block 16), eager attention, bf16 autocast", "total_seq_len": a.total_seq_len,
                      "max_anchors": a.max_anchors},
           "runs": runs, "dispatch_us_this_cpu": dispatch_us(),
           "padding_at_8192": padding_waste(8192, 20000, 0)}
    rec["estimate"] = estimate(rec)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
