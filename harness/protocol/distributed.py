"""Scale-out: one paired run spread over the processes of torchrun or accelerate launch, one GPU each.

    torchrun --nproc-per-node N benchmark_compile_all.py ...          (multi-node: --nnodes, --node-rank, --rdzv-*)
    accelerate launch --multi_gpu --num_processes N benchmark_compile_all.py ...

Both launchers set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a process that sees RANK and
WORLD_SIZE is one rank of a run (`Shard`), and a process that sees neither is a plain single-process run, which
nothing here changes.

- Prompts are dealt round-robin: rank r decodes question ids r, r + N, r + 2N, ... with every arm in every round,
  so each prompt's arms run on one GPU and every paired ratio stays paired on it. Question ids, random streams and
  the rotation are those of the whole run, so the rows are the rows a single process would write.
- Rank r appends to samples.rank{r}.jsonl in the one results folder: --resume continues each rank from its own
  file, and a rank that dies loses only the prompt it was decoding. A run resumes with the launcher and the
  number of processes it started with (the shards depend on it); under torchrun --max-restarts a restarted group
  continues its --run-id folder by itself.
- Rank 0 chooses the folder and writes config.json; at the end it gathers every rank's rows, environment and
  GPU state (harness.protocol.rank_report) and writes the merged samples.jsonl.gz, summary, tables and env.json as a
  single-process run does. The rows travel through the process group, so ranks on other nodes need no shared
  filesystem for the merge (a resume on another node layout needs their rank files where the ranks run).
- Coordination is a few small Python objects over gloo on the host, before the first and after the last timed
  generation: no collective touches a GPU or runs while anything is timed, and no NCCL state is created.
"""
from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

from core.errors import UsageError
from harness.protocol.rounds import run_order

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The final gather waits for the slowest rank: shards of a long benchmark may finish hours apart. A rank that dies
# does not leave the others waiting this long: torchrun (and accelerate, through it) stops every rank of the group.
GATHER_TIMEOUT = timedelta(hours=24)


@dataclasses.dataclass
class Shard:
    """This process's part of a run: rank `rank` of `world`, on GPU `local_rank` of its node."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun / accelerate launch (even with one process)
    info: dict = dataclasses.field(default_factory=dict)  # this rank's environment, GPU state and loop seconds
    _group: bool = False
    _ended: bool = False  # past the merge, the last collective: close() meets the other ranks at a barrier first

    @property
    def main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------------------------- before any model loads

    def rank_device(self, device: str | None) -> str | None:
        """The device this rank runs on, from --device: CUDA runs on cuda:LOCAL_RANK (set as the current device
        too); the run config keeps --device as given (config.json's resolved section records this one)."""
        if not self.launched:
            return device
        if device is not None and device.startswith("cuda:"):
            raise UsageError(f"--device {device}: under torchrun / accelerate launch every rank uses "
                             "cuda:LOCAL_RANK; pass --device cuda or leave it out (CUDA_VISIBLE_DEVICES picks GPUs)")
        import torch
        if device == "cuda" or (device is None and torch.cuda.is_available()):
            n = torch.cuda.device_count()
            if self.local_rank >= n:
                raise UsageError(f"rank {self.rank} has LOCAL_RANK {self.local_rank} but this node shows {n} "
                                 f"GPU(s); launch at most {n} processes per node (--nproc-per-node)")
            torch.cuda.set_device(self.local_rank)  # kernels and graphs that use the current device follow
            device = f"cuda:{self.local_rank}"
        return device

    def mine(self, samples: list) -> list[tuple[int, object]]:
        """(question id, sample) pairs this rank decodes; question ids are positions in the whole run."""
        if len(samples) < self.world:
            raise UsageError(f"{len(samples)} prompt(s) for {self.world} processes: every rank needs a prompt; "
                             f"launch at most {len(samples)} processes or raise --max-samples")
        return [(qid, s) for qid, s in enumerate(samples) if qid % self.world == self.rank]

    def announce(self, out, mine) -> None:
        if self.launched:
            print(f"[distributed] {self.world} process(es), gloo on the host for coordination only; rank 0 decodes "
                  f"question ids {[q for q, _ in mine]}, each with every arm and round; rows in "
                  "samples.rank{r}.jsonl, merged by rank 0", file=out)

    # ------------------------------------------------------------------------------------ files of one rank

    def rows_path(self, folder: str) -> str:
        return os.path.join(folder, f"samples.rank{self.rank}.jsonl" if self.launched else "samples.jsonl")

    def per_rank(self, path: str | None) -> str | None:
        """A file every rank writes (--trace): one per rank, path.rank{r}.ext."""
        if not path or not self.launched:
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.rank{self.rank}{ext}"

    def tag(self, rows: list[dict]) -> list[dict]:
        """Rows say which rank decoded them (the per-rank throughput check reads it)."""
        if self.launched:
            for r in rows:
                r["rank"] = self.rank
        return rows

    def annotate(self, config: dict) -> dict:
        if self.launched:
            config["resolved"]["distributed"] = {
                "world_size": self.world, "sharding": "round-robin: rank r decodes question ids r, r+N, ...",
                "rows": "samples.rank{r}.jsonl per rank, merged by rank 0 into samples.jsonl.gz"}
        return config

    def check_resume(self, folder: str) -> None:
        """A run resumes with the process count it started with: the prompts of each rank depend on it."""
        saved = json.loads(open(os.path.join(folder, "config.json")).read())
        before = (saved.get("resolved") or {}).get("distributed")
        if before is None and self.launched:
            raise UsageError(f"--resume {folder}: the run was started as one process; resume it without torchrun "
                             "/ accelerate launch")
        if before is not None and (not self.launched or before.get("world_size") != self.world):
            raise UsageError(f"--resume {folder}: the run was started by {before.get('world_size')} processes "
                             f"(torchrun / accelerate launch), this is {self.world if self.launched else 'one'}; "
                             "resume it with the same number of processes")

    def pick_folder(self, cfg, run_folder, check_resume):
        """(resume, folder): rank 0 picks the results folder (runner.run_folder) and checks a resumed one (runner.
        check_resume, and the process count here); every rank gets its answer. Under torchrun --max-restarts a
        group restarted after a failure continues its --run-id folder as --resume would; a first attempt, or a run
        without --run-id, starts as asked."""
        def pick():
            again = self.launched and int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
            folder = os.path.join(cfg.results_dir, cfg.run_id or "")
            resume = cfg.resume
            if again and cfg.run_id and not resume and os.path.isfile(os.path.join(folder, "config.json")):
                resume = folder
            folder = run_folder(cfg, resume)
            if resume:
                check_resume(cfg, folder)
                self.check_resume(folder)
            return resume, folder
        return self.agree(pick)

    def done(self, rows_path: str, resume: bool) -> list[dict]:
        """Rows this rank already wrote (--resume); a rank that died before its first row has none. A single
        process reads its folder's rows: the plain samples.jsonl it appends to, or the .gz a finished run wrote."""
        from harness.protocol.results_io import read_rows, rows_file
        path = (rows_path if os.path.exists(rows_path) else None) if self.launched else \
            rows_file(os.path.dirname(rows_path))
        return read_rows(path) if resume and path is not None else []  # stopped before its first row: none

    # ------------------------------------------------------------------------------------------ collectives

    def start(self) -> None:
        if self.launched and not self._group:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world,
                                    timeout=GATHER_TIMEOUT)
            self._group = True

    def agree(self, pick):
        """Rank 0 runs pick() (the results folder, the resume checks) and every rank gets its value, or its
        UsageError: no rank is left waiting for an answer that will not come."""
        if not self.launched:
            return pick()
        import torch.distributed as dist
        self.start()
        box = [None]
        if self.main:
            try:
                box = [("ok", pick())]
            except UsageError as e:
                box = [("error", str(e))]
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise UsageError(value)
        return value

    def merge(self, rows: list[dict], order: list[list[str]]) -> list[dict] | None:
        """Every rank's rows (and `info`) to rank 0; rank 0 gets them in a single-process run's order
        (round, the arm's slot in that round, question id, turn), every other rank None."""
        if not self.launched:
            return rows
        import torch.distributed as dist
        parts = [None] * self.world if self.main else None
        dist.gather_object((self.rank, rows, self.info), parts, dst=0)
        self._ended = True  # no collective is left: close() may meet the other ranks at a barrier
        if not self.main:
            return None
        self.info = {"ranks": [info for _, _, info in sorted(parts, key=lambda p: p[0])]}
        return run_order([r for _, part, _ in parts for r in part], order)

    def close(self) -> None:
        """The process group destroyed. Past the merge (the last collective: every rank got through it), the ranks
        first meet at a barrier and tear the group down together, rank 0 after its report, written or failed (no
        rank's side goes while another still uses it; the SIGABRT this once aimed at is `leave`'s). A rank that
        fails before the merge leaves at once (another rank may be inside a collective the barrier would not
        match; the launcher stops the group)."""
        if self._group:
            import torch.distributed as dist
            if self._ended:
                dist.barrier()
            dist.destroy_process_group()
            self._group = False


def leave(code: int, environ=None) -> None:
    """A launched rank's last act: its streams flushed, the process ends at once with `code`, without the
    interpreter's finalization. Why: a rank that had finished everything (its rows merged, the barrier met, the
    group destroyed) died with SIGABRT ("terminate called without an active exception") while its interpreter shut
    down, failing the launcher's run: twice in fresh-clone CI runs (2026-12-04, 2026-12-05; torch 2.13 CPU, gloo,
    Python 3.11), and in 2 of 60 two-process accelerate launches of tests/test_distributed.py's T=1 run on the
    2-core dev machine under load (0 of 30 without load; faulthandler: the main thread in no Python frame, so in
    finalization; once a bus error there too). With this, 0 of 200 under the same load (2026-12-05; were the rate
    unchanged, 0 of 200 would come about 0.1% of the time). The likely cause, not confirmed: a C++ thread that asks
    for the GIL once finalization has begun is ended by the interpreter, and that unwinding through C++ code that
    may not throw calls std::terminate (pytorch/pytorch#179291 describes it for gloo's worker threads). Nothing is
    left to run in a finished rank, so it skips finalization (os._exit) and with it that whole class of crash. A
    process that was not launched (a plain run, the tests' in-process calls) returns and exits as usual."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return
    import logging
    import sys
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    try:  # C stdio's buffers too (what an extension printed), which os._exit would drop
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to reach (not a POSIX libc)
        pass
    os._exit(code)


def from_env(environ=None) -> Shard:
    """The Shard of this process from the launcher's variables; a single process without them."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return Shard()
    missing = [k for k in LAUNCH_ENV if not env.get(k)]
    if missing:
        raise UsageError(f"launcher environment incomplete: {', '.join(missing)} unset while "
                         f"{'RANK' if 'RANK' in env else 'WORLD_SIZE'} is set; launch with torchrun or accelerate "
                         "launch, or unset RANK and WORLD_SIZE for a single-process run")
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    except ValueError:
        raise UsageError(f"launcher environment: RANK={env['RANK']!r} WORLD_SIZE={env['WORLD_SIZE']!r} "
                         f"LOCAL_RANK={env['LOCAL_RANK']!r} must be integers") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise UsageError(f"launcher environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}; need "
                         "0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    return Shard(rank, world, local, launched=True)


def refuse_launcher(program: str) -> None:
    """For a program that runs in one process only: under torchrun with N > 1 processes every rank would repeat
    the whole job into the same files. (The training pipeline until speculators' distributed mode is wired: its
    trainer turns it on with speculators.train.distributed.maybe_setup_distributed(), which 0.9.0 runs only on an
    accelerator, and then needs its DistributedCheckpointer rather than a single-GPU one.)"""
    shard = from_env()
    if shard.world > 1:
        raise UsageError(f"{program} runs in one process; it was launched as {shard.world} processes (torchrun / "
                         "accelerate launch), which would each repeat the whole job into the same files; run it "
                         "without the launcher")
