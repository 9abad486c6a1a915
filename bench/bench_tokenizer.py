"""Tokens per character of `builtin:bpe` against `builtin:tiny` on reasoning-gym questions, and which tasks fit a row.

For every reasoning-gym task (but `composite`, a mix of the others) at its default config, items
`0 .. --items-1` of `create_dataset(task, seed=HELD_OUT_SEED)`: item seeds far from the ones the BPE was trained on
(`pipeline/environments/bpe_training.py` uses items 0..23 of seed 0), so this is text the tokenizer has not seen.

- **tokens per character**: all questions' tokens over all their characters, per tokenizer (a character `builtin:tiny`
  does not have counts as its one `<unk>` token);
- **fits a row of N tokens**: every item's row, `<bos>` + question + `<answer>ANSWER</answer>` + `<eos>` (what a
  reasoning-gym lesson samples and trains on with the default `answer_format: tag`), has at most N tokens, and the
  reference answer survives the tokenizer (decodes back to itself: `builtin:tiny` cannot write `×`, for one).

    .venv/bin/python -m bench.bench_tokenizer                  # the table, the figures and the fitting tasks
    .venv/bin/python -m bench.bench_tokenizer --items 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

HELD_OUT_SEED = 1_000_000
"""The dataset seed of the measured items (item seeds 1,000,000 + i)."""
ROWS = (32, 128)
"""The row lengths (tokens) that fitting is reported for: the recipe's `train.seq_len` and a 4x longer row."""


def held_out_items(task: str, n: int) -> list[tuple[str, str]]:
    """(question, answer) of items 0..n-1 of `task` at its default config with seed `HELD_OUT_SEED`."""
    from pipeline.environments.bpe_training import quiet_generators
    from pipeline.environments.reasoning_gym_env import load_library

    with quiet_generators():
        ds = load_library().create_dataset(task, seed=HELD_OUT_SEED, size=n)
        return [(str(ds[i]["question"]), str(ds[i]["answer"])) for i in range(n)]


def row_tokens(tokenizer: Any, question: str, answer: str) -> tuple[int, bool]:
    """(tokens of the row `<bos>` question `<answer>answer</answer>` `<eos>`, whether the answer round-trips)."""
    reference = f"<answer>{answer}</answer>"
    ids = tokenizer.encode(reference)
    return 2 + len(tokenizer.encode(question)) + len(ids), tokenizer.decode(ids) == reference


def measure(items: int) -> dict[str, Any]:
    """Per task and tokenizer: characters, question tokens and the longest row; and the summary figures."""
    from reasoning_gym.factory import DATASETS

    from pipeline.environments.tokenizer import BUILTIN_BPE, BUILTIN_TINY, load_tokenizer

    toks = {name: load_tokenizer(name) for name in (BUILTIN_TINY, BUILTIN_BPE)}
    tasks: dict[str, Any] = {}
    for task in sorted(t for t in DATASETS if t != "composite"):
        pairs = held_out_items(task, items)
        row: dict[str, Any] = {"chars": sum(len(q) for q, _ in pairs)}
        for name, tok in toks.items():
            rows = [row_tokens(tok, q, a) for q, a in pairs]
            row[name] = {
                "question_tokens": sum(len(tok.encode(q)) for q, _ in pairs),
                "max_row_tokens": max(n for n, _ in rows),
                "answers_round_trip": all(ok for _, ok in rows),
            }
        tasks[task] = row
    chars = sum(r["chars"] for r in tasks.values())
    summary: dict[str, Any] = {"tasks": len(tasks), "items_per_task": items, "chars": chars}
    for name in toks:
        tokens = sum(r[name]["question_tokens"] for r in tasks.values())
        summary[name] = {"tokens": tokens, "tokens_per_char": tokens / chars}
        for n in ROWS:
            summary[name][f"fit_{n}"] = sorted(
                t for t, r in tasks.items() if r[name]["answers_round_trip"] and r[name]["max_row_tokens"] <= n
            )
    summary["tiny_over_bpe_tokens"] = summary[BUILTIN_TINY]["tokens"] / summary[BUILTIN_BPE]["tokens"]
    return {"tasks": tasks, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=8, help="held-out items per task")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    res = measure(args.items)
    tasks, s = res["tasks"], res["summary"]
    tiny, bpe = "builtin:tiny", "builtin:bpe"
    print(f"{'task':28} {'chars/item':>10} {'tiny tok':>9} {'bpe tok':>8} {'tiny row':>9} {'bpe row':>8}")
    for task, r in tasks.items():
        n = args.items
        cells = [r["chars"] / n, r[tiny]["question_tokens"] / n, r[bpe]["question_tokens"] / n]
        rows = [f"{r[k]['max_row_tokens']}{'' if r[k]['answers_round_trip'] else '!'}" for k in (tiny, bpe)]
        print(f"{task:28} {cells[0]:10.0f} {cells[1]:9.0f} {cells[2]:8.0f} {rows[0]:>9} {rows[1]:>8}")
    print("(row: the longest <bos> question <answer>ANSWER</answer> <eos> in tokens; !: an answer does not round-trip)")
    print(
        f"\n{s['tasks']} tasks x {s['items_per_task']} held-out items, {s['chars']} question characters: "
        f"tokens per character {s[tiny]['tokens_per_char']:.3f} (tiny) vs {s[bpe]['tokens_per_char']:.3f} (bpe), "
        f"{s['tiny_over_bpe_tokens']:.2f}x fewer tokens"
    )
    for n in ROWS:
        print(f"tasks fitting a {n}-token row: tiny {len(s[tiny][f'fit_{n}'])}, bpe {len(s[bpe][f'fit_{n}'])}")
    for n in ROWS:
        print(f"bpe, {n}-token rows: {', '.join(s[bpe][f'fit_{n}'])}")
    print(f"tiny, {ROWS[0]}-token rows: {', '.join(s[tiny][f'fit_{ROWS[0]}'])}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
