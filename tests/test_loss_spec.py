"""models.<name>.loss_fn (training/loss_spec.py): what a user writes for speculators' loss spec is checked with the
config, before any stage runs. A weights mapping given as JSON (a config file's object, or `--set` with a JSON value,
which the override parses) becomes the JSON string speculators 0.9.0 takes; before, it reached speculators as a dict
and failed in the train stage, after the target had loaded ("unhashable type: 'dict'"). Unknown names and weights
that are not numbers > 0 are refused in one line that says how to write it."""
import json

import pytest

from core.errors import UsageError
from training import loss_spec
from training.config import load_config


def test_a_weights_mapping_from_set_becomes_the_string_speculators_takes():
    cfg = load_config("toy", ['models.xpress.loss_fn={"ce": 0.1, "tv": 1.8}'])
    assert cfg["models"]["xpress"]["loss_fn"] == '{"ce": 0.1, "tv": 1.8}'
    kept = load_config("toy", ['models.xpress.loss_fn="{\\"ce\\":0.2,\\"tv\\":0.8}"'])  # a string stays as written
    assert kept["models"]["xpress"]["loss_fn"] == '{"ce":0.2,"tv":0.8}'
    assert load_config("toy", ["models.xpress.loss_fn=kl_div"])["models"]["xpress"]["loss_fn"] == "kl_div"
    assert load_config("toy")["models"]["xpress"]["loss_fn"] == '{"ce": 0.1, "tv": 0.9}'  # the default, untouched


@pytest.mark.parametrize("value, named", [('{"ce": 0.1, "tvd": 0.9}', "'tvd': 0.9"), ('{"ce": -1}', "'ce': -1"),
                                          ('{}', "not a name"), ('"{not json"', "not a name"), ('"mse"', "not a name"),
                                          ('[1, 2]', "not a name"), ('{"tv": true}', "'tv': True"),
                                          ('{"tv": 1e999}', "'tv': inf")])
def test_a_bad_loss_spec_is_refused_with_the_config(value, named):
    with pytest.raises(UsageError, match=r"config models\.xpress: loss_fn .* is not a loss name") as e:
        load_config("toy", [f"models.xpress.loss_fn={value}"])
    assert "\n" not in str(e.value) and "--set 'models.NAME.loss_fn=" in str(e.value) and f"({named}" in str(e.value)


def test_the_names_are_speculators_own():
    """NAMES restates speculators 0.9.0's; where speculators is installed they must be its loss maps' keys (a name
    it dropped would pass here and fail in the train stage; one it added would be refused here)."""
    utils = pytest.importorskip("speculators.losses.utils")
    for impl in ("fused", "eager"):
        assert sorted(utils._LOSS_FN_MAPS[impl]) == list(loss_spec.NAMES), impl
    for spec in loss_spec.NAMES + (json.dumps({"ce": 0.1, "tv": 0.9}),):
        assert utils.resolve_loss_config(spec, "eager")  # what passes here, speculators takes


# models.<name>.per_position_loss_weight / dpace_alpha (training/loss_spec.py check_positions): speculators 0.9.0's
# weights of a block's slots, checked with the config and passed to its trainer (training.train.trainer_kwargs)

def test_slot_weights_default_to_what_ran_before_and_take_dpace_with_ce_alone():
    m = load_config("toy")["models"]["drafter"]
    assert (m["per_position_loss_weight"], m["dpace_alpha"]) == ("fixed-exp-decay", 0.5)
    for loss in ("ce", '{"ce": 2.0}'):
        m = load_config("toy", ["models.drafter.per_position_loss_weight=dpace", f"models.drafter.loss_fn={loss}",
                                "models.drafter.dpace_alpha=0.25"])["models"]["drafter"]
        assert (m["per_position_loss_weight"], m["dpace_alpha"]) == ("dpace", 0.25)
    # the defaults leave a model's key as it was (tests/test_training_anchor_bias.py pins the presets' keys); another
    # weighting is another model, so a checkpoint of one does not resume as the other
    from training.config import model_fingerprint
    dpace = ["models.drafter.per_position_loss_weight=dpace"]
    cfgs = [load_config("toy", ["models.drafter.loss_fn=ce"] + extra) for extra in
            ([], dpace, dpace + ["models.drafter.dpace_alpha=0.25"])]
    assert len({model_fingerprint(c, "drafter") for c in cfgs}) == 3


@pytest.mark.parametrize("sets, says", [(["per_position_loss_weight=linear"], "'linear' is not one of"),
                                        (["dpace_alpha=0"], r"dpace_alpha must be a number in \(0, 1\]"),
                                        (["dpace_alpha=true"], r"\(got True\)"), (["dpace_alpha=1.5"], "got 1.5"),
                                        (["dpace_alpha=0.3"], "read only with per_position_loss_weight dpace"),
                                        (["per_position_loss_weight=dpace"], "cross-entropy alone"),
                                        (["per_position_loss_weight=dpace", "loss_fn=tv"], "cross-entropy alone")])
def test_bad_slot_weights_are_refused_with_the_config(sets, says):
    with pytest.raises(UsageError, match=says) as e:
        load_config("toy", [f"models.xpress.{s}" for s in sets])
    assert "\n" not in str(e.value) and str(e.value).startswith("config models.xpress: ")


def test_the_slot_weights_reach_speculators_trainer_for_every_model_type():
    """What training.train hands speculators' get_trainer_kwargs (its train and val forward's keywords) carries the
    two fields for a drafter and both heads; without them speculators falls back to fixed-exp-decay silently."""
    registry = pytest.importorskip("speculators.model").SpeculatorModel.registry
    from training.train import trainer_kwargs
    base = load_config("toy", ["models.drafter.per_position_loss_weight=dpace", "models.drafter.loss_fn=ce",
                               "models.drafter.dpace_alpha=0.3"])["models"]["drafter"]
    for kind in ("dflash", "xpress", "dspark"):
        for kw in registry[kind].get_trainer_kwargs(**trainer_kwargs({**base, "type": kind}))[:2]:
            assert (kw["per_position_loss_weight"], kw["dpace_alpha"]) == ("dpace", 0.3), kind
