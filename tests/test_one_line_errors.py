"""argparse's own refusals (an unknown choice, a missing or misspelled argument) follow the commands' contract for
bad input: one `error:` line that names --help, exit 2; argparse printed the whole usage first (43 lines for the
main command)."""
import pytest

import benchmark_compile_all
from harness.lab import bench_batch
from harness.protocol import report


def _training_main(argv):
    from training.__main__ import main
    return main(argv)


@pytest.mark.parametrize("main,argv,says", [
    (benchmark_compile_all.main, ["--preset", "smollm2"], "invalid choice: 'smollm2'"),
    (benchmark_compile_all.main, ["--max-new-tokens", "ten"], "invalid int value: 'ten'"),
    (_training_main, ["trian", "--config", "toy"], "invalid choice: 'trian'"),
    (report.main, [], "the following arguments are required: folders"),
    (bench_batch.main, ["--kernels", "cuda"], "invalid choice: 'cuda'"),
])
def test_argparse_refusals_are_one_line(main, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error:") and says in err[0] and "--help" in err[0], err


def test_a_cuda_only_tool_says_so_in_one_line_on_the_cpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the refusal is the CPU's")
    from harness.lab import ablate_launches
    assert ablate_launches.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run it on a CUDA GPU" in err[0], err
