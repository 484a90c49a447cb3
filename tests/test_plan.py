"""The run plan (harness.protocol.plan) and the command line's settled values: one frozen plan per run, the env
variables read by the CLI alone, --drafter-only with the embedded default, --refine-numerics spyre without
graphs, what a bad --results-dir says, the record of a resume, and presize's bound over every turn."""
import dataclasses
import json
from types import SimpleNamespace

import pytest

import benchmark_compile_all as cli
from core.errors import UsageError
from harness.protocol import report, results_io, runner, setups
from harness.protocol.build import prepare
from harness.protocol.data import Sample, render_prompt
from harness.protocol.flags import parse_args
from harness.protocol.presets import ByteTokenizer

RANDOM = ["--random-weights", "tiny", "--dataset", "mini", "--device", "cpu"]
pytestmark = pytest.mark.usefixtures("no_plots_module")  # no check here reads a plot


@pytest.fixture()
def data(tmp_path):
    (tmp_path / "mini.jsonl").write_text('{"turns": ["Add 2 and 3."]}\n{"turns": ["Name a colour.", "Another?"]}\n')
    return tmp_path


@pytest.fixture()
def embedded(tmp_path, monkeypatch):
    """The embedded default on stub weights (config.json only): enough for everything before a model loads."""
    weights = tmp_path / "w"
    for sub in ("drafter", "xpress", "markov"):
        (weights / sub).mkdir(parents=True)
        (weights / sub / "config.json").write_text("{}")
    monkeypatch.setenv(setups.WEIGHTS_ENV, str(weights))
    monkeypatch.setattr(setups, "embedded_target", lambda: str(weights / "drafter"))
    for var in ("XPRESS_CKPT", "MK_CKPT"):
        monkeypatch.delenv(var, raising=False)
    return weights


def test_the_plan_is_frozen_and_holds_the_rank_device_not_a_replaced_config(data, tmp_path):
    """The rank's device, the folder and the resume folder live in the plan; the run config stays as given
    (the old code replaced the RunConfig for the device, the resume and Spyre's K and C)."""
    cfg = parse_args(["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(data),
                      "--results-dir", str(tmp_path)])
    plan = prepare(cfg, device="cpu", folder=str(tmp_path / "f"), resume=None)
    assert plan.config is cfg and cfg.device is None and plan.device == "cpu" and plan.run_id == "f"
    assert plan.passes == cfg.xpress_refine_passes and plan.k_list == cfg.k_list
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.block_size = 2


def test_refiner_env_variables_are_read_by_the_command_line(data, tmp_path, monkeypatch):
    """XPRESS_CKPT / MK_CKPT are the path flags' defaults, read in flags (refiners.formats takes a path only):
    the run config holds the path; an empty variable leaves the arm out; --random-weights reads neither."""
    ck = tmp_path / "x.pt"
    ck.write_bytes(b"x")
    named = ["--model-name-or-path", str(tmp_path), "--draft-name-or-path", str(tmp_path), "--dataset", "mini",
             "--data-dir", str(data), "--results-dir", str(tmp_path)]
    monkeypatch.setenv("XPRESS_CKPT", str(ck))
    monkeypatch.setenv("MK_CKPT", "")
    cfg = parse_args(named)
    assert cfg.xpress_refiner_path == str(ck) and cfg.markov_refiner_path is None
    assert parse_args(named + ["--xpress-refiner-path", str(tmp_path)]).xpress_refiner_path == str(tmp_path)
    assert parse_args(RANDOM + ["--data-dir", str(data)]).xpress_refiner_path is None


def test_drafter_only_with_the_embedded_default_runs_ar_against_the_drafter(embedded, tmp_path, monkeypatch):
    """--drafter-only alone used to fail on --fair-interleave, a flag never typed (the embedded default's paired
    protocol): now the setup's heads are left out and the paired rounds compare AR with the drafter alone."""
    cfg = parse_args(["--drafter-only", "--device", "cpu", "--results-dir", str(tmp_path)])
    assert cfg.drafter_only and cfg.fair and cfg.xpress_refiner_path is None and cfg.markov_refiner_path is None
    rand = parse_args(["--drafter-only", "--preset", "smollm2-135m", "--random-weights", "tiny", "--device", "cpu",
                       "--results-dir", str(tmp_path)])
    assert [a.name for a in prepare(rand).arms] == ["AR", "drafter-only"]
    k0 = parse_args(RANDOM[:2] + ["--drafter-only", "--xpress-refine-passes", "0", "--results-dir", str(tmp_path)])
    assert [a.name for a in prepare(k0).arms] == ["AR", "drafter-only"]  # K=0 is drafter-only: no contradiction
    monkeypatch.setenv("XPRESS_CKPT", str(embedded / "xpress"))  # a refiner the user asked for elsewhere
    with pytest.raises(UsageError) as e:
        parse_args(["--drafter-only", "--device", "cpu", "--results-dir", str(tmp_path)])
    msg = str(e.value)
    assert "--drafter-only" in msg and "$XPRESS_CKPT" in msg and "--fair-interleave" not in msg
    assert "\n" not in msg


def test_the_embedded_default_needs_only_the_weights_its_arms_load(embedded, tmp_path):
    """A weights folder with only drafter/ was refused for --drafter-only ("xpress/config.json is missing"), which
    loads no head; --ar-only needs no drafter either; a run of every arm still needs every piece."""
    import shutil
    shutil.rmtree(embedded / "xpress")
    shutil.rmtree(embedded / "markov")
    base = ["--device", "cpu", "--results-dir", str(tmp_path)]
    cfg = parse_args(base + ["--drafter-only"])
    assert cfg.xpress_refiner_path is None and cfg.markov_refiner_path is None
    with pytest.raises(UsageError, match="xpress/config.json is missing"):
        parse_args(base)
    (embedded / "drafter" / "config.json").unlink()  # the folder stays: the fixture's stand-in target
    assert parse_args(base + ["--ar-only"]).draft_name_or_path is None


def test_spyre_numerics_refuse_cuda_graphs_and_setups_leave_them_off(tmp_path):
    """--refine-numerics spyre copies to the host inside the step: --use-graph is refused before any load, and
    a CUDA setup (which turns graphs on) leaves them off."""
    spyre = ["--refine-numerics", "spyre", "--xpress-topc", "4", "--results-dir", str(tmp_path)]
    with pytest.raises(UsageError, match="--no-use-graph"):
        parse_args(RANDOM + spyre + ["--use-graph"])
    cfg = parse_args(["--preset", "paper", "--random-weights", "tiny", "--device", "cuda", *spyre])
    assert cfg.use_graph is False
    assert parse_args(["--preset", "paper", "--random-weights", "tiny", "--device", "cuda",
                       "--results-dir", str(tmp_path)]).use_graph is True  # the setup's default otherwise


def test_a_bad_results_dir_says_what_is_wrong_with_it(tmp_path):
    """The old line said "pass --results-dir" to a user who had passed it."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(UsageError) as e:
        parse_args(RANDOM + ["--results-dir", str(tmp_path / "afile")])
    assert "is a file, not a folder" in str(e.value) and "pass --results-dir" not in str(e.value)
    with pytest.raises(UsageError) as e:
        parse_args(RANDOM + ["--results-dir", "/proc/xpress-bench-results"])
    assert "is not a writable directory" in str(e.value) and "pass --results-dir" not in str(e.value)


def test_a_resume_is_recorded_in_the_folder(data, tmp_path, capsys):
    """A resumed run appends to resumes.json when it resumed and how many finished decodes it reused (nothing
    recorded it before); config.json keeps --device as given and the rank's device under resolved."""
    argv = RANDOM + ["--data-dir", str(data), "--max-new-tokens", "4", "--results-dir", str(tmp_path),
                     "--run-id", "r", "--quiet"]
    assert cli.main(argv) == 0
    folder = tmp_path / "r"
    assert not (folder / "resumes.json").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["device"] == "cpu" and config["resolved"]["device"] == "cpu"
    assert "resumed" not in (folder / "table.md").read_text().splitlines()[0]
    kept = results_io.read_folder_rows(folder)[:2]  # as if it stopped after two decodes: plain rows, no .gz
    (folder / "samples.jsonl.gz").unlink()
    results_io.append_rows(folder / "samples.jsonl", kept)
    assert cli.main(["--resume", str(folder), "--quiet"]) == 0
    (entry,) = json.loads((folder / "resumes.json").read_text())
    assert entry["reused_decodes"] == len({(r["round"], r["arm"], r["question_id"]) for r in kept})
    assert entry["total_decodes"] == len(config["resolved"]["arms"]) * 2 and entry["time_utc"].endswith("Z")
    assert "recorded in resumes.json" in capsys.readouterr().out
    # its tables say so (a round may span two processes), and a rebuild from the rows keeps the label
    label = "resumed 1x: some rounds ran in more than one process"
    assert label in (folder / "table.md").read_text().splitlines()[0]
    assert label in " ".join(report.rebuild(str(folder))["labels"])
    # under torchrun each rank records its own resumes (resumes.rank{r}.json): those count too
    (folder / "resumes.json").rename(folder / "resumes.rank1.json")
    (folder / "resumes.rank0.json").write_text("[]")
    assert label in " ".join(report.rebuild(str(folder))["labels"])



def test_presize_sizes_the_caches_for_later_turns(data, tmp_path, monkeypatch):
    """A two-turn prompt: presize asks for the second turn's bound (its user turns + max_new_tokens per earlier
    reply + max_new_tokens), not the first turn's length (the old size: a longer later turn grew the cache and
    recaptured the CUDA graphs inside a measured round)."""
    tok = ByteTokenizer(512)
    samples = [Sample("mini", 0, ("Add 2 and 3.",)), Sample("mini", 1, ("Name a colour.", "Another?"))]
    firsts = [tuple(render_prompt(tok, [{"role": "user", "content": s.turns[0]}])) for s in samples]
    bound = runner.prompt_bound(samples, firsts, tok, 7, first_turn_only=False)
    second = render_prompt(tok, [{"role": "user", "content": "Name a colour."},
                                 {"role": "assistant", "content": "x" * 7}, {"role": "user", "content": "Another?"}])
    assert bound >= len(second) > max(map(len, firsts))
    assert runner.prompt_bound(samples, firsts, tok, 7, first_turn_only=True) == max(map(len, firsts))
    asked = []
    target = SimpleNamespace(ensure_capacity=asked.append)
    settings = SimpleNamespace(max_model_len=4096, max_new_tokens=7, graph_bucket=16, use_graph=False)
    runner.presize(target, [], bound, settings, block=4)
    assert asked == [-(-(bound + 7 + 4 + 1) // 16) * 16]
    seen = []  # and a run hands presize that bound: every row's prompt fits below it
    real = runner.presize
    monkeypatch.setattr(runner, "presize", lambda t, arms, longest, s, b: seen.append(longest) or
                        real(t, arms, longest, s, b))
    assert cli.main(RANDOM + ["--data-dir", str(data), "--max-new-tokens", "4", "--ar-only", "--results-dir",
                              str(tmp_path), "--run-id", "p", "--quiet"]) == 0
    rows = results_io.read_folder_rows(tmp_path / "p")
    assert max(r["prompt_tokens"] for r in rows if r["turn"] == 1) <= seen[0]


def test_a_folder_written_before_a_flag_existed_still_resumes(tmp_path):
    """config.json of a run made before a flag was added lacks it; the flag's default (plan.ADDED_LATER) stands in,
    so --resume does not report other settings (--refill's absence broke every older folder's resume); a missing
    setting without such a default is named as an older version's, not as flags to drop."""
    import dataclasses
    from harness.protocol import plan as plan_mod
    from harness.protocol.config import RunConfig
    cfg = RunConfig(model_name_or_path="m", draft_name_or_path="d", dataset="gsm8k")
    saved = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in plan_mod.ADDED_LATER}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    plan_mod.check_resume(cfg, str(tmp_path))  # no error
    assert {"refill", "batch_sizes", "context_lengths", "batch_invariant"} <= set(plan_mod.ADDED_LATER)
    # a setting that is neither recorded nor in ADDED_LATER: an older version's folder, not the user's flags (a
    # new-user trial was told to "drop" flags it never passed)
    del saved["fp32_logits"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UsageError, match=r"written by an older version of the harness \(it records no "
                                         r"--fp32-logits\), which this one cannot continue; start a new run"):
        plan_mod.check_resume(cfg, str(tmp_path))


def test_config_json_says_which_k_each_xpress_arm_ran(data, tmp_path):
    """config.json's resolved section: `xpress_ks` lists the K of every xPress arm, and `xpress_refine_passes` is
    the K only where no --fair-k-list replaced it (it read 3, the flag's default, beside arms run at K=1,2,4).
    Power: the old record gives 3 under the list, and no xpress_ks."""
    base = ["--random-weights", "tiny", "--dataset", "mini", "--data-dir", str(data), "--results-dir", str(tmp_path)]
    listed = prepare(parse_args(base + ["--fair-interleave", "--fair-k-list", "1,2,4"]), device="cpu").resolved()
    assert listed["xpress_ks"] == [1, 2, 4] and listed["xpress_refine_passes"] is None
    one = prepare(parse_args(base + ["--xpress-refine-passes", "5"]), device="cpu").resolved()
    assert one["xpress_ks"] == [5] and one["xpress_refine_passes"] == 5


def test_skip_ar_leaves_ar_out_of_the_random_weights_paired_rounds(data, tmp_path):
    """--skip-ar --fair-interleave with --random-weights ran AR anyway (its paired branch always added it), while
    real models and the embedded default left it out (build.plan_arms)."""
    base = RANDOM + ["--data-dir", str(data), "--results-dir", str(tmp_path), "--fair-interleave", "--skip-ar"]
    assert [a.name for a in prepare(parse_args(base)).arms] == ["drafter-only", "Markov", "xPress(K=3)"]
    assert [a.name for a in prepare(parse_args(base + ["--drafter-only"])).arms] == ["drafter-only"]


def test_a_first_turn_with_no_room_to_speculate_is_refused_before_loading(data, tmp_path, capsys, monkeypatch,
                                                                         no_plots):
    """--max-model-len below a first turn + block + 1: the decode loop, which speculates only while pos + block <
    the limit, never took a speculative step, and the table printed the speculative arms' AR-like speedups without
    a word. Now one line before any model loads, nothing written; at prompt + block + 1 the arm speculates (the
    loop's own rule), and a run without a speculative arm needs no such room."""
    from harness.protocol import plan as plan_mod, presets
    samples = [Sample("mini", 0, ("Add 2 and 3.",)), Sample("mini", 1, ("Name a colour.", "Another?"))]
    firsts = [tuple(render_prompt(ByteTokenizer(512), [{"role": "user", "content": s.turns[0]}])) for s in samples]
    need = len(firsts[1]) + 16 + 1  # the longer first turn, the random presets' block 16
    argv = RANDOM + ["--data-dir", str(data), "--max-new-tokens", "4", "--results-dir", str(tmp_path / "r"),
                     "--run-id", "p", "--quiet"]
    real = presets.build_random
    monkeypatch.setattr(presets, "build_random", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(argv + ["--max-model-len", str(need - 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"error: prompt 1 (dataset row 1) has {len(firsts[1])} tokens: with block 16 "
                                     f"a speculative step needs {need} positions, over the context limit "
                                     f"{need - 1}") in err and f"raise --max-model-len to {need}" in err, err
    assert not (tmp_path / "r").exists()
    tight = dict(block_size=16, max_model_len=need - 1)
    plan_mod.check_room(SimpleNamespace(arms=(plan_mod.ArmSpec("AR", "ar"),), resume=None, **tight),
                        samples, firsts)  # AR alone: no error
    spec = (plan_mod.ArmSpec("AR", "ar"), plan_mod.ArmSpec("drafter-only", "drafter-only"))
    with pytest.raises(UsageError, match="no speculative arm would speculate"):
        plan_mod.check_room(SimpleNamespace(arms=spec, resume=None, target_config=None, **tight), samples, firsts)
    short = SimpleNamespace(max_position_embeddings=need - 1)  # a target without that many positions
    with pytest.raises(UsageError, match=f"the target has {need - 1} positions, so run fewer or shorter prompts"):
        plan_mod.check_room(SimpleNamespace(arms=spec, resume=None, target_config=short, **tight), samples, firsts)
    # a folder that started so (before this check) resumes as it started: its summary carries the context label
    plan_mod.check_room(SimpleNamespace(arms=spec, resume="results/old", target_config=None, **tight), samples, firsts)
    monkeypatch.setattr(presets, "build_random", real)
    assert cli.main(argv + ["--max-model-len", str(need), "--drafter-only", "--skip-ar"]) == 0
    rows = results_io.read_folder_rows(tmp_path / "r" / "p")
    assert [r["spec_steps"] for r in rows if r["question_id"] == 1 and r["turn"] == 0 and r["method"] != "ar"] == [1]


def test_a_folder_started_with_a_flag_now_refused_as_without_effect_still_resumes(tmp_path):
    """A run folder saved with a flag that had no effect (greedy drafts with --draft-noise uniform, refused for new
    runs since) is not refused on --resume, which cannot drop a saved flag: it goes on as it started."""
    saved = {"model_name_or_path": "t", "draft_name_or_path": "d", "dataset": "x", "draft_noise": "uniform",
             "temperature": 0.0}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    assert parse_args(["--resume", str(tmp_path / "r")]).draft_noise == "uniform"
    with pytest.raises(UsageError, match="--draft-noise uniform is the noise of sampled drafts"):
        parse_args(["--model-name-or-path", "t", "--draft-name-or-path", "d", "--dataset", "x", "--draft-noise",
                    "uniform"])



def test_an_arm_names_a_refiners_drafter_only_where_the_refiner_carries_one(data, tmp_path):
    """build.plan_arms, the one list of arms for checkpoints and --random-weights alike (build.RandomHead): the
    drafter-only arm of a refiner run is "co-trained", and runs that refiner's drafter, only where its checkpoint
    carries one; a head trained on a frozen drafter (no draft_state) has its drafter-only arm on the base drafter,
    named so. Power: the old list named every such arm "co-trained" and pointed it at the checkpoint."""
    from harness.protocol.build import plan_arms
    from harness.protocol.plan import ArmSpec
    base = RANDOM + ["--data-dir", str(data), "--results-dir", str(tmp_path)]
    head = SimpleNamespace(kind="xpress", draft_state=None)
    own = SimpleNamespace(kind="xpress", draft_state={"w": 0})
    alone = parse_args(base + ["--drafter-only"])
    assert plan_arms(alone, {"xpress": head}, 3, 0, [3])[-1] == ArmSpec("drafter-only", "drafter-only")
    assert plan_arms(alone, {"xpress": own}, 3, 0, [3])[-1] == ArmSpec("drafter-only (co-trained)", "drafter-only",
                                                                      weights="xpress")
    paired = parse_args(base + ["--fair-interleave"])
    assert [a.weights for a in plan_arms(paired, {"xpress": head}, 3, 0, [3])] == [None, None, None]
    assert [a.weights for a in plan_arms(paired, {"xpress": own}, 3, 0, [3])] == [None, None, "xpress"]


def test_a_resume_whose_arms_this_version_names_otherwise_is_refused(data, tmp_path):
    """plan.check_resume_arms, on the --random-weights path too (the run path: test_tiny_runs' resume test): the
    arms in the folder's config.json against the plan's, before any model loads."""
    cfg = parse_args(RANDOM + ["--data-dir", str(data), "--results-dir", str(tmp_path), "--fair-interleave"])
    folder = tmp_path / "old"
    folder.mkdir()
    arms = [a.name for a in prepare(cfg).arms]
    (folder / "config.json").write_text(json.dumps({"resolved": {"arms": arms}}))
    assert prepare(cfg, resume=str(folder)).arm_names == arms
    (folder / "config.json").write_text(json.dumps({"resolved": {"arms": arms[:-1] + ["xPress(K=9)"]}}))
    with pytest.raises(UsageError, match=r"the run was started with .*xPress\(K=9\)"):
        prepare(cfg, resume=str(folder))
