"""training/README.md names the export folders training/export.py really writes: one per model of the config
(export.py writes export/<model>/ for every entry of `models`). It once named only export/markov_gated while the
main README named markov_vanilla; smollm2-gpu exports both, tiny-cpu a `markov`, toy none."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "training" / "README.md").read_text().split())


def models(config: str) -> list[str]:
    """The config's models, its `extends` chain resolved (smollm2-gpu-gsm8k names none of its own)."""
    from training.config import load_config
    return list(load_config(config)["models"])


def test_the_readme_lists_each_configs_export_folders():
    said = {m.group(1): re.findall(r"`([\w-]+)`", m.group(2))
            for m in re.finditer(r"`([\w-]+)` writes ((?:`[\w-]+`(?:, )?)+)", README)}
    configs = sorted(p.stem for p in (ROOT / "training" / "configs").glob("*.json"))
    assert sorted(said) == configs
    for config, names in said.items():
        assert names == models(config), config


def test_every_export_path_in_the_readme_is_a_folder_the_export_writes():
    paths = re.findall(r"runs/([\w-]+)/export/(\w+)", README)
    assert paths
    for config, name in paths:
        assert name in models(config), f"runs/{config}/export/{name}"
