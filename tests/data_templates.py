"""What the dataset tests share: the reference's prompt templates (REFERENCE.md section 8) as literal strings, a
JSONL writer, and the raw rows the local benchmark files were built from."""
import json
from pathlib import Path

from eval_files import EVAL_DIR


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HE_HEAD = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
HE_TAIL = "\n```"
LCB_HEAD = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
            "generate a correct Python program that matches the specification and passes all tests. You will NOT "
            "return anything except for the program\n\n### Question:\n")
LCB_WITH_STARTER = "\n\n### Format: Use the following code structure:\n```python\n"
LCB_NO_STARTER = "\n\n### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
LCB_TAIL = "\n\n### Answer: (use the provided format with backticks)"
EXPECTED_ROWS = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 257, "aime25": 30, "aime24": 30,
                 "livecodebench": 1055, "mt-bench": 80}


def _strip(text: str, head: str, tail: str) -> str:
    assert text.startswith(head) and text.endswith(tail), text[:80]
    return text[len(head):len(text) - len(tail)]


def _lcb_raw(prompt: str) -> dict:
    """question_content and starter_code recovered from a LiveCodeBench prompt (the template's inverse)."""
    body = _strip(prompt, LCB_HEAD, LCB_TAIL)
    assert body.count("\n\n### Format: ") == 1
    if body.endswith(LCB_NO_STARTER):
        return {"question_content": body[:-len(LCB_NO_STARTER)], "starter_code": ""}
    question, starter = body.split(LCB_WITH_STARTER)
    return {"question_content": question, "starter_code": _strip(starter, "", "\n```")}


# Raw hub fields recovered from one local prompt row, per dataset.
RAW_FROM_LOCAL = {
    "gsm8k": lambda t: {"question": _strip(t[0], "", SUFFIX)},
    "math500": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "aime24": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "aime25": lambda t: {"problem": _strip(t[0], "", SUFFIX)},
    "humaneval": lambda t: {"prompt": _strip(t[0], HE_HEAD, HE_TAIL)},
    "mbpp": lambda t: {"prompt": t[0]},
    "livecodebench": lambda t: _lcb_raw(t[0]),
    "mt-bench": lambda t: {"prompt": list(t)},
}


def _local_turns(name: str) -> list[tuple[str, ...]]:
    with open(EVAL_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [tuple(json.loads(line)["turns"]) for line in f if line.strip()]
