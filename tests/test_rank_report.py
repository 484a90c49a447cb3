"""The launcher environment, the shards, and the per-rank report, without launching anything."""
import json

import pytest

from core.errors import UsageError
from harness.protocol import rank_report
from harness.protocol.flags import parse_args
from harness.protocol.distributed import Shard, from_env

LAUNCH = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_single_process_without_launcher_variables():
    s = from_env({"LOCAL_RANK": "0"})  # only RANK / WORLD_SIZE make a rank
    assert not s.launched and s.main and s.rows_path("f") == "f/samples.jsonl" and s.per_rank("t.jsonl") == "t.jsonl"
    assert s.mine(["a", "b"]) == [(0, "a"), (1, "b")]


def test_rank_from_launcher_variables():
    s = from_env(LAUNCH)
    assert (s.rank, s.world, s.local_rank, s.launched, s.main) == (1, 2, 1, True, False)
    assert s.mine(list("abcde")) == [(1, "b"), (3, "d")]
    assert s.rows_path("f") == "f/samples.rank1.jsonl" and s.per_rank("out/t.jsonl") == "out/t.rank1.jsonl"
    assert s.tag([{"a": 1}]) == [{"a": 1, "rank": 1}]


@pytest.mark.parametrize("change, message", [
    ({"MASTER_PORT": None}, "MASTER_PORT unset"),
    ({"LOCAL_RANK": None, "MASTER_ADDR": None}, "LOCAL_RANK, MASTER_ADDR unset"),
    ({"RANK": "x"}, "must be integers"),
    ({"RANK": "2"}, "0 <= RANK < WORLD_SIZE"),
])
def test_bad_launcher_variables(change, message):
    env = {k: v for k, v in {**LAUNCH, **change}.items() if v is not None}
    with pytest.raises(UsageError, match=message):
        from_env(env)


def test_more_processes_than_prompts_and_a_pinned_gpu_are_refused():
    with pytest.raises(UsageError, match="2 prompt\\(s\\) for 3 processes"):
        Shard(0, 3, 0, launched=True).mine(["a", "b"])
    cfg = parse_args(["--random-weights", "tiny", "--dataset", "x", "--device", "cuda:1"])
    with pytest.raises(UsageError, match="every rank uses cuda:LOCAL_RANK"):
        Shard(1, 2, 1, launched=True).rank_device(cfg.device)
    cpu = parse_args(["--random-weights", "tiny", "--dataset", "x", "--device", "cpu"])
    assert Shard(1, 2, 1, launched=True).rank_device(cpu.device) == "cpu"


def test_resume_needs_the_process_count_it_started_with(tmp_path):
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "config.json").write_text(json.dumps({"resolved": {}}))
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.json").write_text(json.dumps({"resolved": {"distributed": {"world_size": 2}}}))
    Shard().check_resume(str(tmp_path / "single"))
    Shard(0, 2, 0, launched=True).check_resume(str(tmp_path / "two"))
    with pytest.raises(UsageError, match="started as one process"):
        Shard(0, 2, 0, launched=True).check_resume(str(tmp_path / "single"))
    with pytest.raises(UsageError, match="started by 2 processes .* this is 3"):
        Shard(0, 3, 0, launched=True).check_resume(str(tmp_path / "two"))
    with pytest.raises(UsageError, match="this is one"):
        Shard().check_resume(str(tmp_path / "two"))


SMI = ("GPU-aaaa-1, NVIDIA H200, 570.86.15, P0, 1980, 3201, 1980, 3201, 120.50, 700.00, 41\n"
       "GPU-bbbb-2, NVIDIA H200, 570.86.15, P0, 1755, 3201, 1980, 3201, [N/A], 700.00, 63\n")


def test_nvidia_smi_row_is_matched_by_uuid():
    row = rank_report.parse_smi(SMI, "bbbb-2")  # torch prints the UUID without "GPU-"
    assert row["clocks.sm [MHz]"] == 1755.0 and row["temperature.gpu [C]"] == 63.0
    assert row["power.draw [W]"] is None and row["driver_version"] == "570.86.15" and row["name"] == "NVIDIA H200"
    assert rank_report.parse_smi(SMI, "cccc") is None and rank_report.parse_smi(None, "aaaa-1") is None


def ar_rows(rank, tok_s, n=4):
    """n AR rows of one rank at tok_s (10 decode tokens each), plus a warmup row that must not count."""
    rows = [{"rank": rank, "arm": "AR", "method": "ar", "warmup": False, "turn": 0, "decode_tokens": 10,
             "decode_s": 10 / tok_s} for _ in range(n)]
    return rows + [{**rows[0], "warmup": True, "decode_s": 1000.0}]


@pytest.mark.parametrize("speeds, flagged", [
    ((100.0, 100.0, 94.0), [2]),        # 6% below the median: a throttled GPU
    ((100.0, 100.0, 96.0), []),         # 4%: within the threshold
    ((100.0, 89.0), [0, 1]),            # two ranks: each is half the 11% gap (5.8%) from their midpoint
    ((100.0, 91.0), []),                # 9% gap: 4.7% each, not flagged (the rule's limit with two ranks)
])
def test_rank_more_than_5_percent_from_the_median_is_flagged(speeds, flagged):
    rows = [r for i, v in enumerate(speeds) for r in ar_rows(i, v)]
    rows.append({"rank": 0, "arm": "xPress(K=2)", "method": "xpress", "warmup": False, "turn": 0,
                 "decode_tokens": 10, "decode_s": 1e-3})  # other arms do not count
    ranks = [{"rank": i, "hostname": "h", "device": f"cuda:{i}", "gpu_before": {"name": "H200"}, "prompts": 4,
              "loop_s": 1.0} for i in range(len(speeds))]
    s = rank_report.rank_summary(rows, ranks)
    assert s["flagged"] == flagged and s["ar_arm"] == "AR"
    assert [r["ar_tok_s"] for r in s["ranks"]] == pytest.approx(list(speeds), rel=1e-12)
    assert s["ranks"][0]["ar_step_ms"] == pytest.approx(1000 / speeds[0], rel=1e-12)
    text = rank_report.format_ranks({"ranks": s}, markdown=True)
    assert ("SLOW" in text) == bool(flagged) and "| rank | host |" in text
    assert rank_report.format_ranks({}) == ""  # single-process runs: no section


def test_no_ar_arm_says_so():
    rows = [{"rank": 0, "arm": "drafter-only", "method": "drafter-only", "warmup": False, "turn": 0,
             "decode_tokens": 10, "decode_s": 0.1}]
    s = rank_report.rank_summary(rows, [{"rank": 0}])
    assert s["ar_arm"] is None and s["flagged"] == []
    assert "no AR arm" in rank_report.format_ranks({"ranks": s})


@pytest.mark.gpu
def test_gpu_state_of_a_real_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    s = rank_report.gpu_state(torch.device("cuda", 0))
    assert s["name"] == torch.cuda.get_device_name(0) and s["uuid"]
    assert s["smi"] is not None, "nvidia-smi has no row with this GPU's UUID"
    assert s["smi"]["name"] == s["name"] and s["smi"]["clocks.sm [MHz]"] > 0 and s["smi"]["driver_version"]
