"""--device spyre with --batch-sizes (issue 29, item 4): Spyre serves 1..4 requests at once (3 runs padded to 4 on
the card) with 31 token slots per request (31, 62, 93, 124 for B = 1..4), and refuses anything else, in one line,
before any model loads."""
from types import SimpleNamespace

import pytest

import benchmark_compile_all as cli
from core.errors import UsageError
from harness.protocol import spyre_contract as sc
from harness.protocol.flags import parse_args

TABLE = {1: 31, 2: 62, 3: 93, 4: 124}
PADDED = {1: 1, 2: 2, 3: 4, 4: 4}
TCFG = SimpleNamespace(vocab_size=151936)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tiny import write_run_fixture
    return write_run_fixture(tmp_path_factory.mktemp("spyre_batch"), [{"turns": ["Add 2 and 3."]}])


def argv(target, drafter, root, *extra):
    return ["--model-name-or-path", str(target), "--draft-name-or-path", str(drafter), "--dataset", "mini",
            "--data-dir", str(root / "data"), "--results-dir", str(root / "results"), "--device", "spyre", *extra]


def cfg(*extra):
    return parse_args(["--model-name-or-path", "t", "--draft-name-or-path", "d", "--dataset", "x", "--device",
                       "spyre", *extra])


def test_the_table_of_served_batches_and_budgets():
    assert sc.SERVED_BATCHES == (1, 2, 3, 4) and sc.BUDGETS == TABLE
    assert {b: sc.batch_budget(b) for b in TABLE} == {b: sc.per_request_budget() * b for b in TABLE}
    assert {b: sc.padded_batch(b) for b in TABLE} == PADDED


@pytest.mark.parametrize("b", TABLE)
def test_b_up_to_4_is_accepted_with_its_budget_and_3_is_padded_to_4(b):
    c = cfg("--batch-sizes", str(b), "--max-num-batched-tokens", str(TABLE[b]))  # config.validate: no refusal
    plan = sc.check_models(c, TCFG, 16)
    assert plan.budget == TABLE[b] and plan.batch_sizes == (b,) and plan.padded == (PADDED[b],)
    assert 16 * PADDED[b] in plan.compile_sizes
    assert ("3 padded to 4" in plan.describe()) == (b == 3)


def test_a_sweep_of_1_to_4_records_every_padded_size_and_the_default_budget_serves_it():
    plan = sc.check_models(cfg("--batch-sizes", "4,3,2,1"), TCFG, 16)
    assert plan.batch_sizes == (1, 2, 3, 4) and plan.padded == (1, 2, 4, 4)
    assert plan.budget == 128 and plan.compile_sizes == (1, 16, 32, 64, 128)  # the Spyre docs' advice for 4
    assert "batch sizes [1, 2, 3, 4] (3 padded to 4 on the card)" in plan.describe()
    assert sc.check_models(cfg("--batch-sizes", "2"), TCFG, 16).budget == 64


def test_one_request_is_as_before():
    plan = sc.check_models(cfg(), TCFG, 16)
    assert (plan.budget, plan.compile_sizes, plan.batch_sizes, plan.padded) == (64, (1, 16, 64), (1,), (1,))
    assert "batch" not in plan.describe()


REFUSED = {  # the flags, and what the one-line error says
    "b5": (["--batch-sizes", "5"], "--batch-sizes 5 is not served; Spyre decodes 1 to 4 requests at once"),
    "b0": (["--batch-sizes", "0"], "--batch-sizes 0 is not served; Spyre decodes 1 to 4 requests at once"),
    "b1-8": (["--batch-sizes", "1,2,4,8"], "--batch-sizes 8 is not served; Spyre decodes 1 to 4 requests at once (3 "
                                           "runs padded to 4): use --batch-sizes 1,2,4"),
    "b65": (["--batch-sizes", "65"], "--batch-sizes 65 is not served"),
    "b2-61": (["--batch-sizes", "2", "--max-num-batched-tokens", "61"],
              "--max-num-batched-tokens 61 is below the 62 token slots per step that B=2 requests need"),
    "b4-123": (["--batch-sizes", "1,4", "--max-num-batched-tokens", "123"], "use --max-num-batched-tokens >= 124"),
    "b3-64": (["--batch-sizes", "3", "--max-num-batched-tokens", "64"], "B=3 requests need"),
}


@pytest.mark.parametrize("extra, says", REFUSED.values(), ids=REFUSED)
def test_unserved_batches_fail_before_loading(files, extra, says, capsys, monkeypatch):
    import harness.protocol.build as build
    import harness.protocol.runner as runner
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(build, "load_target_config", lambda *a, **k: pytest.fail("a config was read"))
    monkeypatch.setattr(build, "resolve_backend", lambda *a, **k: pytest.fail("the device was opened"))
    assert cli.main(argv(files / "target", files / "drafter", files, "--run-id", "bad", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and says in err and "\n" not in err, err
    assert not (files / "results" / "bad").exists()


@pytest.mark.parametrize("extra, says", [REFUSED["b5"], REFUSED["b0"], REFUSED["b2-61"]])
def test_the_refusal_comes_before_the_model_paths_are_even_looked_at(tmp_path, extra, says, capsys):
    """A bogus model path: the Spyre contract speaks first (config.validate), so nothing is read at all."""
    assert cli.main(argv(tmp_path / "no-such-model", tmp_path / "no-such-drafter", tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    with pytest.raises(UsageError, match="Spyre decodes 1 to 4 requests"):
        cfg(*REFUSED["b5"][0])


def test_an_accepted_batch_gets_past_the_argument_check_to_the_device(files, capsys, monkeypatch):
    """B=3 with 93 slots: no contract refusal; the run goes on to import torch-spyre (absent here)."""
    from test_spyre_contract import hide_torch_spyre
    hide_torch_spyre(monkeypatch)
    assert cli.main(argv(files / "target", files / "drafter", files, "--batch-sizes", "3",
                         "--max-num-batched-tokens", "93")) == 2
    err = capsys.readouterr().err
    assert "torch-spyre" in err and "--batch-sizes" not in err and "sweep does not take" not in err, err
