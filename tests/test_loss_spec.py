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
