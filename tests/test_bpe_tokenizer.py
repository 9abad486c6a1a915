"""The built-in byte-level BPE `builtin:bpe`: any text round-trips, the tiny tokenizer's special ids and chat
template, the same ids in every process, the shipped file regenerates byte for byte, the HF export folder, and
far fewer tokens than `builtin:tiny` on reasoning-gym questions it was not trained on."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from pipeline.environments.tokenizer import (
    BPE_VOCAB_SIZE,
    BUILTIN_BPE,
    SPECIAL_TOKENS,
    TINY_CHAT_TEMPLATE,
    TokenizerLoadError,
    build_bpe_tokenizer_object,
    load_tokenizer,
    render_chat,
    save_for_export,
)

REPO = Path(__file__).resolve().parents[1]

# Fixed reasoning-gym questions and answers (held-out items: not the tokenizer's training text) and other text.
TEXTS = [
    "Find the prime factorization of 639. Write the factors separated by × (Example: for 12 the answer would be: "
    "2 × 2 × 3)",
    "<answer>3 × 3 × 71</answer>",
    'How many times does the letter "s" appear in the text: "me see I have three hours Mr Smith mused Jack"?',
    "Sort these numbers in ascending order: 48.36, 88.49, 30.41, -94.2\n## 1. Let all your answers be a list",
    "Compute 245.8034^5. Return your final answer correct to 3 significant figures.\n",
    "What is 12*(3+4)?\n<calc>12*(3+4)</calc><result>84</result>\nAnswer: 84",
    "héllo wörld — naïve café, 世界, 🎉🐈, ∫ x² dx = x³/3, ½ ≠ 0.5?",
    "\ttabs\tand\r\nnewlines\n\n  leading and trailing spaces  ",
    "\x00\x01\x7f nul and control bytes \u200b\ufeff",
    "".join(chr(c) for c in range(32, 127)),
    "",
]


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(BUILTIN_BPE)


def test_vocab_size_and_special_ids(bpe) -> None:
    assert len(bpe) == BPE_VOCAB_SIZE and BPE_VOCAB_SIZE % 64 == 0
    assert bpe.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    assert (bpe.pad_token_id, bpe.bos_token_id, bpe.eos_token_id, bpe.unk_token_id) == (0, 1, 2, 3)
    assert bpe.chat_template == TINY_CHAT_TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(bpe, text: str) -> None:
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(i >= len(SPECIAL_TOKENS) for i in ids), "encode adds no special tokens and never produces <unk>"


def test_random_unicode_round_trips() -> None:
    """Any code point (surrogates aside), byte-level: 20 strings of 200 random characters decode back exactly."""
    tok = build_bpe_tokenizer_object()
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(chr(rng.choice([rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(200))
        enc = tok.encode(text)
        assert tok.decode(enc.ids) == text and min(enc.ids) >= len(SPECIAL_TOKENS)


def test_special_tokens_decode_and_skip(bpe) -> None:
    ids = [bpe.bos_token_id, *bpe.encode("2 × 3"), bpe.eos_token_id]
    assert bpe.decode(ids) == "<bos>2 × 3<eos>"
    assert bpe.decode(ids, skip_special_tokens=True) == "2 × 3"


def test_unknown_builtin_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TokenizerLoadError, match=r"builtin:nope.*'builtin:tiny', 'builtin:bpe'"):
        load_tokenizer("builtin:nope")


def test_same_ids_in_another_process(bpe) -> None:
    """A fresh process (another string-hash seed, without transformers) encodes every text to the same ids."""
    code = (
        "import json, sys\n"
        "from pipeline.environments.tokenizer import build_bpe_tokenizer_object\n"
        "tok = build_bpe_tokenizer_object()\n"
        "print(json.dumps([tok.encode(t).ids for t in json.loads(sys.stdin.read())]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(TEXTS), capture_output=True, text=True, cwd=REPO, env=env
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [bpe.encode(t) for t in TEXTS]


def test_shipped_file_regenerates_identically() -> None:
    """`python -m pipeline.environments.bpe_training --check` in a fresh process (another string-hash seed):
    generating the training text and training again gives the shipped file byte for byte."""
    env = {**os.environ, "PYTHONHASHSEED": "777", "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.environments.bpe_training", "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical" in out.stdout


def test_chat_template_renders_tool_calls(bpe) -> None:
    """Messages with a tool call render as `builtin:tiny` renders them, and the ids decode back to that text."""
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6×7"}}}
    messages = [
        {"role": "user", "content": "What is 6×7?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c0"},
    ]
    text = bpe.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos>system\nTools: calculator<eos><bos>user\nWhat is 6×7?<eos>"
        '<bos>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "6×7"}}</tool_call><eos>'
        "<bos>tool\n42<eos><bos>assistant\n"
    )
    ids = render_chat(bpe, messages, tools)
    assert ids[0] == bpe.bos_token_id and ids.count(bpe.eos_token_id) == 4
    assert bpe.decode(ids) == text


def test_hf_export_folder_encodes_like_the_rollout_workers(bpe, tmp_path: Path) -> None:
    import transformers

    from pipeline.environments.base import encode_prompt

    save_for_export(bpe, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert len(auto) == BPE_VOCAB_SIZE and auto.chat_template == TINY_CHAT_TEMPLATE
    for text in TEXTS[:7]:
        ids = auto(text)["input_ids"]
        assert ids == encode_prompt(bpe, text)
        assert auto.decode(ids, skip_special_tokens=True) == text


def test_fewer_tokens_than_tiny_on_held_out_reasoning_gym_questions(bpe) -> None:
    """On one held-out question of each of the 93 tasks the BPE was trained on: >= 2x fewer tokens than
    `builtin:tiny` (whose word pieces already make it ~0.7 tokens per character; measured 2.36x) and >= 3
    characters per token, 3x fewer than one token per character (measured 3.54)."""
    from bench.bench_tokenizer import held_out_items
    from pipeline.environments.bpe_training import CORPUS_TASKS

    questions = [q for task in CORPUS_TASKS for q, _ in held_out_items(task, 1)]
    tiny = load_tokenizer("builtin:tiny")
    chars = sum(map(len, questions))
    n_tiny = sum(len(tiny.encode(q)) for q in questions)
    n_bpe = sum(len(bpe.encode(q)) for q in questions)
    assert n_tiny / n_bpe >= 2.0, (n_tiny, n_bpe)
    assert chars / n_bpe >= 3.0, (chars, n_bpe)


@pytest.mark.parametrize(
    ("spec", "text"),
    [("builtin:tiny", "What is 12 * 7? <answer>84</answer>"), ("builtin:bpe", "What is 12 × 7? <answer>84</answer>")],
)
def test_the_reports_rollout_decoder_reads_every_builtin_spec(spec: str, text: str) -> None:
    """The report decodes a run's rollout samples with the run's own built-in tokenizer."""
    from pipeline.environments.tokenizer import build_builtin_tokenizer_object
    from pipeline.rollout.samples import tokenizer_decoder

    ids = build_builtin_tokenizer_object(spec).encode(text).ids
    assert tokenizer_decoder(spec)(ids) == text
