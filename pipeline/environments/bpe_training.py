"""How the built-in byte-level BPE tokenizer `builtin:bpe` is made: its training text and its training.

`builtin:bpe` is loaded from the file it was trained into (`BPE_TOKENIZER_FILE`, shipped with the package), not
trained when it is loaded: generating its training text takes seconds (reasoning-gym's generators, rendering chat
templates), the file makes the ids the same on every machine whatever the versions of the libraries that generated
the text, and loading it needs neither reasoning-gym nor transformers. This module regenerates that file:

    .venv/bin/python -m pipeline.environments.bpe_training            # rewrite the shipped file
    .venv/bin/python -m pipeline.environments.bpe_training --check    # exit 1 unless it regenerates byte for byte

(tests/test_bpe_tokenizer.py runs the check). The training text, all made in code with fixed seeds:

- **reasoning-gym**: items `0 .. ITEMS_PER_TASK-1` of `create_dataset(task, seed=CORPUS_SEED)` for every task of
  `CORPUS_TASKS` at its default config (size and difficulty), each question followed by `<answer>ANSWER</answer>`,
  up to `TASK_CHAR_BUDGET` characters per task so that tasks with long grids do not dominate the merges. The tasks
  are reasoning-gym's (0.1.25) minus `composite` (a mix of the others), minus those whose generators take over
  ~0.3 s for 20 items here (futoshiki, intermediate_integration, knight_swap, puzzle24, quantum_lock, sokoban,
  zebra_puzzles), minus those whose text depends on the process's string hashing (isomorphic_strings,
  list_functions, polynomial_multiplication, ransom_note, word_ladder: their generators iterate over sets);
- **tool calls**: calculator conversations (`chat_calculator`'s tool, question, call, result and answer) rendered
  by the chat template, and the text-format calculator episodes (`<calc>E</calc><result>V</result>`);
- **the chat template's own strings**: reasoning-gym questions as chat turns (roles, `<answer>` tags) and the
  built-in environments' prompts.

The model: byte-level BPE (GPT-2's byte-to-unicode alphabet and its pre-tokenisation regex; every digit its own
pre-token, with the space before it, as Llama splits digits, so numbers of every length are spelled with the same
digit tokens and no number has an id of its own to learn), all 256 bytes
in the vocabulary, so every string, unicode included, encodes and decodes back exactly; `<pad> <bos> <eos> <unk>`
at ids 0..3 (`<unk>` is never produced); `BPE_VOCAB_SIZE` tokens in all. Training is deterministic: the same text
gives the same file (the check above, run in a fresh process).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.environments.tokenizer import (
    BPE_TOKENIZER_FILE,
    BPE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    UNK_TOKEN,
)

CORPUS_SEED = 0
"""The dataset seed of every reasoning-gym task in the training text."""
ITEMS_PER_TASK = 24
"""Items drawn per reasoning-gym task (fewer when `TASK_CHAR_BUDGET` is reached first)."""
TASK_CHAR_BUDGET = 12_000
"""Characters of training text per reasoning-gym task, at most (the first item always counts)."""
N_TOOL_TRANSCRIPTS = 300
"""Calculator conversations with tool calls in the training text."""

_CORPUS_TASKS_TEXT = """
    ab acre advanced_geometry aiw arc_1d arc_agi base_conversion basic_arithmetic bf binary_alternation
    binary_matrix bitwise_arithmetic boxnet caesar_cipher calendar_arithmetic chain_sum circuit_logic codeio
    coin_flip color_cube_rotation complex_arithmetic count_bits count_primes countdown course_schedule cryptarithm
    decimal_arithmetic decimal_chain_sum dice emoji_mystery family_relationships figlet_font
    fraction_simplification game_of_life game_of_life_halting gcd graph_color group_anagrams gsm_symbolic
    jugs kakurasu knights_knaves largest_island lcm leg_counting letter_counting letter_jumble
    mahjong_puzzle manipulate_matrix maze mini_sudoku modulo_grid n_queens needle_haystack
    number_filtering number_format number_sequence number_sorting palindrome_generation palindrome_partitioning
    path_star polynomial_equations pool_matrix power_function prime_factorization products
    propositional_logic rearc rectangle_count rotate_matrix rotten_oranges rubiks_cube rush_hour
    self_reference sentence_reordering shortest_path simple_equations simple_geometry simple_integration
    spell_backward spiral_matrix string_insertion string_manipulation string_splitting string_synthesis sudoku
    survo syllogism time_intervals tower_of_hanoi tsumego word_sequence_reversal word_sorting
"""
CORPUS_TASKS: tuple[str, ...] = tuple(_CORPUS_TASKS_TEXT.split())
"""The reasoning-gym tasks of the training text (module docstring)."""


@contextlib.contextmanager
def quiet_generators() -> Iterator[None]:
    """Silence what reasoning-gym's generators print (progress dots) and warn while in this block."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def reasoning_gym_items() -> Iterator[tuple[str, str, str]]:
    """(task, question, answer) of the training items of every `CORPUS_TASKS` task, in a fixed order."""
    from pipeline.environments.reasoning_gym_env import load_library

    rg = load_library()
    for task in CORPUS_TASKS:
        with quiet_generators():
            ds = rg.create_dataset(task, seed=CORPUS_SEED, size=ITEMS_PER_TASK)
        used = 0
        for i in range(ITEMS_PER_TASK):
            with quiet_generators():
                entry = ds[i]
            question, answer = str(entry["question"]), str(entry["answer"])
            yield task, question, answer
            used += len(question) + len(answer)
            if used >= TASK_CHAR_BUDGET:
                break


def _calculator_messages(rng: random.Random) -> tuple[list[dict[str, Any]], str]:
    """One calculator conversation (user question, tool call, tool result, final answer) and its plain-text form."""
    from pipeline.environments.calculator import format_value, safe_eval

    n_terms = rng.randint(2, 4)
    expr = str(rng.randint(1, 99)) + "".join(f"{rng.choice('+-*')}{rng.randint(1, 99)}" for _ in range(n_terms - 1))
    value = format_value(safe_eval(expr))
    call = {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"What is {expr}? Use the calculator tool."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": value, "tool_call_id": "call_0"},
        {"role": "assistant", "content": f"Answer: {value}"},
    ]
    plain = f"What is {expr}?\n<calc>{expr}</calc><result>{value}</result>\nAnswer: {value}"
    return messages, plain


def corpus() -> list[str]:
    """The whole training text, one document per element, in a fixed order (module docstring)."""
    import jinja2.sandbox

    from pipeline.environments.cats import PROBE_PROMPTS, TRAIN_PROMPTS
    from pipeline.environments.chat_calculator import CALCULATOR_TOOL

    # The chat template rendered as transformers renders it (a sandboxed Jinja environment; `tojson` as its).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(TINY_CHAT_TEMPLATE)

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return template.render(messages=messages, tools=tools, add_generation_prompt=False)

    docs: list[str] = []
    chat_every = 4  # every 4th reasoning-gym item also as a chat turn: the roles and template strings
    for i, (_, question, answer) in enumerate(reasoning_gym_items()):
        docs.append(f"{question}\n<answer>{answer}</answer>")
        if i % chat_every == 0:
            turn = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ]
            docs.append(render(turn, None))
    rng = random.Random(CORPUS_SEED)
    for _ in range(N_TOOL_TRANSCRIPTS):
        messages, plain = _calculator_messages(rng)
        docs.append(render(messages, [CALCULATOR_TOOL]))
        docs.append(plain)
    docs += [render([{"role": "user", "content": p}], None) for p in (*TRAIN_PROMPTS, *PROBE_PROMPTS)]
    return docs


def train_bpe(texts: Sequence[str]) -> Tokenizer:
    """A byte-level BPE of `BPE_VOCAB_SIZE` tokens trained on `texts` (module docstring); deterministic."""
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # Every digit its own pre-token (a space before it stays with it, " 7"), then GPT-2's byte-level split.
    digits = pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def bpe_tokenizer_json() -> str:
    """The text of `BPE_TOKENIZER_FILE` as this code makes it (trained on `corpus()`)."""
    tok = train_bpe(corpus())
    # The trainer's JSON, re-serialised with sorted keys, so the file's bytes depend only on the tokenizer.
    return json.dumps(json.loads(tok.to_str()), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the shipped tokenizer file (default), or with `--check` exit 1 unless it regenerates identically."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.environments.bpe_training", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the shipped file; write nothing")
    parser.add_argument("--out", default=str(BPE_TOKENIZER_FILE), help="where to write (default: the shipped file)")
    args = parser.parse_args(argv)
    text = bpe_tokenizer_json()
    if args.check:
        same = BPE_TOKENIZER_FILE.read_text(encoding="utf-8") == text
        print(f"{BPE_TOKENIZER_FILE}: {'identical' if same else 'DIFFERS from what this code makes'}")
        return 0 if same else 1
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
