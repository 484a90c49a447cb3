"""Bad input to python -m training: one error line, exit 2, nothing overwritten; and resume/loss behaviour."""
import json

import pytest
import torch

from training_fixtures import EVAL_ROW, run_cli, tiny_models, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_overlap_index_finds_near_duplicates():
    from training.overlap import NgramIndex
    idx = NgramIndex(3)
    idx.add(EVAL_ROW + "\nPlease reason step by step.", "mbpp.jsonl:1")
    assert idx.best(EVAL_ROW)[1] >= 0.5                       # near-duplicate (the template tail differs)
    assert idx.best("Write a haiku about the sea at night.")[1] < 0.1


def test_eval_prompt_in_training_data_is_refused(tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_models(heads=False))
    data = json.loads(cfg.read_text())["prompts"]["jsonl"][0]
    with open(data, "a") as f:
        f.write(json.dumps({"question": EVAL_ROW.upper()}) + "\n")
    capsys.readouterr()
    assert run_cli("prompts", "--config", cfg, "--workdir", tmp_path / "w") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: training prompt") and "mbpp.jsonl:1" in err[0]
    assert not (tmp_path / "w" / "prompts").exists()


def test_drafter_config_incompatible_with_target(tmp_path, capsys):
    models = tiny_models(heads=False)
    models["drafter"]["num_layers"] = 9  # the tiny target has 6 layers
    cfg = write_config(tmp_path, models)
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_layers 9 exceeds the target's 6 layers" in err[0]
    assert not (tmp_path / "w").exists()  # refused before the workdir is made


@pytest.mark.parametrize("key, value, said", [
    ("train.epochs", "abc", "train.epochs must be an integer >= 1 (got 'abc')"),
    ("train.epochs", "0", "train.epochs must be an integer >= 1 (got 0)"),
    ("train.lr", "-1", "train.lr must be a number > 0 (got -1)"),
    ("train.warmup_ratio", "1.5", "train.warmup_ratio must be a number >= 0 and <= 1 (got 1.5)"),
    ("models.drafter.max_steps", "-3", "models.drafter.max_steps must be an integer >= 1, or null"),
    ("models.drafter.lr", "0", "models.drafter.lr must be a number > 0, or null for train.lr (got 0)"),
])
def test_bad_schedule_numbers_are_refused_when_the_config_loads(tmp_path, capsys, key, value, said):
    """Before any stage runs (they used to fail at the train stage, after the data stages had written)."""
    cfg = write_config(tmp_path, tiny_models(heads=False))
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w", "--set", f"{key}={value}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "w").exists()


def test_a_stage_without_its_input_and_an_unknown_model_are_refused(tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_models(heads=False))
    for stage, before in (("responses", "prompts"), ("hidden", "responses"), ("train", "hidden")):
        capsys.readouterr()
        assert run_cli(stage, "--config", cfg, "--workdir", tmp_path / "w") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"the {stage} stage reads the {before} stage's output" in err[0], err
    assert run_cli("train", "--config", cfg, "--workdir", tmp_path / "w", "--models", "drafer") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --models drafer: not a model of this config (drafter)"]
    assert not (tmp_path / "w").exists()
    cfg = write_config(tmp_path, tiny_models(heads=False), hidden={"layer_ids": [1, 6]})
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w") == 2
    assert "hidden.layer_ids" in capsys.readouterr().err


def test_a_target_folder_that_cannot_serve_and_a_missing_gpu_are_refused_before_the_workdir(tmp_path, capsys):
    """A new user's target folder with config.json alone (a transformers traceback in the prompts stage), with a
    tokenizer but no weights (an error after runs/<config>/ was made), a target that names nothing, and
    train.device=cuda without a GPU: one line each, saying what to do, and no workdir."""
    import shutil
    import torch
    cfg = write_config(tmp_path, tiny_models(heads=False))
    capsys.readouterr()
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tmp_path / "target" / "config.json", bare / "config.json")
    cases = [(("--set", f"target={bare}"), "lacks a tokenizer"), (("--set", "target=./nowhere"), "--set target=smollm2")]
    if not torch.cuda.is_available():
        cases.append((("--set", "train.device=cuda"), "--set train.device=cpu"))
    for extra, says in cases:
        assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    (bare / "tokenizer.json").write_text((tmp_path / "target" / "tokenizer.json").read_text())
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w", "--set", f"target={bare}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks weights" in err[0] and "tokenizer (" not in err[0], err
    assert not (tmp_path / "w").exists()


def _train(cfg, work, *extra):
    return run_cli("all", "--config", cfg, "--workdir", work, *extra)


def _final_state(work, name="drafter"):
    from safetensors.torch import load_file
    m = json.loads((work / "train" / name / "manifest.json").read_text())
    return load_file(str(work / "train" / name / m["final"] / "model.safetensors"))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One uninterrupted run and one stopped after step 3 (checkpoint every step) then resumed."""
    root = tmp_path_factory.mktemp("resume")
    cfg = write_config(root, tiny_models(heads=False),
                       train={"save_every": 1, "epochs": 2, "eval_prompts": 0})
    assert _train(cfg, root / "a") == 0
    assert _train(cfg, root / "b", "--set", "train.stop_after_step=3") == 0
    assert not (root / "b" / "train" / "drafter" / "manifest.json").exists()  # stopped: not complete
    assert _train(cfg, root / "b") == 0
    return root, cfg


def test_interrupted_and_resumed_run_ends_with_the_same_weights(resumed):
    root, _ = resumed
    a, b = _final_state(root / "a"), _final_state(root / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_resumed_runs_box_keeps_the_stopped_process(resumed):
    """box.json of a run stopped with a checkpoint and resumed: the second process's steps, and the first's kept as
    `earlier` (it used to be overwritten, so the card counted only the resumed process's steps and seconds)."""
    from training.card_data import model_record
    from training.card_md import this_run
    root, _ = resumed
    whole = json.loads((root / "a" / "train" / "drafter" / "box.json").read_text())
    box = json.loads((root / "b" / "train" / "drafter" / "box.json").read_text())
    assert box["status"] == "finished" and box["first_step"] == 3 and [e["status"] for e in box["earlier"]] == ["stopped"]
    assert box["earlier"][0]["first_step"] == 0 and box["earlier"][0]["last_step"] == 3
    assert box["earlier"][0]["steps"] + box["steps"] == whole["steps"] and "earlier" not in whole
    line = this_run(model_record(root / "b" / "train" / "drafter", {"model": "drafter"})["box"])
    assert line.startswith(f"{box['steps']} (from 3); {whole['steps']} steps in ") and "over 2 processes (stopped" in line


def test_loss_decreases(resumed):
    root, _ = resumed
    rows = [json.loads(line) for line in (root / "a" / "train" / "drafter" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train"]["loss"] for r in rows if "train" in r]
    assert len(losses) >= 4 and sum(losses[-2:]) < sum(losses[:2])


def test_resume_from_another_configs_checkpoint_is_refused(resumed, capsys):
    root, cfg = resumed
    before = sorted(p.name for p in (root / "b" / "train" / "drafter").iterdir())
    m = root / "b" / "train" / "drafter" / "manifest.json"
    m.unlink()  # an unfinished run of this config...
    capsys.readouterr()
    assert _train(cfg, root / "b", "--set", "train.lr=0.01") == 2  # ...resumed with another learning rate
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds checkpoints of another config" in err[0]
    assert sorted(p.name for p in (root / "b" / "train" / "drafter").iterdir()) == [n for n in before
                                                                                   if n != "manifest.json"]


def test_time_boxed_run_finishes_at_the_deadline(tmp_path):
    """train.on_deadline=finish: the checkpoint reached at max_minutes is final (marked truncated) and exports;
    the default (stop) leaves the model unfinished for a resume."""
    cfg = write_config(tmp_path, tiny_models(heads=False), train={"epochs": 3, "eval_prompts": 0})
    box = ["--set", "train.max_minutes=1e-6"]  # out of time after the first step
    assert _train(cfg, tmp_path / "stop", *box) == 0
    assert not (tmp_path / "stop" / "train" / "drafter" / "manifest.json").exists()
    assert not (tmp_path / "stop" / "export").exists()
    assert _train(cfg, tmp_path / "fin", *box, "--set", "train.on_deadline=finish") == 0
    m = json.loads((tmp_path / "fin" / "train" / "drafter" / "manifest.json").read_text())
    assert m["complete"] and m["truncated"] and 1 <= m["global_step"] < m["planned_steps"]
    assert (tmp_path / "fin" / "export" / "drafter" / "config.json").is_file()


def test_on_deadline_must_be_stop_or_finish(tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_models(heads=False))
    capsys.readouterr()
    assert _train(cfg, tmp_path / "w", "--set", "train.on_deadline=later") == 2
    assert "train.on_deadline must be stop" in capsys.readouterr().err


def test_the_overlap_filter_catches_a_template_twin(tmp_path):
    """A training question equal to a benchmark question but for the benchmark's instruction template ("Please
    reason step by step...") scored 3-gram Jaccard 0.41-0.44 with the template's words counted, under the 0.5 filter;
    with each benchmark file's template stripped it scores 1.0 and is caught. The template is found from the file
    (the lines most of its turns share), so a file without one is indexed as it is."""
    from training.overlap import eval_index, template_of
    tail = "Please reason step by step, and put your final answer within \\\\boxed{}."
    questions = ["A train travels 270 miles in 3 hours. At the same rate, how many additional hours would it take "
                 "to travel an additional 180 miles?", "Tom has 3 apples and buys 5 more. How many apples now?",
                 "A baker makes 12 loaves a day for a week. How many loaves is that?"]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"turns": [q + "\n" + tail]}) + "\n" for q in questions))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"turns": ["Write a haiku about autumn rain."]}) + "\n")
    assert template_of([q + "\n" + tail for q in questions]) == ([], [tail])
    index, files = eval_index(tmp_path, 3)
    assert files == ["chat.jsonl", "gsm8k.jsonl"]
    label, j = index.best(questions[1])
    assert label == "gsm8k.jsonl:2" and j == 1.0
    assert index.best("Write a haiku about autumn rain.") == ("chat.jsonl:1", 1.0)
    from training.overlap import NgramIndex  # the old behaviour: the whole turn, template included, misses it
    whole = NgramIndex(3)
    whole.add(questions[1] + "\n" + tail, "gsm8k.jsonl:2")
    assert whole.best(questions[1])[1] < 0.5


def test_the_shipped_gsm8k_questions_clear_the_overlap_filter():
    """training/data/gsm8k_train_questions.jsonl is the GSM8K train split less the questions the filter drops
    (python -m training.overlap): none of its rows reaches the smollm2-gpu config's threshold against data/eval."""
    from pathlib import Path
    from training.overlap import eval_index, read_jsonl
    root = Path(__file__).resolve().parents[1]
    cfg = json.loads((root / "training" / "configs" / "smollm2-gpu.json").read_text())
    threshold = cfg["prompts"].get("overlap_jaccard", 0.5)
    index, _ = eval_index(root / "data" / "eval", 3)
    rows = read_jsonl(root / "training" / "data" / "gsm8k_train_questions.jsonl")
    assert len(rows) == 7470  # 7,473 questions, 3 dropped as template twins of gsm8k test rows
    assert max(index.best(r["question"])[1] for r in rows) < threshold


def test_a_tensor_over_the_shard_limit_says_what_to_set():
    """The export's refusal names the limit and the value that fits (the tiny-cpu recipe on SmolLM2 met it after
    two minutes of stages, which the same command then keeps)."""
    from core.errors import UsageError
    from training.export import shards
    with pytest.raises(UsageError, match=r"over export.max_shard_mib \(1\); raise it, e.g. --set export.max_shard_mib=2"):
        shards({"fc.weight": torch.zeros(1000, 500)}, 2**20)  # 1.9 MiB in fp32


def test_a_model_field_typo_in_the_config_file_names_its_model(tmp_path, capsys):
    models = tiny_models(heads=False)
    models["drafter"]["block_sz"] = 4
    cfg = write_config(tmp_path, models)
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown field models.drafter.block_sz;" in err[0], err


def test_a_head_over_the_shard_limit_is_refused_before_any_stage(tmp_path, capsys):
    """Export writes whole tensors: a head whose vocab x rank tensor is over export.max_shard_mib failed only at the
    export stage, after the data stages and its whole box (a rank-256 xPress head over SmolLM2's 49,152 tokens is
    24 MiB a tensor in bf16). Now refused before the workdir is made, with the largest rank that fits."""
    from types import SimpleNamespace
    from core.errors import UsageError
    from training.config import load_config
    from training.export import check_fit
    models = tiny_models()
    models["xpress"]["xpress_rank"] = 512  # 128 x 512 elements: 256 KiB in fp32, 128 KiB in bf16
    cfg = write_config(tmp_path, models, export={"max_shard_mib": 0.06})
    capsys.readouterr()
    assert run_cli("all", "--config", cfg, "--workdir", tmp_path / "w") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "models.xpress" in err[0] and "xpress_rank 512" in err[0], err
    assert "lower xpress_rank to at most" in err[0] and not (tmp_path / "w").exists()
    smollm2 = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536)
    big = load_config("smollm2-gpu-heads-gsm8k3", ["models.xpress.xpress_rank=256"])
    with pytest.raises(UsageError, match=r"24\.0 MiB in bfloat16, over export.max_shard_mib 15.5.*at most 165"):
        check_fit(big, "xpress", smollm2)
    for name in ("smollm2-gpu", "smollm2-gpu-heads-xpress-cotrain", "smollm2-gpu-heads-xpress-r160"):
        c = load_config(name)
        for m in c["models"]:
            check_fit(c, m, smollm2)  # the shipped recipes fit, the co-trained drafter's layers included
