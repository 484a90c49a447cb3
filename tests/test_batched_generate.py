"""harness.decode.batched_gen.BatchedGenerator (many rows over one static KV cache, each at its own position) against
HF `generate`, on tiny fp32 models on CPU; and the responses stage with engine=fast against engine=hf."""
import json
import shutil

import pytest
import torch

from core.errors import UsageError
from harness.decode.batched_gen import BatchedGenerator
from tiny import tiny_hf_model
from training.gen import generate_batch

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 10


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, 100, (n,), generator=g).tolist() for n in lengths]


def _hf(model, prompts, stops, new=NEW):
    return generate_batch(model, prompts, new, stops, 0, sample=False)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return tiny_hf_model(request.param)


def test_greedy_equals_hf_generate_row_for_row(model):
    """Prompts of 1..12 tokens in one batch, a stop id that greedy emits (so some rows end early, some run to
    max_new_tokens): every row equals HF generate's (left-padded, its own attention mask). Guards each row's
    position (rotary and the slot its K/V go to), the key mask over its own prefix, and the per-row stop."""
    prompts = _prompts((3, 9, 1, 12, 5))
    free = _hf(model, prompts, [])
    stop = free[1][3]
    want = _hf(model, prompts, [stop])
    assert any(len(w) < NEW for w in want) and any(len(w) == NEW for w in want)  # the test has both kinds
    gen = BatchedGenerator(model, rows=len(prompts), bucket=16, check_every=3)
    assert gen.generate(prompts, NEW, [stop]) == want
    assert gen.generate(prompts, NEW, []) == free  # the same generator again: nothing left over from before
    assert gen.generate(prompts, NEW, [stop], keep_stop=False) == [w[:-1] if w[-1] == stop else w for w in want]


def test_refilled_rows_equal_their_own_single_row_answers(model):
    """2 rows, 5 prompts: rows that finish (an early stop, or a smaller per-prompt limit) take the next waiting
    prompt while the other row keeps decoding, over its own stale cache row; each answer equals HF generate of
    that prompt alone. Guards the refill (a new prompt must not see its row's previous keys)."""
    prompts = _prompts((7, 2, 11, 4, 6), seed=3)
    stop = _hf(model, prompts[:1], [])[0][2]
    limits = [NEW, 4, NEW, NEW, 6]
    want = [_hf(model, [p], [stop], new=m)[0] for p, m in zip(prompts, limits)]
    gen = BatchedGenerator(model, rows=2, bucket=16, check_every=2)
    assert gen.generate(prompts, limits, [stop]) == want
    assert gen.stats["prefill_rows"] == 5 and gen.stats["prefills"] >= 4  # rows were refilled one at a time
    static = BatchedGenerator(model, rows=2, bucket=16, check_every=2)
    assert static.generate(prompts, limits, [stop], refill=False) == want


def test_gathered_refills_answer_the_same_in_fewer_prefills(model):
    """refill_min=3 of 4 rows: a finished row waits until three are free (or the queue holds fewer prompts), so
    the refills' prefills are fewer and larger; each greedy answer is still that prompt's alone. Out of range is
    one error."""
    prompts = _prompts((7, 2, 11, 4, 6, 3, 9, 5, 8), seed=5)
    stop = _hf(model, prompts[:1], [])[0][2]
    limits = [NEW, 3, NEW, 4, 6, 2, NEW, 5, 3]
    want = [_hf(model, [p], [stop], new=m)[0] for p, m in zip(prompts, limits)]
    every = BatchedGenerator(model, rows=4, bucket=16, check_every=1)
    gathered = BatchedGenerator(model, rows=4, bucket=16, check_every=1, refill_min=3)
    assert every.generate(prompts, limits, [stop]) == want == gathered.generate(prompts, limits, [stop])
    assert gathered.stats["prefill_rows"] == every.stats["prefill_rows"] == len(prompts)
    assert gathered.stats["prefills"] < every.stats["prefills"]
    with pytest.raises(UsageError, match="refill_min 1..rows"):
        BatchedGenerator(model, rows=4, refill_min=5)


def test_sampling_is_seeded_and_per_row(model):
    """Same seed -> same answers, another seed -> others; top_p tiny -> the greedy answers. Every sampled token
    lies in the top-p nucleus of its own row's logits at that step (recomputed by the HF forward), and the two
    prompts' first nuclei differ: a sampler that mixed rows' logits would pick tokens outside them."""
    prompts = _prompts((5, 8), seed=7) * 4
    gen = BatchedGenerator(model, rows=8, bucket=16, check_every=4)
    kw = dict(sample=True, temperature=1.0, top_p=0.7)
    a = gen.generate(prompts, NEW, [], seed=5, **kw)
    assert gen.generate(prompts, NEW, [], seed=5, **kw) == a
    assert gen.generate(prompts, NEW, [], seed=6, **kw) != a
    assert gen.generate(prompts, NEW, [], sample=True, top_p=1e-6, seed=5) == _hf(model, prompts, [])
    nuclei = []
    for p, ans in zip(prompts, a):
        with torch.no_grad():
            probs = model(torch.tensor([p + ans])).logits[0, len(p) - 1:-1].softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        for t, (row_order, row_before) in enumerate(zip(order, before)):
            nucleus = set(row_order[row_before < 0.7].tolist())
            assert ans[t] in nucleus
            if t == 0:
                nuclei.append(nucleus)
    assert nuclei[0] != nuclei[1]
    assert len({tuple(x) for x in a[0::2]}) > 1  # four copies of one prompt: not all the same answer


def test_bad_requests_are_refused_before_decoding(model):
    gen = BatchedGenerator(model, rows=2, bucket=16)
    with pytest.raises(UsageError, match="max_new_tokens"):
        gen.generate([[9, 10], []], NEW, [])
    with pytest.raises(UsageError, match="positions"):
        gen.generate([[9] * 500], 100, [])


def test_responses_stage_fast_equals_hf(tmp_path):
    """The responses stage with engine=fast (the default) writes the same rows as engine=hf, in the same order:
    greedy rows identical, sampled rows for the same prompts. An unknown engine is one error line, exit 2."""
    from training_fixtures import run_cli, write_config
    cfg = write_config(tmp_path)
    fast, hf = tmp_path / "fast", tmp_path / "hf"
    assert run_cli("prompts", "--config", cfg, "--workdir", fast) == 0
    shutil.copytree(fast / "prompts", hf / "prompts")
    assert run_cli("responses", "--config", cfg, "--workdir", fast) == 0
    assert run_cli("responses", "--config", cfg, "--workdir", hf, "--set", "responses.engine=hf") == 0

    def rows(w):
        return [json.loads(line) for f in sorted((w / "responses" / "parts").glob("*.jsonl"))
                for line in f.read_text().splitlines()]
    got, want = rows(fast), rows(hf)
    assert len(got) == len(want) > 0
    assert [r for r in got if r["mode"] == "greedy"] == [r for r in want if r["mode"] == "greedy"]
    assert [(r["prompt"], r["mode"]) for r in got] == [(r["prompt"], r["mode"]) for r in want]
    assert run_cli("responses", "--config", cfg, "--workdir", hf, "--set", "responses.engine=vllm") == 2
    manifest = json.loads((fast / "responses" / "manifest.json").read_text())
    assert (manifest["engine"], manifest["attentions"]) == ("fast", ["sdpa"])  # auto on the CPU: SDPA, recorded
    assert manifest["top_p_cuts"] == ["sort"]  # the engine's top-p cut on the CPU, recorded too
    assert json.loads((hf / "responses" / "manifest.json").read_text())["top_p_cuts"] == []
    assert json.loads((hf / "responses" / "manifest.json").read_text())["attentions"] == []
    # a part made by another process with the other attention: the stage finishes the rest and names both
    (fast / "responses" / "parts" / "part_0000.jsonl").unlink()
    manifest.update(complete=False, attentions=["triton"], top_p_cuts=["threshold"])
    (fast / "responses" / "manifest.json").write_text(json.dumps(manifest))
    assert run_cli("responses", "--config", cfg, "--workdir", fast) == 0
    again = json.loads((fast / "responses" / "manifest.json").read_text())
    assert again["attentions"] == ["sdpa", "triton"] and again["top_p_cuts"] == ["sort", "threshold"]


def test_responses_attention_is_checked_before_loading_and_kept_out_of_the_key(tmp_path, monkeypatch, capsys):
    """responses.attention: an unknown name, a kernel choice with engine=hf, triton without the triton package and
    triton where the target loads on the CPU are each one error line naming the setting (exit 2) before any model
    loads; a finished stage is not redone when only the attention changes (the same model's answers: an
    implementation choice, like the box), while a changed engine is."""
    from core import kernels
    from training import responses
    from training.config import load_config
    from training_fixtures import run_cli, write_config
    cfg = write_config(tmp_path)
    w = tmp_path / "w"
    # `all` checks it before its first stage writes anything (with engine=hf the prompts stage does not look)
    assert run_cli("all", "--config", cfg, "--workdir", w, "--set", "responses.engine=hf",
                   "--set", "responses.attention=bogus") == 2
    assert not (w / "prompts").exists()
    assert run_cli("prompts", "--config", cfg, "--workdir", w) == 0  # so that only the attention can refuse
    capsys.readouterr()

    def refused(*sets, says):
        assert run_cli("responses", "--config", cfg, "--workdir", w, *[a for s in sets for a in ("--set", s)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "responses.attention" in err[0] and says in err[0], err
        assert not (w / "responses").exists()
    refused("responses.attention=flash", says="use one of auto, sdpa, triton")
    refused("responses.attention=sdpa", "responses.engine=hf", says="leave responses.attention at auto")
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "interpreted", lambda: False)
    refused("responses.attention=triton", "train.device=cpu", says="not on cpu; set responses.attention=auto or sdpa")
    monkeypatch.setattr(kernels, "available", lambda: False)
    refused("responses.attention=triton", says="needs the triton package")
    base = load_config(cfg)
    monkeypatch.setattr(responses, "read_manifest", lambda d: {"key": "p"})  # stage_key reads the prompts' key
    other = {**base, "responses": {**base["responses"], "attention": "sdpa"}}
    engine = {**base, "responses": {**base["responses"], "engine": "hf"}}
    assert responses.stage_key(base) == responses.stage_key(other) != responses.stage_key(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_steps_equal_hf_and_replay_the_seed():
    """On CUDA (fp32, graphs on): greedy equals HF generate row for row with refills, and a sampled generation
    replays exactly from its seed (the generator's state is registered with every captured graph)."""
    model = tiny_hf_model("qwen3").cuda()
    prompts = _prompts((3, 9, 1, 12, 5, 7, 2))
    stop = _hf(model, prompts[:1], [])[0][2]
    want = [_hf(model, [p], [stop])[0] for p in prompts]
    gen = BatchedGenerator(model, rows=3, bucket=16, check_every=3)
    assert gen.use_graph and gen.generate(prompts, NEW, [stop]) == want and gen.stats["captures"] > 0
    kw = dict(sample=True, temperature=1.0, top_p=0.9)
    a = gen.generate(prompts, NEW, [stop], seed=3, **kw)
    assert gen.generate(prompts, NEW, [stop], seed=3, **kw) == a != gen.generate(prompts, NEW, [stop], seed=4, **kw)


def test_bench_generate_runs_on_random_weights(tmp_path):
    """harness.lab.bench_generate on the tiny random preset (CPU): both engines timed on the same prompts, the
    fast engine's greedy rows equal HF's, the output says random weights, and a bad argument is one error line."""
    from harness.lab.bench_generate import main
    out = tmp_path / "g.json"
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3", "--batch", "2",
                 "--max-new-tokens", "3", "--bucket", "32", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["label"].startswith("random weights") and r["fast"]["tokens"] == r["hf"]["tokens"] == 9
    assert r["greedy_rows_equal"] == 1.0 and r["fast"]["prefill_rows"] == 3 and r["ratio"] > 0
    assert r["mode"] == "greedy" and "temperature" not in r and "top_p" not in r
    assert main(["--random-weights", "nope", "--prompts", "2"]) == 2
    # HF on fewer prompts than the engine's rows: its rate is at a smaller batch, so no plain ratio is given
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3", "--batch", "2",
                 "--max-new-tokens", "3", "--bucket", "32", "--hf-prompts", "1", "--out", str(out)]) == 0
    r1 = json.loads(out.read_text())
    assert "ratio" not in r1 and r1["ratio_at_unequal_batch"] > 0 and r1["hf"]["batch"] == 1
    assert "in batches of 1 against the engine's 2 rows" in r1["note"] and r["hf"]["batch"] == 2
    # a sampled run records the distribution it sampled from
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "2", "--batch", "2",
                 "--max-new-tokens", "2", "--bucket", "32", "--skip-hf", "--sampled", "--top-p", "0.9",
                 "--out", str(out)]) == 0
    rs = json.loads(out.read_text())
    assert "hf" not in rs and "ratio" not in rs and rs["fast"]["tokens"] > 0
    assert (rs["mode"], rs["temperature"], rs["top_p"], rs["sampler"]) == ("sampled", 0.8, 0.9, "sort")  # the default
    # fewer prompts than --batch: both engines decode them all at once, an equal batch
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "2", "--batch", "4",
                 "--max-new-tokens", "3", "--bucket", "32", "--out", str(out)]) == 0
    r2 = json.loads(out.read_text())
    assert r2["ratio"] > 0 and "note" not in r2 and r2["hf"]["batch"] == 2
    assert r2["gpu"] is None and "not warmed up" in r2["timing"]
    # auto, the training default, names the attention it ran (SDPA on the CPU)
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "2", "--batch", "2",
                 "--max-new-tokens", "2", "--bucket", "32", "--attention", "auto", "--hf-prompts", "1",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["attention"] == "sdpa" and r2["refill_min"] == 1
    assert main(["--random-weights", "tiny", "--batch", "2", "--refill-min", "3"]) == 2  # before any model
    # the tiny preset's cache: 2 (k and v) x its layers x K/V heads x head_dim x 4 bytes (fp32) a slot
    from harness.protocol.presets import preset
    c = preset("tiny").config
    assert r["fast"]["kv_bytes_per_slot"] == 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * \
        (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) * 4
    assert r["attention"] == "sdpa"


def test_bench_generate_profile_names_the_decode_steps_ranges(tmp_path):
    """--profile: a third, untimed run under torch.profiler; its record is per decode step and names the prefills
    and the host checks (the ranges the generator labels)."""
    from harness.lab.bench_generate import main
    out = tmp_path / "p.json"
    assert main(["--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3", "--batch", "2",
                 "--max-new-tokens", "3", "--bucket", "32", "--hf-prompts", "1", "--profile", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["hf"]["prompts"] == 1 and r["greedy_rows_equal"] <= 1.0  # HF ran the first --hf-prompts only
    prof = r["profile"]
    assert prof["per"] == "decode step" and prof["steps"] == json.loads(out.read_text())["fast"]["steps"]
    assert {"xb.prefill", "xb.check"} <= set(prof["ranges"]) and prof["top"]


def test_kv_slot_counts_are_the_rows_times_bucket_and_each_rows_own_prefix(model):
    """The host's count of the attention's cache reads, by hand: one 5-token prompt, 4 new tokens (the prefill
    gives the first, 3 decode steps the rest), in 2 rows (one left empty), bucket 16: each step reads 2 rows x 16
    slots; the busy row needs 6, 7 and 8 (its position + 1)."""
    gen = BatchedGenerator(model, rows=2, bucket=16, check_every=8)
    gen.generate(_prompts((5,)), 4, [])
    assert gen.stats["steps"] == 3
    assert (gen.stats["kv_slots_read"], gen.stats["kv_slots_needed"]) == (3 * 2 * 16, 6 + 7 + 8)
