"""The training step's speed levers: training/rows.py (the dataset served from memory), training/profiling.py
(train.profile_steps) and the online target's compiled layers (train.compile_target, training/bench_taps.py)."""
import json
from pathlib import Path

import pytest
import torch

from training_fixtures import copy_stages, make_stages, run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_equal_what_datasets_reads(tmp_path):
    """Every row of a saved dataset, read from memory, is the tensor `datasets` gives (values and dtype), and a
    view is offset by its start. Rows of lengths 1..40 and an empty-mask row."""
    from datasets import load_from_disk
    from training.hidden import write_dataset
    from training.rows import Rows
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": torch.randint(0, 1000, (1 + i % 7,), generator=g).tolist(),
             "response": torch.randint(0, 1000, (i * 3 % 34,), generator=g).tolist()} for i in range(23)]
    write_dataset(tmp_path / "d", rows)
    ds = load_from_disk(str(tmp_path / "d"))
    ds.set_format("torch")
    mem = Rows.load(str(tmp_path / "d"))
    assert len(mem) == len(ds) == 23
    for i in range(len(ds)):
        want, got = ds[i], mem[i]
        for k in ("input_ids", "loss_mask", "seq_len"):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k)
        assert torch.equal(mem.input_ids(i), want["input_ids"])
    view = mem.view(5, 12)
    assert len(view) == 7 and torch.equal(view[0]["input_ids"], ds[5]["input_ids"])
    assert torch.equal(view.view(2, 3)[0]["loss_mask"], ds[7]["loss_mask"])
    with pytest.raises(IndexError):
        view[7]
    with pytest.raises(IndexError):
        mem.view(20, 24)



def test_rows_load_without_torchs_read_only_warning(tmp_path):
    """arrow's buffers are read-only; the rows own writable copies (torch warned "The given NumPy array is not
    writable" on every training run when they did not). torch gives that warning once a process, so an earlier test
    here could have used it up: torch.set_warn_always(True) makes it warn on every call (it ran in a child process
    before, which cost a torch start)."""
    import warnings
    from training.hidden import write_dataset
    from training.rows import Rows
    write_dataset(tmp_path / "d", [{"prompt": [1, 2, 3], "response": [4, 5]}, {"prompt": [6], "response": [7]}])
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rows = Rows.load(str(tmp_path / "d"))
    finally:
        torch.set_warn_always(always)
    assert len(rows) == 2 and rows.input_ids(0).tolist() == [1, 2, 3, 4, 5]


def test_rows_are_read_once_a_process_and_again_when_rewritten(tmp_path):
    """Every model of a train stage calls Rows.load on the same dataset: the second call returns the first's rows
    (no second read), and a dataset rewritten at the same path is read anew."""
    from training.hidden import write_dataset
    from training.rows import Rows
    write_dataset(tmp_path / "d", [{"prompt": [1, 2], "response": [3]}])
    first = Rows.load(str(tmp_path / "d"))
    assert Rows.load(str(tmp_path / "d")) is first
    write_dataset(tmp_path / "d", [{"prompt": [1, 2], "response": [3, 4, 5]}, {"prompt": [6], "response": [7]}])
    again = Rows.load(str(tmp_path / "d"))
    assert again is not first and len(again) == 2 and again.input_ids(0).tolist() == [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """(config, workdir) with the prompts, responses and hidden stages run once for the module (online hidden
    states); a test that trains copies the stages into its own workdir (`copy_stages`)."""
    root = tmp_path_factory.mktemp("rows")
    cfg = write_config(root, tiny_models(heads=False), hidden={"mode": "online"}, train={"eval_prompts": 0})
    return cfg, make_stages(cfg, root / "w")


@pytest.fixture(scope="module")
def profiled(staged, tmp_path_factory):
    """One train run that serves the profile and the max_steps checks: models.drafter.max_steps=6 with
    train.epochs=50 (these rows make 9 steps an epoch) and train.profile_steps=2."""
    work = copy_stages(staged[1], tmp_path_factory.mktemp("profiled") / "w")
    assert run_cli("train", "--config", staged[0], "--workdir", work, "--set", "models.drafter.max_steps=6",
                   "--set", "train.epochs=50", "--set", "train.profile_steps=2") == 0
    return work


def _batches(loader):
    out = []
    for b in loader:
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()})
    return out


def test_loaders_from_memory_give_the_same_batches(staged):
    """make_loaders with train.rows_in_memory true (each ArrowDataset's table swapped for a view of `Rows`) and
    false (speculators' reads of the arrow table): the same train and validation batches, key by key and bitwise.
    With it on, the datasets serve from memory."""
    from training.config import load_config
    from training.rows import Rows
    from training.store import read_manifest
    from training.target import verifier_dir
    from training.train import hidden_dir, make_loaders
    cfg_path, work = staged
    got = {}
    for on in (True, False):
        cfg = load_config(str(cfg_path), [f"train.rows_in_memory={str(on).lower()}"], str(work))
        vdir = verifier_dir(cfg["target"], work)
        train, val = make_loaders(cfg, str(vdir), read_manifest(hidden_dir(cfg)), torch.float32)
        assert isinstance(train.dataset.data, Rows) == on and isinstance(val.dataset.data, Rows) == on
        got[on] = (_batches(train), _batches(val))
    for a_set, b_set in zip(got[True], got[False]):
        assert len(a_set) == len(b_set) > 0
        for a, b in zip(a_set, b_set):
            assert a.keys() == b.keys()
            for k in a:
                if isinstance(a[k], torch.Tensor):
                    assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
                else:
                    assert a[k] == b[k], k


def test_profile_steps_writes_a_profile(staged, profiled, tmp_path):
    """train.profile_steps=2: profile.json covers steps 4-5 (after the process's third), with the ops that took
    the most own time and the online target's range; box.json names the profiled steps and times the summary as
    its `profile` part. (Without the option there is neither: tests/test_training_box.py.) The run is the module's
    `profiled` (max_steps 6 of 50 epochs: test_max_steps_ends_the_run_there_whatever_the_epochs)."""
    cfg = staged[0]
    d = profiled / "train" / "drafter"
    box = json.loads((d / "box.json").read_text())
    assert box["compile_target"] == "none"  # auto on a CPU
    prof = json.loads((d / "profile.json").read_text())
    assert prof["steps"] == 2 and prof["global_steps"] == [4, 5] and box["profiled_steps"] == [4, 5]
    assert box["parts_s"]["profile"] > 0 and prof["wall_s_per_step"] > 0
    assert prof["sort"] == "own host time" and len(prof["top"]) >= 5
    assert all(r["own_s_per_step"] > 0 for r in prof["top"])
    assert any(r["op"].startswith("aten::") for r in prof["top"])
    assert prof["ranges"]["xb.online_target"]["count"] == 2 and prof["ranges"]["xb.online_target"]["host_s"] > 0
    # train.profile_start: later steps (past the compile's warm-up on a GPU), the fit's probe after them
    copy_stages(staged[1], tmp_path / "w2")
    assert run_cli("train", "--config", cfg, "--workdir", tmp_path / "w2", "--set", "models.drafter.max_steps=9",
                   "--set", "train.epochs=1", "--set", "train.profile_steps=2", "--set", "train.profile_start=6") == 0
    later = json.loads((tmp_path / "w2" / "train" / "drafter" / "profile.json").read_text())
    assert later["global_steps"] == [7, 8]


def test_a_failing_profiler_does_not_stop_training(tmp_path, monkeypatch, capsys):
    """If torch.profiler fails to start, after_step returns, profile.json holds the error, one line says so, and
    no later step profiles (or fails) again."""
    from training.profiling import START, StepProfile

    def broken(**kw):
        raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr(torch.profiler, "profile", broken)
    prof = StepProfile(tmp_path / "profile.json", 2, torch.device("cpu"))
    for step in range(1, START + 6):
        prof.after_step(step)
    assert json.loads((tmp_path / "profile.json").read_text()) == {"error": "RuntimeError: CUPTI unavailable"}
    assert prof.profiled is None
    assert capsys.readouterr().out.count("profiling stopped") == 1


def test_compiled_layers_are_one_graph_and_give_the_eager_hidden_states(tmp_path):
    """compile_layers on a 6-layer target: one graph (two at most: transformers passes no mask when no row is
    padded) serves every layer and three packed rows of other shapes, and the taps, whose hooks stay outside the
    compiled forward, give the eager hidden states bitwise (a backend that runs the traced graph as it is)."""
    from tiny import tiny_hf_model
    from training.bench_taps import rows
    from training.online import OnlineTaps, compile_layers
    torch._dynamo.reset()
    target = tiny_hf_model("llama", seed=1).eval()
    batches = rows(2048, 3, [1, 3, 5], seed=0, vocab=target.config.vocab_size)
    assert len({(len(b["document_lengths"]), max(b["document_lengths"])) for b in batches}) == 3

    def run():
        taps = OnlineTaps(target, [1, 3, 5], torch.float32, torch.float32)
        try:
            return [taps.compute(b["input_ids"], b["position_ids"], b["document_ids"], b["document_lengths"])
                    for b in batches]
        finally:
            taps.close()
    eager = run()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    assert compile_layers(target, backend=counting) == 6
    compiled = run()
    assert 1 <= len(graphs) <= 2, len(graphs)
    for (h0, l0), (h1, l1) in zip(eager, compiled):
        assert torch.equal(h0, h1) and torch.equal(l0, l1)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One `python -m training.bench_taps` run on a CPU over a tiny checkpoint (aot_eager, fast) with --sdpa math,
    sdpa_context watched: (record, the SDPA names it was asked for, the checkpoint). It serves both tests below
    (a run each before: the record's fields do not depend on the SDPA backend; auto's context is checked apart)."""
    from tiny import save_tiny_checkpoint
    from training import bench_taps
    root = tmp_path_factory.mktemp("bench_taps")
    save_tiny_checkpoint(root / "t", family="llama")
    out, used, real = root / "b.json", [], bench_taps.sdpa_context
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_taps, "sdpa_context", lambda name: used.append(name) or real(name))
        assert bench_taps.main(["--config-json", str(root / "t"), "--device", "cpu", "--dtype", "float32",
                                "--total-seq-len", "128", "--batches", "1", "--warmup", "1", "--backend", "aot_eager",
                                "--sdpa", "math", "--out", str(out)]) == 0
    torch._dynamo.reset()
    return json.loads(out.read_text()), used, root / "t"


def test_bench_taps_reports_eager_and_compiled(bench, tmp_path, capsys):
    """python -m training.bench_taps on a CPU over a tiny checkpoint (aot_eager, fast): both timings, their ratio,
    the padded and real tokens, and the compiled states within fp32 rounding of the eager ones; a bad argument is
    one error line and exit 2, before any model loads. (The module's `bench` run; --sdpa auto, the default, is
    torch's own choice: no context, checked here directly.)"""
    import torch.nn.functional as F
    from training.bench_taps import main, sdpa_context
    rec = bench[0]
    assert rec["weights"] == "random" and rec["eager_ms"] > 0 and rec["compiled_ms"] > 0
    assert rec["speedup"] == pytest.approx(rec["eager_ms"] / rec["compiled_ms"], rel=0.01)
    assert rec["real_tokens_per_row"] <= 128 <= rec["target_positions_per_row"] * 2
    assert rec["max_rel_diff"] <= 64 * rec["dtype_eps"]
    import contextlib
    assert isinstance(sdpa_context("auto"), contextlib.nullcontext)  # --sdpa auto leaves torch's own choice
    q = torch.randn(1, 2, 8, 16)
    with sdpa_context("auto"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    capsys.readouterr()
    assert main(["--config-json", str(tmp_path / "nothing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such config.json" in err[0], err
    assert main(["--config-json", str(bench[2]), "--batches", "0"]) == 2


def test_bench_taps_sdpa_limits_the_target_to_one_backend(bench, capsys):
    """--sdpa NAME runs the target's attention under that SDPA backend alone (a CPU has no cuDNN attention: an SDPA
    call under it fails, under math it runs), the run is inside it, and the record says which; a CUDA-only backend on
    the CPU is one error line, exit 2. (The module's `bench` run, --sdpa math.)"""
    import torch.nn.functional as F
    from training.bench_taps import main, sdpa_context
    q = torch.randn(1, 2, 8, 16)
    with sdpa_context("cudnn"), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with sdpa_context("math"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert bench[0]["sdpa"] == "math" and bench[1] == ["math"]
    capsys.readouterr()
    assert main(["--config-json", str(bench[2]), "--device", "cpu", "--sdpa", "cudnn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sdpa cudnn runs on CUDA only" in err[0], err


def test_profile_summary_counts_each_kernel_once():
    """On CUDA, key_averages holds host ops (their own device time: the kernels they launched) and the kernels
    themselves: the busy time sums the kernels alone, `top` lists host ops, `top_kernels` kernels, and the xb.*
    ranges apart. (Summed over both kinds, as the first version did, the busy time was twice the kernels'.)"""
    from types import SimpleNamespace as E
    from harness.lab.profiled import summary
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(key, kind, own_dev, host=0.0, count=1):
        return E(key=key, device_type=kind, self_device_time_total=own_dev, device_time_total=own_dev,
                 self_cpu_time_total=host, cpu_time_total=host, count=count)
    events = [ev("aten::mm", cpu, 300.0, 10.0, 2), ev("gemm_kernel", cuda, 300.0, 0.0, 2),
              ev("aten::mul", cpu, 100.0, 5.0), ev("mul_kernel", cuda, 100.0), ev("aten::empty", cpu, 0.0, 1.0),
              E(key="xb.online_target", device_type=cpu, self_device_time_total=0.0, device_time_total=250.0,
                self_cpu_time_total=2.0, cpu_time_total=40.0, count=2),
              # the device's annotation of the same range (a CUDA profile has one): its span, gaps included
              ev("xb.online_target", cuda, 900.0, 0.0, 2)]
    rec = summary(events, steps=2, wall_s=0.002, on_device=True)
    assert rec["device_busy_s_per_step"] == pytest.approx(200e-6)  # the annotation's span is no kernel
    assert [r["op"] for r in rec["top"]] == ["aten::mm", "aten::mul"]
    assert [r["kernel"] for r in rec["top_kernels"]] == ["gemm_kernel", "mul_kernel"]
    assert rec["top"][0]["own_s_per_step"] == pytest.approx(150e-6)
    # both rows kept, whichever comes first (the first version kept the last: host 0, and the span as device time)
    want = {"host_s": 20e-6, "device_s": 125e-6, "device_span_s": 450e-6, "count": 2}
    assert rec["ranges"]["xb.online_target"] == want
    assert summary(events[::-1], steps=2, wall_s=0.002, on_device=True)["ranges"]["xb.online_target"] == want
    host = summary(events[:-1], steps=1, wall_s=0.001, on_device=False)
    assert host["device_busy_s_per_step"] == pytest.approx(400e-6) and host["top"][0]["op"] == "aten::mm"


def test_profiling_starts_after_step_3_with_or_without_the_fit():
    """The profiled steps follow the process's third, with train.fit_box too (its probe then starts after them:
    test_training_box.py::test_the_fit_probe_starts_after_a_profile); a StepProfile started at step s covers steps
    s+1 .. s+N."""
    from training.profiling import StepProfile
    from training.train import _profile
    from pathlib import Path
    import tempfile
    from training.config import DEFAULTS
    tc = {**DEFAULTS["train"], "profile_steps": 2, "fit_box": True, "fit_probe_steps": 50}
    assert _profile(tc, Path("."), torch.device("cpu")).start == 3
    assert _profile({**tc, "fit_box": False}, Path("."), torch.device("cpu")).start == 3
    assert _profile({**tc, "profile_start": 40}, Path("."), torch.device("cpu")).start == 40  # train.profile_start
    assert _profile({**tc, "profile_steps": 0}, Path("."), torch.device("cpu")) is None
    with tempfile.TemporaryDirectory() as d:
        prof = StepProfile(Path(d) / "p.json", 2, torch.device("cpu"), start=5)
        for step in range(1, 12):
            torch.ones(8).mul(2)
            prof.after_step(step)
        rec = json.loads((Path(d) / "p.json").read_text())
    assert rec["global_steps"] == [6, 7] and prof.profiled == [6, 7]


def test_max_steps_ends_the_run_there_whatever_the_epochs(profiled):
    """models.X.max_steps with more epochs than it needs: the run stops at that step (speculators 0.9.0 alone went on
    through every epoch, each one step, a validation and a checkpoint more: 55 steps for max_steps 6 and 50 epochs
    of 9 steps; training/train.py caps num_epochs). The run is the module's `profiled` (its profile of steps 4-5
    changes neither)."""
    d = profiled / "train" / "drafter"
    assert json.loads((d / "manifest.json").read_text())["global_step"] == 6
    assert len([p for p in d.iterdir() if p.is_dir() and p.name.isdigit()]) == 1
