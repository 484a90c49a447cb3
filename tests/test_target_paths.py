"""A target that can only be a local path and is not there is refused at once (harness.decode.loading.check_local),
not after the hub's retries with an error about a repository; a hub id of the form owner/name is left to the hub."""
import pytest

from core.errors import UsageError
from harness.decode.loading import check_local, load_target_config


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./model", "../model", "~/model", "runs/x/target"])
def test_paths_that_cannot_be_hub_ids_are_refused(spec):
    with pytest.raises(UsageError, match=f"target {spec}: no such file or folder"):
        load_target_config(spec)


def test_owner_name_under_a_local_folder_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(UsageError, match=r"runs/ is a folder here, so this names a path in it, not a hub id"):
        check_local("runs/nosuch")
    check_local("HuggingFaceTB/SmolLM2-135M-Instruct")  # no such folder here: a hub id, not refused
    (tmp_path / "runs" / "nosuch").mkdir()
    check_local("runs/nosuch")  # there now: not refused
