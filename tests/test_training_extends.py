"""Config `extends` (training/config.py read_raw): a variant config names its base and the sections it changes;
`models` is replaced whole, every other section merged field by field, and bad chains are refused in one line."""
import json

import pytest

from core.errors import UsageError
from training.config import load_config, resolve_config_path


def test_the_drafter_only_preset_is_smollm2_gpu_with_one_model():
    """smollm2-gpu-drafter (the third H200 run's config) equals smollm2-gpu in every section but `models`, and
    there it holds only the drafter, the same as smollm2-gpu's: so its stages' keys (prompts, responses) are the
    base's, and data packed by either run unpacks for the other."""
    from training import prompts
    base, child = load_config("smollm2-gpu"), load_config("smollm2-gpu-drafter")
    assert {k for k in base if base[k] != child[k]} == {"models", "name", "workdir"}
    assert list(child["models"]) == ["drafter"] and child["models"]["drafter"] == base["models"]["drafter"]
    assert prompts.stage_key(child, ["a.jsonl"]) == prompts.stage_key(base, ["a.jsonl"])


def test_sections_merge_field_by_field_and_models_replace(tmp_path):
    base = json.loads(resolve_config_path("toy").read_text())
    child = tmp_path / "child.json"
    child.write_text(json.dumps({"extends": "toy", "train": {"epochs": 9},
                                 "models": {"drafter": base["models"]["drafter"]}}))
    cfg = load_config(str(child))
    assert cfg["train"]["epochs"] == 9
    assert cfg["train"]["lr"] == load_config("toy")["train"]["lr"]  # the other fields of the section: the base's
    assert list(cfg["models"]) == ["drafter"] and len(base["models"]) > 1
    # a chain: a grandchild over the child
    grand = tmp_path / "grand.json"
    grand.write_text(json.dumps({"extends": str(child), "seed": 7}))
    g = load_config(str(grand))
    assert g["seed"] == 7 and g["train"]["epochs"] == 9 and list(g["models"]) == ["drafter"]


@pytest.mark.parametrize("extends, msg", [("no-such-preset", "no such config file"),
                                          (3, "extends must be a config name"),
                                          ("SELF", "makes a cycle")])
def test_bad_extends_is_refused(tmp_path, extends, msg):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"extends": str(p) if extends == "SELF" else extends}))
    with pytest.raises(UsageError, match=msg):
        load_config(str(p))


def test_the_continue_preset_draws_fresh_data_and_trains_the_drafter_then_its_heads():
    """smollm2-gpu-continue (the next H200 run, results/perf/NOTES.md): the pool's unused parts (192 on) and a
    second round of Magpie prompts, the drafter continued (train.warm_start, which training_gpu.sh start sets) for
    3 epochs of that fresh data after its step (train.warm_mode=extend: with resume, the shipped drafter's step
    3,588 would be past 3 epochs of about 460 steps (an estimate: about 15 M tokens in 32K-token steps), and the train stage would refuse after the data stages), the
    online target's cache on, then xPress and gated Markov on it, frozen; everything else is smollm2-gpu's."""
    base, cont = load_config("smollm2-gpu"), load_config("smollm2-gpu-continue")
    assert {k for k in base if base[k] != cont[k]} == {"models", "name", "workdir", "prompts", "responses", "train"}
    assert {k for k in base["train"] if base["train"][k] != cont["train"][k]} == {"taps_cache_gib", "warm_mode"}
    assert cont["train"]["warm_mode"] == "extend" and cont["train"]["taps_cache_gib"] == 60
    assert {k for k in base["prompts"] if base["prompts"][k] != cont["prompts"][k]} == {"more_magpie"}
    assert cont["prompts"]["more_magpie"] == 52000 and cont["prompts"]["more_round"] == 1
    assert cont["responses"]["first_part"] == 192
    assert list(cont["models"]) == ["drafter", "xpress", "markov_gated"]
    assert cont["models"]["drafter"]["epochs"] == 3
    assert all(cont["models"][h]["init_from"] == "drafter" and cont["models"][h]["freeze_backbone"]
               for h in ("xpress", "markov_gated"))


def test_the_fresh_preset_trains_the_drafter_once_over_twice_the_fresh_data():
    """smollm2-gpu-fresh (a recipe for a later H200 run, results/perf/NOTES.md "Ready for the next GPU session"):
    the continue preset with the parts after those its run used (272 on), 8 minutes of responses (4.5 there), and the
    drafter over that data once (no repeated pass: the continue run's validation loss rose in its second epoch);
    the heads and everything else as smollm2-gpu-continue."""
    cont, fresh = load_config("smollm2-gpu-continue"), load_config("smollm2-gpu-fresh")
    assert {k for k in cont if cont[k] != fresh[k]} == {"models", "name", "workdir", "responses"}
    assert {k for k in cont["responses"] if cont["responses"][k] != fresh["responses"][k]} == \
        {"first_part", "max_minutes"}
    assert fresh["responses"]["first_part"] == 272 and fresh["responses"]["max_minutes"] == 8
    d, c = fresh["models"]["drafter"], cont["models"]["drafter"]
    assert d["epochs"] == 1 and {k for k in d if d[k] != c[k]} == {"epochs", "max_minutes"}
    assert {n: m for n, m in fresh["models"].items() if n != "drafter"} == \
        {n: m for n, m in cont["models"].items() if n != "drafter"}



def test_the_grow_preset_is_the_fresh_one_with_a_drafter_grown_from_the_shipped_one():
    """smollm2-gpu-grow (a recipe for a later H200 run, results/perf/NOTES.md "Ready for the next GPU session"): the
    fresh preset's data and boxes, its drafter grown from the shipped one (training/grow.py) to 8 layers and 5 taps
    (the shipped drafter's 3 among them), the heads on that drafter."""
    fresh, grow = load_config("smollm2-gpu-fresh"), load_config("smollm2-gpu-grow")
    assert {k for k in fresh if fresh[k] != grow[k]} == {"models", "name", "workdir", "hidden"}
    assert {k: v for k, v in grow["hidden"].items() if v != fresh["hidden"][k]} == {"layer_ids": [2, 8, 15, 21, 27]}
    assert set(fresh["hidden"]["layer_ids"]) < set(grow["hidden"]["layer_ids"])
    d, f = grow["models"]["drafter"], fresh["models"]["drafter"]
    assert {k for k in d if d[k] != f[k]} == {"num_layers", "init_from", "grow"}
    assert d["num_layers"] == 8 and d["grow"] and d["init_from"] == "weights/smollm2-135m/drafter"
    for h in ("xpress", "markov_gated"):
        assert {k: v for k, v in grow["models"][h].items() if v != fresh["models"][h][k]} == {"num_layers": 8}


def test_the_round2_preset_continues_the_drafter_on_a_second_magpie_round_with_its_layers_compiled():
    """smollm2-gpu-round2 (the fourteenth session's H200 run, results/perf/NOTES.md): the continue preset's drafter
    on prompts no earlier run saw (Magpie round 2, whose seeds differ from the pool's and round 1's; its parts
    start after the pool's 230 = ceil(58,691 / 256), the model card's pool), 6 minutes of responses, each draft
    layer compiled (train.compile=layers), and the drafter alone: its heads train in a later session."""
    cont, r2 = load_config("smollm2-gpu-continue"), load_config("smollm2-gpu-round2")
    assert {k for k in cont if cont[k] != r2[k]} == {"models", "name", "workdir", "prompts", "responses", "train"}
    assert {k: v for k, v in r2["prompts"].items() if v != cont["prompts"][k]} == {"more_round": 2}
    assert {k: v for k, v in r2["responses"].items() if v != cont["responses"][k]} == \
        {"first_part": 230, "max_minutes": 6}
    assert {k: v for k, v in r2["train"].items() if v != cont["train"][k]} == {"compile": "layers"}
    assert list(r2["models"]) == ["drafter"]
    d, c = r2["models"]["drafter"], cont["models"]["drafter"]
    assert d == c


def test_the_gsm8k_preset_is_round2_over_the_pool_with_six_sampled_answers_to_each_gsm8k_question():
    """smollm2-gpu-gsm8k (a recipe for a later H200 run, results/perf/NOTES.md, the fourteenth session): the runs
    whose data held no GSM8K train question (round2, grow) left gsm8k tau flat or lower, so the pool's parts from
    0 (its Magpie prompts drawn anew by each session's prompts stage), each GSM8K question answered greedily and 6
    times sampled, no Magpie round, and the drafter's τ on the five benchmarks' fixed prompts (reported, read by no
    choice: the selection and held-out sets change when the pool is drawn anew); the rest as smollm2-gpu-round2."""
    r2, g = load_config("smollm2-gpu-round2"), load_config("smollm2-gpu-gsm8k")
    assert {k for k in r2 if r2[k] != g[k]} == {"name", "workdir", "prompts", "responses", "acceptance"}
    assert {k: v for k, v in g["acceptance"].items() if v != r2["acceptance"][k]} == \
        {"bench": ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]}
    assert {k: v for k, v in g["prompts"].items() if v != r2["prompts"][k]} == {"more_magpie": 0}
    assert {k: v for k, v in g["responses"].items() if v != r2["responses"][k]} == \
        {"first_part": 0, "sampled_by_group": {"gsm8k_train_questions.jsonl": 6}}
    assert g["responses"]["sampled"] == 1 and list(g["models"]) == ["drafter"]


def test_the_gsm8k2_preset_is_gsm8k_with_more_gsm8k_answers_pinned_sets_and_a_restarted_schedule():
    """smollm2-gpu-gsm8k2 (the next run, results/perf/NOTES.md, the fifteenth session): the gsm8k run raised gsm8k τ
    1.055x with its LR on its first run's decay tail (under 4.5e-5 of 6e-4 from its 400th step), so the next one
    answers each GSM8K question 15 times sampled (the Magpie prompts greedily only), restarts the schedule at the warm
    step with half the first run's peak LR, and pins its selection and held-out sets to the gsm8k run's."""
    g, g2 = load_config("smollm2-gpu-gsm8k"), load_config("smollm2-gpu-gsm8k2")
    assert {k for k in g if g[k] != g2[k]} == {"name", "workdir", "prompts", "responses", "train"}
    assert {k: v for k, v in g2["prompts"].items() if v != g["prompts"][k]} == \
        {"eval_sets": "training/data/smollm2_eval_sets"}
    assert {k: v for k, v in g2["train"].items() if v != g["train"][k]} == {"warm_mode": "restart", "lr": 3e-4}
    assert g2["responses"]["sampled_by_group"] == {"gsm8k_train_questions.jsonl": 15, "magpie:chat": 0,
                                                   "magpie:code": 0, "magpie:math": 0}
    assert g["train"]["lr"] == 6e-4 and list(g2["models"]) == ["drafter"]


def test_the_gsm8k3_preset_is_gsm8k2_with_a_longer_drafter_box_over_the_same_stages(tmp_path):
    """smollm2-gpu-gsm8k3 (results/perf/NOTES.md, the sixteenth session): gsm8k2's recipe with only the drafter's box
    longer (14 minutes, where the responses stage took gsm8k2's 6.5), for a session that carries gsm8k2's stages in;
    they are used only if its prompts and responses stage keys are gsm8k2's. Power: any change to the prompts or
    responses sections, the seed or the target, changes a key."""
    g2, g3 = load_config("smollm2-gpu-gsm8k2"), load_config("smollm2-gpu-gsm8k3")
    assert list(g3["models"]) == ["drafter"]
    assert {k: v for k, v in g3["models"]["drafter"].items() if v != g2["models"]["drafter"][k]} == {"max_minutes": 14}
    _same_stages(g2, g3, tmp_path)


def test_the_heads_gsm8k3_preset_trains_heads_long_heads_over_gsm8k3s_stages(tmp_path):
    """smollm2-gpu-heads-gsm8k3: the shipped heads' recipe (smollm2-gpu-heads-long's models, each init_from the
    drafter folder the device's warm copy fills) over the gsm8k3 run's carried stages, so the job skips the prompts
    and responses stages. Power: a different model set or recipe, or any change to a stage's section, fails."""
    g3, h = load_config("smollm2-gpu-gsm8k3"), load_config("smollm2-gpu-heads-gsm8k3")
    assert h["models"] == load_config("smollm2-gpu-heads-long")["models"]
    assert all(m["init_from"] == "weights/smollm2-135m/drafter" and m["freeze_backbone"] for m in h["models"].values())
    _same_stages(g3, h, tmp_path)


def test_the_xpress_long_preset_is_the_shipped_xpress_head_with_a_longer_box_alone(tmp_path):
    """smollm2-gpu-heads-xpress-long (results/perf/NOTES.md, "After the eighteenth session"): the shipped xPress
    recipe with a 14-minute box and 3 epochs (the shipped head's 6-minute box fitted under one), no Markov head, over
    the same carried stages, so its held-out tau pairs with the shipped head's. Power: any other recipe change fails."""
    h, x = load_config("smollm2-gpu-heads-gsm8k3"), load_config("smollm2-gpu-heads-xpress-long")
    assert list(x["models"]) == ["xpress"]
    diff = {k: v for k, v in x["models"]["xpress"].items() if v != h["models"]["xpress"][k]}
    assert diff == {"epochs": 3, "max_minutes": 14.0} and set(x["models"]["xpress"]) == set(h["models"]["xpress"])
    _same_stages(h, x, tmp_path)


def test_the_xpress_cotrain_preset_moves_the_drafter_at_the_drafters_rate(tmp_path):
    """smollm2-gpu-heads-xpress-cotrain (results/perf/NOTES.md, "After the nineteenth session"): the shipped xPress
    recipe co-trained with its drafter, as the paper's recipe trains it (base anchor term on), the head at the shipped
    head's 1e-2 and the drafter at 6e-4 (the paper's rate), an 11-minute box, alone, over the same stages."""
    h, x = load_config("smollm2-gpu-heads-gsm8k3"), load_config("smollm2-gpu-heads-xpress-cotrain")
    assert list(x["models"]) == ["xpress"]
    diff = {k: v for k, v in x["models"]["xpress"].items() if v != h["models"]["xpress"][k]}
    assert diff == {"freeze_backbone": False, "backbone_lr_scale": 0.06, "epochs": 3, "max_minutes": 11.0}
    assert x["models"]["xpress"]["lr"] * 0.06 == pytest.approx(6e-4)
    assert x["models"]["xpress"]["base_anchor_weight"] > 0  # training/train.py passes it when the drafter trains
    _same_stages(h, x, tmp_path)


def _same_stages(a: dict, b: dict, tmp_path) -> None:
    """b differs from a only in its models, and its prompts and responses stages have a's keys (so a's carried stages
    are b's, up to date)."""
    from training import prompts, responses
    from training.store import write_json
    assert {k for k in a if a[k] != b[k]} == {"name", "workdir", "models"}
    files = ["data/eval/gsm8k.jsonl"]
    assert prompts.stage_key(b, files, "pinned") == prompts.stage_key(a, files, "pinned")
    for c in (a, b):
        c["workdir"] = str(tmp_path)
    (tmp_path / "prompts").mkdir()
    write_json(tmp_path / "prompts" / "manifest.json", {"key": prompts.stage_key(a, files, "pinned")})
    assert responses.stage_key(b) == responses.stage_key(a)


def test_the_xpress_rank_160_preset_changes_the_rank_alone(tmp_path):
    """smollm2-gpu-heads-xpress-r160 (results/perf/NOTES.md, "After the twentieth session"): the shipped xPress recipe,
    drafter frozen, at rank 160 instead of 80, a capacity test (the paper's 256 puts 24 MiB in one tensor over
    SmolLM2's vocabulary, over the 16 MiB a file may hold; training.export.check_fit); a 9-minute box, alone, over
    the same stages. Power: any other recipe change fails."""
    h, x = load_config("smollm2-gpu-heads-gsm8k3"), load_config("smollm2-gpu-heads-xpress-r160")
    assert list(x["models"]) == ["xpress"]
    diff = {k: v for k, v in x["models"]["xpress"].items() if v != h["models"]["xpress"][k]}
    assert diff == {"xpress_rank": 160, "epochs": 3, "max_minutes": 9.0}
    assert x["models"]["xpress"]["freeze_backbone"] is True
    _same_stages(h, x, tmp_path)
