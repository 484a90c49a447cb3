"""The IBM Spyre serving contract, checked before any model loads.

What a Spyre deployment of dFlash/xPress accepts (the torch-spyre integration's validator; docs/SPYRE_GEMMA.md):
    - FP16 weights, unquantized (the card computes in DL16; bf16 and fp32 are not served);
    - xPress scores a shortlist: C = min(xpress_topc, V) with 1 <= C <= 1024; topc 0 (exact full-vocabulary
      scoring every pass) is not served;
    - block = anchor + 15 = 16 (the published b16 checkpoints);
    - a token budget of at least 31 per request: a 16-row verification block plus 15 drafting slots;
    - 1 to 4 requests at once (`1 <= max_num_seqs <= 4`): --batch-sizes 1..4, with the token budget of the table
      below for the largest B; the card pads its draft batch to 1, 2 or 4 blocks, so B=3 runs padded to 4:

          B (requests)           1    2    3    4
          padded on the card     1    2    4    4
          token budget >=       31   62   93  124     (31 x B: padding rows take no scheduler slots)
    - K from the checkpoint's xpress_num_passes, 6 when it says nothing.
Precedence for K and C, as in the Spyre bridge: an explicit flag, then the checkpoint, then the default.

`check_run` needs only the command line, --batch-sizes included (called by config.validate); `check_models` needs
the target config and the refiner checkpoint headers (called by build.prepare, before any weights load) and returns
the resolved plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import UsageError

BLOCK = 16                 # anchor + 15 drafts
MAX_SHORTLIST = 1024
DEFAULT_PASSES = 6
DEFAULT_TOPC = 512
DEFAULT_BUDGET = 64        # the validated single-request setup: compile sizes 1, 16, 64
REQUESTS = 1               # a run without --batch-sizes decodes one request at a time
MAX_REQUESTS = 4           # the Spyre validator's 1 <= max_num_seqs <= 4
SERVED_BATCHES = tuple(range(1, MAX_REQUESTS + 1))
FP16_NAMES = ("float16", "fp16")


def is_spyre(device: str | None) -> bool:
    return bool(device) and device.split(":")[0] == "spyre"


def per_request_budget(block: int = BLOCK) -> int:
    """Token slots one request needs per scheduler step: a verification block plus its B-1 drafting slots."""
    return block + block - 1


def padded_batch(requests: int) -> int:
    """The draft batch the card runs for `requests` active requests: 1, 2 or 4 blocks (3 pads to 4)."""
    return 1 << (requests - 1).bit_length()


def batch_budget(requests: int, block: int = BLOCK) -> int:
    """Token slots `requests` requests need per scheduler step: 31 each at block 16 (31, 62, 93, 124)."""
    return per_request_budget(block) * requests


BUDGETS = {b: batch_budget(b) for b in SERVED_BATCHES}  # {1: 31, 2: 62, 3: 93, 4: 124}


@dataclass(frozen=True)
class SpyrePlan:
    passes: int
    topc: int                    # the value asked for (flag, checkpoint or default)
    shortlist: int               # min(topc, V): what each slot scores
    block: int
    budget: int
    compile_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...] = (REQUESTS,)  # the requests decoded together (--batch-sizes, else 1)
    padded: tuple[int, ...] = (REQUESTS,)       # what the card runs for each: padded_batch(B), 3 -> 4

    def describe(self) -> str:
        text = (f"Spyre contract: FP16, block {self.block}, K={self.passes}, shortlist C={self.shortlist}, "
                f"token budget {self.budget}, compile sizes {list(self.compile_sizes)}")
        if self.batch_sizes == (REQUESTS,):
            return text
        pads = "".join(f" ({b} padded to {p} on the card)" for b, p in zip(self.batch_sizes, self.padded) if p != b)
        return f"{text}, batch sizes {list(self.batch_sizes)}{pads}"


def check_run(cfg) -> None:
    """Everything on the command line that Spyre cannot serve (no file is read)."""
    if cfg.dtype is not None and cfg.dtype not in FP16_NAMES:
        raise UsageError(f"--device spyre serves FP16 weights only, not --dtype {cfg.dtype}; use --dtype float16 "
                         "(or leave --dtype out)")
    target = cfg.model_name_or_path or ""
    if target.lower().endswith(".gguf"):
        raise UsageError(f"--device spyre serves unquantized FP16 weights; {target} is a (quantized) GGUF file: "
                         "use the original HF checkpoint")
    if "xpress_topc" in cfg.given and cfg.xpress_topc == 0:
        raise UsageError("--device spyre scores a shortlist: --xpress-topc 0 (full-vocabulary scoring every pass) "
                         f"is not served; use 1..{MAX_SHORTLIST} (Spyre's default is {DEFAULT_TOPC})")
    if cfg.xpress_topc > MAX_SHORTLIST:
        raise UsageError(f"--device spyre: --xpress-topc {cfg.xpress_topc} is above the largest Spyre shortlist "
                         f"({MAX_SHORTLIST}); use 1..{MAX_SHORTLIST}")
    if cfg.block_size is not None and cfg.block_size != BLOCK:
        raise UsageError(f"--device spyre: --block-size {cfg.block_size}, but Spyre serves block = anchor + 15 = "
                         f"{BLOCK}; drop --block-size")
    batches = requested_batches(cfg)
    budget = budget_of(cfg)
    if batches == [REQUESTS]:
        need = per_request_budget() * REQUESTS
        if budget < need:
            raise UsageError(f"--max-num-batched-tokens {budget}: a request needs at least {need} token slots per "
                             f"step on Spyre (a {BLOCK}-row verification block + {BLOCK - 1} drafting slots); use "
                             f">= {need}")
    elif batches:
        check_batches(batches, budget)
    if cfg.use_graph:
        raise UsageError("--use-graph captures CUDA graphs; Spyre runs compiled graphs of its own: drop --use-graph")
    if cfg.kernels == "triton":
        raise UsageError("--kernels triton runs on CUDA; --device spyre needs --kernels torch (or auto)")


def check_batches(batches, budget: int) -> None:
    """Spyre serves 1..4 requests at once, with 31 token slots per request for the largest B (BUDGETS)."""
    table = ", ".join(f"{t} for B={b}" for b, t in BUDGETS.items())
    bad = [b for b in batches if not 1 <= b <= MAX_REQUESTS]
    if bad:
        served = [b for b in batches if 1 <= b <= MAX_REQUESTS]
        fix = f"use --batch-sizes {','.join(map(str, served))}" if served else "use batch sizes 1..4"
        raise UsageError(f"--device spyre: --batch-sizes {bad[0]} is not served; Spyre decodes 1 to "
                         f"{MAX_REQUESTS} requests at once (3 runs padded to 4): {fix}")
    largest = max(batches)
    need = batch_budget(largest)
    if budget < need:
        raise UsageError(f"--device spyre: --max-num-batched-tokens {budget} is below the {need} token slots per step "
                         f"that B={largest} requests need ({per_request_budget()} each: a {BLOCK}-row verification "
                         f"block + {BLOCK - 1} drafting slots; {table}); use --max-num-batched-tokens >= {need}")


def requested_batches(cfg) -> list[int]:
    """The batch sizes on the command line, [1] without --batch-sizes; [] when the list does not parse (the
    sweep's own check, harness.protocol.sweep_points, then says what is wrong with it)."""
    text = getattr(cfg, "batch_sizes", None)
    if text is None:
        return [REQUESTS]
    try:
        return sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        return []


def budget_of(cfg) -> int:
    """--max-num-batched-tokens, else 64 (the validated single-request setup); a batch of B > 2 gets the next power
    of two above its 31 x B slots, 128, as the Spyre docs advise for four requests."""
    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens
    served = [b for b in requested_batches(cfg) if 1 <= b <= MAX_REQUESTS] or [REQUESTS]
    return max(DEFAULT_BUDGET, 1 << (batch_budget(max(served)) - 1).bit_length())


def check_models(cfg, target_config, block: int, xpress=None) -> SpyrePlan:
    """The config-level contract: target precision, vocabulary, block and the refiner checkpoint's K and C.
    `xpress` is the xPress RefinerCheckpoint when one was given (its tensors are read, no model is built)."""
    text = getattr(target_config, "text_config", None) or target_config
    quant = getattr(target_config, "quantization_config", None) or getattr(text, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise UsageError(f"--device spyre serves unquantized FP16 weights; the target is quantized ({method}): "
                         "use the unquantized checkpoint")
    vocab = int(text.vocab_size)
    where = f" (the xPress checkpoint {xpress.source} is b{xpress.block_size})" if xpress is not None else ""
    if block != BLOCK or (xpress is not None and xpress.block_size != BLOCK):
        got = xpress.block_size if xpress is not None and xpress.block_size != BLOCK else block
        raise UsageError(f"--device spyre serves block = anchor + 15 = {BLOCK}, got block {got}{where}; use a "
                         "published b16 drafter and checkpoint")
    topc = _resolve(cfg, "xpress_topc", xpress.topc if xpress is not None else None, DEFAULT_TOPC)
    if topc == 0:
        raise UsageError(f"--device spyre scores a shortlist, but the xPress checkpoint asks for xpress_topc 0 (full "
                         f"vocabulary); pass --xpress-topc 1..{MAX_SHORTLIST}")
    if not 1 <= topc <= MAX_SHORTLIST:
        raise UsageError(f"--device spyre: xpress_topc {topc} is outside 1..{MAX_SHORTLIST}")
    passes = _resolve(cfg, "xpress_refine_passes", xpress.num_passes if xpress is not None else None,
                      DEFAULT_PASSES)
    budget = budget_of(cfg)
    batches = tuple(requested_batches(cfg) or [REQUESTS])
    if batches != (REQUESTS,):  # check_run has refused these already; a plan is never made for an unserved batch
        check_batches(batches, budget)
    padded = tuple(padded_batch(b) for b in batches)
    return SpyrePlan(passes=passes, topc=topc, shortlist=min(topc, vocab), block=BLOCK, budget=budget,
                     compile_sizes=tuple(sorted({1, BLOCK, budget} | {BLOCK * p for p in padded})),
                     batch_sizes=batches, padded=padded)


def _resolve(cfg, field: str, checkpoint, default: int) -> int:
    if field in cfg.given:
        return getattr(cfg, field)
    return default if checkpoint is None else int(checkpoint)
