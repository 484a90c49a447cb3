"""What the embedded-default tests share: stand-ins for the shipped weights folders and the fetched target."""
from harness.protocol import setups


def fake_embedded(monkeypatch, root, target: str, subs=tuple(setups.SHIPPED.values())):
    """$XPRESS_BENCH_WEIGHTS at root/w holding `subs` (each with a config.json), the target fetch replaced by
    `target`, and neither refiner env variable set. Returns root/w."""
    monkeypatch.setattr(setups, "embedded_target", lambda: target)
    for sub in subs:
        (root / "w" / sub).mkdir(parents=True)
        (root / "w" / sub / "config.json").write_text("{}")
    monkeypatch.setenv(setups.WEIGHTS_ENV, str(root / "w"))
    for var in setups.ENV_OF.values():
        monkeypatch.delenv(var, raising=False)
    return root / "w"
