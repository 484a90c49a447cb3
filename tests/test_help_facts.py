"""What --help states is derived from the code and the README states the same: the random-weights presets (the
help once listed three of five, without gemma4-26b-a4b) and the CPU main job's wall time (the help once said
"~4 min", the README 2 min 34 s)."""
import re
from pathlib import Path

import pytest

import benchmark_compile_all as cli
from harness.protocol import setups
from harness.protocol.preset_names import RANDOM_PRESETS

ROOT = Path(__file__).resolve().parents[1]


def flat_help(capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_torch_free_preset_names_are_the_presets():
    from harness.protocol.presets import PRESETS
    assert RANDOM_PRESETS == tuple(PRESETS)


def test_help_lists_every_random_weights_preset(capsys):
    assert f"at real shapes ({', '.join(RANDOM_PRESETS)})" in flat_help(capsys)


def test_readme_and_help_quote_the_same_cpu_main_job_time(capsys):
    readme = " ".join(re.sub(r"<!--.*?-->", "", (ROOT / "README.md").read_text()).split())  # readme_numbers' markers
    quoted = re.search(r"on this 2-core machine it took (.+?) of wall time", readme)
    assert quoted, "README.md no longer says 'on this 2-core machine it took X of wall time'"
    assert quoted.group(1) == setups.wall_time(setups.CPU_MAIN_JOB_WALL_S)
    assert f"tau and speedup table, {quoted.group(1)} on 2 CPU cores" in flat_help(capsys)


def test_wall_time_reads_as_the_readme_writes_it():
    assert [setups.wall_time(s) for s in (154, 60, 59)] == ["2 min 34 s", "1 min 0 s", "59 s"]


def test_help_marks_the_flags_a_setup_fills(capsys):
    """The embedded default runs 3 prompts of 48 tokens on the CPU, not the parser's "every row" and 16384: each flag
    a setup fills says that its untyped value is the setup's (a new user read the parser defaults as the run's)."""
    from harness.protocol.flags import build_parser
    mark = "untyped, a setup's value wins (setups, below)"
    p = build_parser()
    fmt = p._get_formatter()
    marked = {a.dest for a in p._actions if mark in fmt._get_help_string(a)}
    by_env = {a.dest for a in p._actions if "if set, else a setup's value" in fmt._get_help_string(a)}
    filled = set(setups.defaults(setups.EMBEDDED, "cpu", 0.0)) | set(setups.defaults(setups.PAPER, "cuda", 1.0))
    assert marked | by_env == filled & {a.dest for a in p._actions} and not marked & by_env
    assert by_env == set(setups.ENV_OF)  # the refiners' environment variables beat the setup (setups.apply)
    assert {"max_samples", "max_new_tokens", "fair_warmup_rounds", "dataset"} <= marked
    assert "temperature" not in marked and "seed" not in marked
    assert mark in flat_help(capsys)  # and --help prints it
