"""What a run was, read from its config.json (never inferred from defaults): the target and its quantization, the
resolved device and dtype, the kernels, the seed and the decode length. summary.json keeps it as "run"; every
table title, table.csv row and plot title names it, and the merged report groups folders by it.

The drafts' temperature is the one the decode ran at: "resolved" records it; an older config.json whose
--draft-temperature was not typed (null) ran its drafts at --temperature (harness.decode.loop.DecodeSettings).
A field a folder's config.json does not record (one written before it was) is "unknown". The kernels name how
far the arms' greedy outputs can be trusted to equal AR's (issue 28): "triton batch-invariant" (--batch-invariant:
bit for bit; "(not yet verified on a GPU)" after it while the run's config.json does not record a GPU run that
verified those kernels), "torch (near-equal)" on CUDA (cuBLAS picks its kernels by the row count: a near-tie may flip).
"""
from __future__ import annotations

import os

UNKNOWN = "unknown"
# the target: folders of different targets are never averaged together (harness.protocol.merge)
TARGET_KEYS = ("model", "quantization", "device", "dtype")
# the protocol: what changes the meaning of a speedup or a tau (the kernels: batch-invariant tiles cost time)
# (kernels, CUDA graphs and compiling: their cost is in every speedup; the top-C shortlist changes xPress's drafts)
PROTOCOL_KEYS = ("kernels", "max_new_tokens", "compat_reference", "draft_temperature", "cuda_graphs", "compiled",
                 "xpress_topc")


def _name(source) -> str:
    s = str(source).rstrip("/")
    return os.path.basename(s) if os.path.sep in s else s


def kernels_label(config: dict, resolved: dict) -> str:
    """The kernels a run's decode steps ran on, as the tables label them (see the module docstring)."""
    kernels, device = resolved.get("kernels"), str(resolved.get("device"))
    if kernels is None:
        return UNKNOWN
    if kernels == "triton" and config.get("batch_invariant"):
        verified = resolved.get("batch_invariant_verified_on_gpu")
        return "triton batch-invariant" + ("" if verified else " (not yet verified on a GPU)")
    return f"{kernels} (near-equal)" if kernels == "torch" and device.startswith("cuda") else kernels


def run_facts(config: dict | None) -> dict:
    """{model, target_source, quantization, device, dtype, kernels, seed, max_new_tokens, compat_reference,
    draft_temperature, scripted_accept, cuda_graphs, compiled, xpress_topc} from config.json (its "resolved"
    section first); scripted_accept is None when acceptance was not scripted (or the config.json does not say)."""
    config = config if isinstance(config, dict) else {}
    res = config.get("resolved") if isinstance(config.get("resolved"), dict) else {}
    target = res.get("target") if isinstance(res.get("target"), dict) else {}
    source = target.get("source") or (f"random {config['random_weights']}" if config.get("random_weights")
                                      else config.get("model_name_or_path"))
    pick = lambda *vals: next((v for v in vals if v is not None), UNKNOWN)
    quant = target.get("quantization", UNKNOWN) if target else UNKNOWN
    return {"model": _name(source) if source else UNKNOWN, "target_source": pick(source),
            "quantization": "none" if target and quant is None else quant,
            # a config.json written before "resolved" recorded them still holds the device and dtype typed
            "device": pick(res.get("device"), config.get("device")),
            "dtype": pick(res.get("dtype"), _dtype_name(config.get("dtype"))),
            "kernels": kernels_label(config, res),
            "seed": pick(config.get("seed")), "max_new_tokens": pick(config.get("max_new_tokens")),
            "compat_reference": pick(config.get("compat_reference")),
            "draft_temperature": pick(res.get("draft_temperature"), config.get("draft_temperature"),
                                      config.get("temperature")),  # untyped (null): the decode ran at T
            "scripted_accept": config.get("scripted_accept"), "cuda_graphs": pick(config.get("use_graph")),
            "compiled": _compiled(config), "xpress_topc": pick(res.get("xpress_topc"), config.get("xpress_topc"))}


def _dtype_name(typed: str | None) -> str | None:
    """A typed --dtype (bf16, fp32, ...) as a run resolves it (bfloat16, float32: core.devices.DTYPES)."""
    from core.devices import DTYPES
    return str(DTYPES[typed]).replace("torch.", "") if typed in DTYPES else typed


def _compiled(config: dict) -> str:
    """--compile-all, --compile-refiner or none; unknown for a config.json that records neither flag."""
    if "compile_all" not in config and "compile_refiner" not in config:
        return UNKNOWN
    return "all" if config.get("compile_all") else "refiner" if config.get("compile_refiner") else "none"


def of(summary: dict, config: dict | None = None) -> dict:
    """The run facts of a summary (schema 3 keeps them), else of its config.json, "unknown" where neither says."""
    run = summary.get("run")
    facts = run_facts(config)
    if not isinstance(run, dict):
        return facts
    return {**facts, **{k: v for k, v in run.items() if v != UNKNOWN or k not in facts}}


def describe(run: dict) -> str:
    """'model=SmolLM2.gguf (Q4_1, de-quantized) device=cuda:0 dtype=bfloat16 kernels=triton seed=0'."""
    q = run.get("quantization")
    quant = f" ({q}, de-quantized to {run.get('dtype')})" if q not in (None, "none", UNKNOWN) else ""
    if q == UNKNOWN:
        quant = " (quantization unknown)"
    return (f"model={run.get('model', UNKNOWN)}{quant}  device={run.get('device', UNKNOWN)}  "
            f"dtype={run.get('dtype', UNKNOWN)}  kernels={run.get('kernels', UNKNOWN)}  seed={run.get('seed', UNKNOWN)}")
