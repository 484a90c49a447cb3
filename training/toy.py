"""A toy target for end-to-end checks of the pipeline in seconds on a CPU: a tiny Qwen3 trained here with plain
torch on a repetitive synthetic language, saved as an HF directory the pipeline and the harness load like any other.

The language: 16 letters, and a fixed permutation of them made of cycles of lengths 3, 5 and 8 (from `seed`). A
user turn is a few random letters; the answer walks the permutation from the turn's last letter, one letter per
step (so it repeats one of three cyclic patterns, picked by the prompt). A trained target's greedy answer is fully
predictable from its last letter; a block drafter has to compose the permutation k times for its k-th slot, which
a refiner that sees the previous draft token (xPress, Markov) does in one step.

    python -m training.toy runs/toy-target   # target/, prompts.jsonl, eval/toy_eval.jsonl: training/configs/toy.json
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from core.errors import Parser

LETTERS = "abcdefghijklmnop"
CYCLES = (3, 5, 8)
SPECIALS = ("<pad>", "<eos>", "<|user|>", "<|assistant|>", "<eot>")
MASK = "<mask>"  # last id: the drafter's mask token, never text
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eot>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
ANSWER_LEN = 48


def permutation(seed: int) -> dict[str, str]:
    """letter -> the next letter: the cycles of CYCLES over a seeded shuffle of LETTERS."""
    order = list(LETTERS)
    random.Random(seed).shuffle(order)
    nxt, start = {}, 0
    for n in CYCLES:
        cyc = order[start:start + n]
        nxt.update({a: b for a, b in zip(cyc, cyc[1:] + cyc[:1])})
        start += n
    return nxt


def answer(prompt: str, nxt: dict[str, str], length: int = ANSWER_LEN) -> str:
    out, c = [], prompt[-1]
    for _ in range(length):
        c = nxt[c]
        out.append(c)
    return "".join(out)


def random_prompts(n: int, rng: random.Random, exclude=()) -> list[str]:
    seen, out = set(exclude), []
    while len(out) < n:
        p = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def toy_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    names = list(SPECIALS) + list(LETTERS) + [MASK]
    core = Tokenizer(WordLevel({t: i for i, t in enumerate(names)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eot>",
                                  additional_special_tokens=[s for s in SPECIALS[1:] if s != "<eot>"] + [MASK])
    tok.chat_template = TEMPLATE
    return tok


def toy_model(vocab: int, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, pad_token_id=0,
                      eos_token_id=SPECIALS.index("<eot>"))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def encode(tok, prompt: str, nxt: dict[str, str]) -> tuple[list[int], int]:
    """(chat prompt + answer ids, where the answer starts)."""
    head = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(head + answer(prompt, nxt), add_special_tokens=False)["input_ids"]
    return ids, len(tok(head, add_special_tokens=False)["input_ids"])


def train_target(model, tok, nxt, steps: int, seed: int, batch: int = 16, lr: float = 3e-3) -> float:
    """Plain next-token training on the answers (prompt tokens are context only); returns the last loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        rows = [encode(tok, p, nxt) for p in random_prompts(batch, rng)]
        width = max(len(ids) for ids, _ in rows)
        x = torch.zeros((batch, width), dtype=torch.long)
        y = torch.full((batch, width), -100, dtype=torch.long)
        for i, (ids, start) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
            y[i, start:len(ids)] = torch.tensor(ids[start:])
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def build(out: Path, seed: int = 0, steps: int = 60, train_prompts: int = 160, eval_prompts: int = 8) -> dict:
    """target/ (trained), prompts.jsonl and eval/toy_eval.jsonl (disjoint prompts) under `out`."""
    nxt = permutation(seed)
    tok = toy_tokenizer()
    model = toy_model(len(tok), seed)
    loss = train_target(model, tok, nxt, steps, seed)
    model.generation_config.eos_token_id = [SPECIALS.index("<eot>")]
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    rng = random.Random(seed + 1)
    evals = random_prompts(eval_prompts, rng)
    train = random_prompts(train_prompts, rng, exclude=evals)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    (out / "eval" / "toy_eval.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in evals))
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in train))
    return {"loss": loss, "next": nxt}


def main(argv=None) -> int:
    p = Parser(prog="python -m training.toy", description="Train the toy target and write its "
               "prompts: OUT/target, OUT/prompts.jsonl, OUT/eval/toy_eval.jsonl.")
    p.add_argument("out", nargs="?", default="runs/toy-target", help="the folder to write (default: runs/toy-target)")
    p.add_argument("--seed", type=int, default=0, help="the permutation's and the weights' seed (default 0)")
    args = p.parse_args(argv)
    target = Path(args.out)
    print(f"toy target trained to loss {build(target, seed=args.seed)['loss']:.4f} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
