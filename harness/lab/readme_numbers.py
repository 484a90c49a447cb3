"""Every number the READMEs quote from results, recomputed from the committed files.

    python -m harness.lab.readme_numbers --check    # exit 1 listing every stale, unknown or unmarked number
    python -m harness.lab.readme_numbers --write    # rewrite every marked value (and copied block) in place

Markers (HTML comments: GitHub renders them invisibly, in prose and in table cells alike):
- `<!--n:KEY-->2.15<!--/n-->`: a number computed from committed files. KEY is `FAMILY:ARG:ARG...`, a function
  of `harness.lab.readme_numbers_keys.REGISTRY` (families and their arguments: that module's docstring, and
  `readme_numbers_more` for bench_step, the trace A/B and the weights' manifest). Units, signs of prose and ×
  stay outside the marker: `<!--n:sp:gsm8k_t0:drafter-->2.03<!--/n-->×`.
- `<!--block:PATH-->` ... `<!--/block-->` on lines of their own: the lines between are a copy of the committed
  file PATH (`PATH#A-B`: its lines A to B), checked as one block, never number by number.
- `<!--i:REASON-->16 MiB<!--/i-->`: a number that is not a measured result (a limit, a rule, a config size);
  the unmarked-number scan skips it.
- `<!--u:REASON-->2 min 34 s<!--/u-->`: a measured number no committed file records. `--check` lists them and
  passes (the text stays honest and visible); `--strict` fails on them too.

The unmarked-number scan is a conservative heuristic: outside code, links and markers, a number followed by a
unit of results (×, %, ms, s, min, tok/s, MB, GB), or a decimal number in a table row or on a line that names
τ, tau, speedup, Sp., ×, tok/s, % or ms, must be marked. Generic phrases ("95% CI") are allowed.

Files: README.md and every README.md under results/ except those of run and sweep folders (a folder with
summary.json or sweep.json: the harness writes them). A generated model card (`python -m training.card --from-json
CARD --markdown MD`) is compared with its committed card.json's rendering when that card.json is committed (CARDS).

Adding a number: wrap its text in a marker whose key names an existing family, or add a family (a decorated
function of a few lines in readme_numbers_keys.py or readme_numbers_more.py), then run --write and --check.
After a results folder is regenerated, `--write` updates every marker that reads it; `--check` then names any
prose number left behind.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness.lab.readme_numbers_more  # noqa: F401  (registers its quantities)
from core.errors import Parser, UsageError
from harness.lab.readme_numbers_keys import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!--(n|i|u):(.*?)-->(.*?)<!--/\1-->", re.S)
BLOCK = re.compile(r"^<!--block:(.*?)-->\n(.*?)^<!--/block-->$", re.S | re.M)
CARDS = (("results/smollm2-135m/training/card.json", "weights/smollm2-135m/CARD.md"),)

UNIT = r"(?:×|%|ms\b|s\b|min\b|tok/s|MB\b|GB\b)"
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)?(?:\s?" + UNIT + r")?")
RESULT_WORDS = re.compile(r"τ|\btau\b|speedup|\bSp\.|×|tok/s|%|\bms\b", re.I)
ALLOWED = re.compile(r"95% (?:CI|interval|bootstrap|confidence)")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str      # stale | unknown | unmarked | block | untraced | card
    text: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.kind}: {self.text}"


def readmes(root: Path) -> list[Path]:
    """README.md, the results READMEs a person writes (run and sweep folders' READMEs are the harness's: beside
    summary.json or sweep.json) and the shipped weights' READMEs."""
    out = [root / "README.md"] if (root / "README.md").is_file() else []
    for p in sorted((root / "results").rglob("README.md")) if (root / "results").is_dir() else []:
        if not any((p.parent / f).is_file() for f in ("summary.json", "sweep.json")):
            out.append(p)
    return out + (sorted((root / "weights").glob("*/README.md")) if (root / "weights").is_dir() else [])


def evaluate(root: Path, key: str) -> str:
    family, *args = key.strip().split(":")
    if family not in REGISTRY:
        raise UsageError(f"readme_numbers: no quantity {family!r} (key {key!r}); known: {', '.join(sorted(REGISTRY))}")
    try:
        return REGISTRY[family](root, *args)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UsageError(f"readme_numbers: key {key!r} does not resolve: {type(e).__name__}: {e}") from e


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def block_text(root: Path, spec: str) -> str:
    path, _, lines = spec.strip().partition("#")
    f = root / path
    if not f.is_file():
        raise UsageError(f"readme_numbers: block source {path} is not a committed file")
    text = f.read_text(encoding="utf-8").splitlines()
    if lines:
        a, _, b = lines.partition("-")
        text = text[int(a) - 1:int(b or a)]
    return "\n".join(text).strip("\n") + "\n"


def masked(text: str) -> str:
    """The text with code, URLs, markers and blocks blanked (same length, newlines kept) for the unmarked scan."""
    chars = list(text)

    def blank(a, b):
        for k in range(a, b):
            if chars[k] != "\n":
                chars[k] = "#"
    for rx in (BLOCK, MARK, re.compile(r"^```.*?^```", re.S | re.M), re.compile(r"`[^`\n]*`"),
               re.compile(r"\]\([^)]*\)"), re.compile(r"<!--.*?-->", re.S), re.compile(r"^ {4,}.*$", re.M)):
        for m in rx.finditer("".join(chars)):
            blank(m.start(), m.end())
    return "".join(chars)


def unmarked(rel: str, text: str) -> list[Finding]:
    out = []
    for n, line in enumerate(masked(text).split("\n"), 1):
        allowed = [m.span() for m in ALLOWED.finditer(line)]
        results_line = bool(RESULT_WORDS.search(line)) or line.lstrip().startswith("|")
        for m in NUMBER.finditer(line):
            tok = m.group(0)
            with_unit = re.search(UNIT + "$", tok) is not None
            if any(a <= m.start() < b for a, b in allowed):
                continue
            if with_unit or ("." in tok and results_line):
                out.append(Finding(rel, n, "unmarked", f"{tok!r} in: {line.strip()[:120]}"))
    return out


def check_text(root: Path, rel: str, text: str) -> list[Finding]:
    out = []
    for m in MARK.finditer(text):
        kind, key, shown = m.groups()
        if kind == "u":
            out.append(Finding(rel, line_of(text, m.start()), "untraced", f"{shown!r} ({key})"))
        if kind != "n":
            continue
        try:
            want = evaluate(root, key)
        except UsageError as e:
            out.append(Finding(rel, line_of(text, m.start()), "unknown", str(e)))
            continue
        if want != shown:
            out.append(Finding(rel, line_of(text, m.start()), "stale", f"{key}: README says {shown!r}, files say {want!r}"))
    for m in BLOCK.finditer(text):
        try:
            want = block_text(root, m.group(1))
        except UsageError as e:
            out.append(Finding(rel, line_of(text, m.start()), "unknown", str(e)))
            continue
        if m.group(2) != want:
            out.append(Finding(rel, line_of(text, m.start()), "block", f"differs from {m.group(1).strip()}"))
    return out + unmarked(rel, text)


def write_text(root: Path, text: str) -> str:
    def value(m):
        kind, key, shown = m.groups()
        return m.group(0) if kind != "n" else f"<!--n:{key}-->{evaluate(root, key)}<!--/n-->"

    def block(m):
        return f"<!--block:{m.group(1)}-->\n{block_text(root, m.group(1))}<!--/block-->"
    return BLOCK.sub(block, MARK.sub(value, text))


def check_cards(root: Path) -> list[Finding]:
    """A committed card.json renders (through `python -m training.card --from-json`) to its committed Markdown."""
    out = []
    for card, md in CARDS:
        if not (root / card).is_file() or not (root / md).is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            got = Path(tmp) / "card.md"
            r = subprocess.run([sys.executable, "-m", "training.card", "--from-json", str(root / card), "--markdown",
                                str(got)], cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                out.append(Finding(md, 1, "card", f"python -m training.card --from-json {card} failed: "
                                                  f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}"))
            elif got.read_text(encoding="utf-8") != (root / md).read_text(encoding="utf-8"):
                out.append(Finding(md, 1, "card", f"differs from what {card} renders: python -m training.card "
                                                  f"--from-json {card} --markdown {md}"))
    return out


def check(root: Path = ROOT) -> list[Finding]:
    harness.lab.readme_numbers_more.clear_caches()
    out = []
    for p in readmes(root):
        out += check_text(root, str(p.relative_to(root)), p.read_text(encoding="utf-8"))
    return out + check_cards(root)


def write(root: Path = ROOT) -> list[str]:
    harness.lab.readme_numbers_more.clear_caches()
    changed = []
    for p in readmes(root):
        old = p.read_text(encoding="utf-8")
        new = write_text(root, old)
        if new != old:
            p.write_text(new, encoding="utf-8")
            changed.append(str(p.relative_to(root)))
    return changed


def main(argv=None) -> int:
    ap = Parser(prog="python -m harness.lab.readme_numbers", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list stale, unknown and unmarked numbers; exit 1 on any")
    mode.add_argument("--write", action="store_true", help="rewrite every marked number and copied block in place")
    ap.add_argument("--strict", action="store_true", help="with --check: untraced numbers fail too")
    ap.add_argument("--root", default=str(ROOT), help="the repository (default: this checkout)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if not readmes(root):  # a wrong --root checked nothing and passed
        what = "no such folder" if not root.is_dir() else ("no README to check (README.md, results/**/README.md, "
                                                            "weights/*/README.md)")
        print(f"error: --root {args.root}: {what}; name the repository's folder", file=sys.stderr)
        return 2
    try:
        if args.write:
            changed = write(root)
            print(f"[readme_numbers] rewrote {', '.join(changed) if changed else 'nothing (every value is current)'}")
        findings = check(root)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failing = [f for f in findings if f.kind != "untraced" or args.strict]
    for f in findings:
        print(("FAIL " if f in failing else "note ") + str(f))
    n = sum(1 for _ in readmes(root))
    print(f"[readme_numbers] {n} READMEs: {len(failing)} failing, "
          f"{sum(f.kind == 'untraced' for f in findings)} untraced (no committed source; listed above)")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
