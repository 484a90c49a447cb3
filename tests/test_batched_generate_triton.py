"""harness.decode.batched_gen with attention="triton": the decode's attention is the harness's Triton kernel
(core/kernels/attention.py), each row over its own prefix, instead of SDPA under a mask over the step's bucket.
On tiny fp32 models (Triton's CPU interpreter here, compiled on a GPU) its answers equal the SDPA path's row for
row, with refills and early stops. The slot counts are the host's bookkeeping of what each path reads (checked by
hand below), not a measurement of the kernel.

Power: a kernel call over the wrong positions (e.g. lengths + 1, or every row at the bucket's end) or caches (the
layer's neighbour) changes the answers of these random models within a few tokens; a refilled row that could see
its old prompt's keys changes its answer (the refill test of tests/test_batched_generate.py, here on the kernel)."""
import pytest
import torch

from kernel_env import DEV, pytestmark  # noqa: F401  (skips without Triton, or with numpy that breaks the interpreter)
from core.errors import UsageError
from harness.decode.batched_gen import BatchedGenerator
from tiny import tiny_hf_model

pytestmark = [*pytestmark, pytest.mark.usefixtures("one_thread")]
NEW = 6


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 100, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # per-head q/k norms in the kernel, and none
def test_triton_attention_answers_equal_sdpa_with_refills_and_stops(family):
    # 2 layers (every layer runs the same kernel; a call on the neighbour layer's cache still shows); on a GPU, with
    # CUDA graphs (one for every bucket with the kernel)
    model = tiny_hf_model(family, layers=2).to(DEV)
    prompts = _prompts((7, 2, 11, 4), seed=3)
    sdpa = BatchedGenerator(model, rows=2, bucket=16, check_every=2)
    stop = sdpa.generate(prompts[:1], NEW, [])[0][2]
    limits = [NEW, 3, NEW, NEW]
    sdpa.stats = dict.fromkeys(sdpa.stats, 0)
    want = sdpa.generate(prompts, limits, [stop])
    assert any(len(w) < lim for w, lim in zip(want, limits))  # an early stop, so rows were refilled mid-way
    fast = BatchedGenerator(model, rows=2, bucket=16, check_every=2, attention="triton")
    assert fast.generate(prompts, limits, [stop]) == want
    if fast.use_graph:
        assert fast.stats["captures"] == 1 < sdpa.stats["captures"]


def test_kv_slot_bookkeeping_of_the_kernel_path_by_hand():
    """One 5-token prompt, 4 new tokens (3 decode steps), 2 rows (one idle), bucket 16: the busy row reads its own
    6, 7 and 8 slots, the idle row (length 0) one a step; SDPA's count would be 3 x 2 x 16 = 96."""
    gen = BatchedGenerator(tiny_hf_model("llama", layers=2).to(DEV), rows=2, bucket=16, check_every=8,
                           attention="triton")
    gen.generate(_prompts((5,)), 4, [])
    assert (gen.stats["kv_slots_read"], gen.stats["kv_slots_needed"]) == (6 + 7 + 8 + 3, 6 + 7 + 8)


def test_an_unknown_attention_is_refused():
    with pytest.raises(UsageError, match="attention 'flash' is not one of auto, sdpa, triton"):
        BatchedGenerator(tiny_hf_model("llama"), rows=2, attention="flash")


def test_auto_picks_the_kernel_on_cuda_where_it_runs(monkeypatch):
    """attention="auto" (the responses stage's default): Triton on a CUDA device when the package is there and the
    head shape fits, SDPA on the CPU (never the interpreter unasked), without triton, or for a shape the kernel
    refuses; named choices pass through. Decided from the model's config: nothing is built on the device."""
    from core import kernels
    from harness.decode.batched import pick_attention
    model = tiny_hf_model("llama")
    assert pick_attention(model, "auto", "cuda") == "triton"
    assert pick_attention(model, "auto", "cpu") == pick_attention(model, "auto") == "sdpa"
    assert pick_attention(model, "triton", "cpu") == "triton" and pick_attention(model, "sdpa", "cuda") == "sdpa"
    odd = tiny_hf_model("llama")
    odd.config.head_dim = 24  # not a power of two
    assert pick_attention(odd, "auto", "cuda") == "sdpa"
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build: the kernel is not tested there
    assert pick_attention(model, "auto", "cuda") == "sdpa"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert pick_attention(model, "auto", "cuda") == "sdpa"


def test_bench_generate_runs_the_triton_attention(tmp_path):
    """bench_generate --attention triton on the tiny random preset: the same greedy rows as HF's, labelled. Two
    prompts, one batch: the kernel's refills and stops are the test above's; this one checks the CLI's path."""
    import json
    from harness.lab.bench_generate import main
    out = tmp_path / "g.json"
    assert main(["--random-weights", "tiny", "--device", DEV.type, "--dtype", "float32", "--prompts", "2",
                 "--batch", "2", "--max-new-tokens", "3", "--bucket", "32", "--attention", "triton",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["attention"] == "triton" and r["greedy_rows_equal"] == 1.0
