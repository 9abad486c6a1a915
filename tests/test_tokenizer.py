"""The built-in tiny tokenizer: deterministic, round-trips the environments' texts, saves/loads as a folder."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import transformers

from pipeline.environments.cats import PROBE_PROMPTS, TRAIN_PROMPTS
from pipeline.environments.tokenizer import (
    TINY_VOCAB_SIZE,
    TokenizerLoadError,
    build_tiny_tokenizer,
    load_tokenizer,
    save_tiny_tokenizer,
)

TEXTS = [
    *TRAIN_PROMPTS,
    *PROBE_PROMPTS,
    "cats cats cats",
    " Cats and a CAT!",
    "3+4=",
    "7",
    "123+456=579\n",
    "What is 12*(3+4)?\n<calc>12*(3+4)</calc><result>84</result>\nAnswer: 84",
    "<result>error: unexpected character 'x' at position 2</result>",
    "Question: what is the capital?\nAnswer: Paris.",
    "  leading and trailing spaces  ",
    "\ttabs\tand\r\nnewlines\n\n",
    "".join(chr(c) for c in range(32, 127)),
    "",
]


def test_vocab_size_and_special_ids() -> None:
    tok = load_tokenizer("builtin:tiny")
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == TINY_VOCAB_SIZE and TINY_VOCAB_SIZE % 64 == 0
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<bos>", "<eos>"]


def test_two_builds_are_identical() -> None:
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    for t in TEXTS:
        assert a.encode(t) == b.encode(t)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text: str) -> None:
    tok = load_tokenizer("builtin:tiny")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(i not in (0, 1, 2) for i in ids), "encode must not add special tokens"


def test_cats_are_short() -> None:
    tok = load_tokenizer("builtin:tiny")
    assert len(tok.encode("cats")) == 1
    assert len(tok.encode(" cats")) == 1
    assert len(tok.encode("cats cats cats")) == 3
    assert len(tok.encode("<calc>")) == 1 and len(tok.encode("</calc>")) == 1


def test_special_tokens_decode_and_skip() -> None:
    tok = load_tokenizer("builtin:tiny")
    ids = [tok.bos_token_id, *tok.encode("cat"), tok.eos_token_id]
    assert tok.decode(ids) == "<bos>cat<eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "cat"


def test_saved_folder_loads_with_autotokenizer(tmp_path) -> None:
    d = save_tiny_tokenizer(tmp_path / "tok")
    auto = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    ref = build_tiny_tokenizer()
    assert auto.get_vocab() == ref.get_vocab()
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    loaded = load_tokenizer(d)
    for t in TEXTS:
        assert loaded.encode(t) == ref.encode(t)
        assert loaded.decode(loaded.encode(t)) == t


def test_load_errors_name_the_spec(tmp_path) -> None:
    with pytest.raises(TokenizerLoadError, match="builtin:huge"):
        load_tokenizer("builtin:huge")
    missing = str(tmp_path / "nope")
    with pytest.raises(TokenizerLoadError, match="nope"):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerLoadError, match="empty"):
        load_tokenizer(str(tmp_path / "empty"))


def test_vocab_is_pinned() -> None:
    """Changing the tiny vocabulary silently would break saved policies: update this fingerprint on purpose only."""
    import hashlib
    import json

    from pipeline.environments.tokenizer import build_tiny_tokenizer_object

    vocab = json.loads(build_tiny_tokenizer_object().to_str())["model"]["vocab"]
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()
    assert digest == "08550fa284b1539962b530c3538d35c3beff7c26b7f95e0aa104f4999d7d5c3c"


# --- `BuiltinTokenizer`: the job start's checks without transformers --------------------------------------------

MORE_TEXTS = [*TEXTS, "café 6×7 ≠ 42 — naïve", "<bos>user\nhi<eos><bos>assistant\n", "x<eos>y<pad>", "\x00\x07"]


@pytest.mark.parametrize("spec", ["builtin:tiny", "builtin:bpe"])
def test_builtin_tokenizer_encodes_and_decodes_as_the_transformers_one(spec: str) -> None:
    """Every call the start checks make gives `load_tokenizer`'s answer: ids with and without special tokens
    (special-token text, characters outside the tiny vocabulary, control characters), the text of any ids
    (special and filler ids included), the special ids, the length; and it has no chat template."""
    from pipeline.environments.tokenizer import BuiltinTokenizer, has_chat_template

    hf, lite = load_tokenizer(spec), BuiltinTokenizer(spec)
    for text in MORE_TEXTS:
        assert lite.encode(text) == hf.encode(text), text
        assert lite.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        ids = hf.encode(text)
        assert lite.decode(ids) == hf.decode(ids), text
    every = list(range(len(hf)))
    assert lite.decode(every) == hf.decode(every) and lite.decode([]) == hf.decode([])
    assert [lite.pad_token_id, lite.bos_token_id, lite.eos_token_id, lite.unk_token_id, len(lite)] == [
        hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, len(hf)]  # fmt: skip
    assert not has_chat_template(lite) and has_chat_template(hf)
    with pytest.raises(TokenizerLoadError, match="unknown builtin tokenizer"):
        BuiltinTokenizer("builtin:nope")
