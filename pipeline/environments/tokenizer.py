"""Tokenizers: a local Hugging Face tokenizer folder, or a built-in one (`builtin:tiny`, `builtin:bpe`).

`builtin:tiny` is built deterministically in code with the `tokenizers` library (no hub, no
training): a Unigram model with an explicit vocabulary

- ids 0..3: the special tokens `<pad>`, `<bos>`, `<eos>`, `<unk>`;
- every character of `string.printable` (printable ASCII plus whitespace), so any ASCII text
  encodes and decodes back exactly;
- whole-word pieces common in the built-in environments ("cat", " cats", "<calc>", "Answer:", ...),
  so that saying "cats" is one or two tokens and the cats environment is learnable from a random
  tiny model;
- `<unused_N>` filler pieces (never produced by encoding) up to `TINY_VOCAB_SIZE` (a multiple of 64).

It carries a chat template (`TINY_CHAT_TEMPLATE`) so chat-formatted lessons run on it: each message is
`<bos>ROLE\nCONTENT<eos>` (tool calls of an assistant message as `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` after its content; tools offered, a first `system` message `Tools: NAME, NAME`), and the
generation prompt is `<bos>assistant\n`, so a turn ends at EOS like a plain completion.

Every piece costs the same score, plus a tiny bonus per character, so encoding picks the
segmentation with the fewest tokens (ties: longer pieces). There is no normaliser and no
pre-tokeniser, spaces are ordinary characters, and the decoder concatenates pieces, so
`decode(encode(s)) == s` for every ASCII string `s`. `encode` adds no special tokens.

`builtin:bpe` is a byte-level BPE of `BPE_VOCAB_SIZE` tokens for real text: trained on reasoning-gym questions and
answers, calculator tool-call conversations and the chat template's strings (`pipeline/environments/bpe_training.py`
makes it, deterministically) and shipped as `BPE_TOKENIZER_FILE`, which is what loading reads. Every string, unicode
included, encodes and decodes back exactly (all 256 bytes are tokens); the special tokens are the tiny one's at the
same ids 0..3, its chat template is `TINY_CHAT_TEMPLATE`, and `encode` adds no special tokens. On reasoning-gym
questions it makes ~3.3 characters per token, 2.3x fewer tokens than `builtin:tiny` (docs/guides/reasoning-tasks.md).

`load_tokenizer` wraps a built-in in a transformers fast tokenizer (chat templates, saving, export);
`BuiltinTokenizer` gives the same `encode` / `decode` without importing transformers, for checks that need no more.
"""

from __future__ import annotations

import functools
import os
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models

if TYPE_CHECKING:
    import transformers

BUILTIN_TINY = "builtin:tiny"
BUILTIN_BPE = "builtin:bpe"
BUILTIN_SPECS: tuple[str, ...] = (BUILTIN_TINY, BUILTIN_BPE)
"""Every built-in tokenizer spec `load_tokenizer` accepts."""
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TINY_VOCAB_SIZE = 512
"""Size of the built-in tiny vocabulary (a multiple of 64; the tail is `<unused_N>` filler)."""
BPE_VOCAB_SIZE = 4096
"""Size of the built-in BPE vocabulary (a multiple of 64)."""
BPE_TOKENIZER_FILE = Path(__file__).with_name("bpe_tokenizer.json")
"""The trained `builtin:bpe` (a `tokenizers` JSON file), written by `python -m pipeline.environments.bpe_training`."""

_WORDS_TEXT = """
    cat cats Cat Cats CAT CATS kitty kitten kittens meow purr moar more feline paw paws whiskers tabby
    mouse fish milk nap fur pet pets the The a A an is are was be what What how How why who i I me my
    you You your we they it It this that there do does did like love give tell say said want need have
    has please Please about some many much all any no not yes Yes No and or of to in on for with at by
    from as so if then good best favorite animal animals dog dogs day today now can will let let's talk
    write story poem name one two three lot lots hello Hello hi Hi thanks ok very really just only also
    too plus minus times divided sum equals number numbers add compute Compute calculate Calculate
    answer Answer Question problem result value error Use use calculator tool final
"""
_WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())
"""Whole words of the built-in environments; each also gets a leading-space variant."""
_SYMBOL_PIECES: tuple[str, ...] = (
    "<calc>",
    "</calc>",
    "<result>",
    "</result>",
    "Answer:",
    " Answer:",
    "Question:",
    "Q:",
    "A:",
    "error:",
    " error:",
    ": ",
    ". ",
    ", ",
    "? ",
    "! ",
    "\n\n",
    "  ",
    "    ",
    "...",
    "=",
    " = ",
    " + ",
    " - ",
    " * ",
    " / ",
    "+",
    "?\n",
    ".\n",
    ":\n",
    "</result>\n",
    "</calc>\n",
    "Answer: ",
)
_CHARS: tuple[str, ...] = tuple(dict.fromkeys(string.printable))

TINY_CHAT_TEMPLATE = (
    "{% if tools %}<bos>system\nTools: {% for tool in tools %}{% if not loop.first %}, {% endif %}"
    "{{ tool['function']['name'] }}{% endfor %}<eos>{% endif %}"
    "{% for message in messages %}<bos>{{ message['role'] }}\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
"""The built-in tokenizer's chat template (Jinja, as `transformers` renders it; see the module docstring)."""


def _tiny_pieces() -> list[str]:
    """The ordered, duplicate-free piece list of the tiny vocabulary (specials, characters, words, filler)."""
    pieces: list[str] = list(SPECIAL_TOKENS) + list(_CHARS)
    seen = set(pieces)
    words: list[str] = []
    for w in _WORDS:
        words += [w, " " + w]
    for p in words + list(_SYMBOL_PIECES):
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    if len(pieces) > TINY_VOCAB_SIZE:
        raise AssertionError(f"tiny vocabulary has {len(pieces)} pieces > TINY_VOCAB_SIZE={TINY_VOCAB_SIZE}")
    pieces += [f"<unused_{i}>" for i in range(TINY_VOCAB_SIZE - len(pieces))]
    return pieces


def build_tiny_tokenizer_object() -> Tokenizer:
    """The raw `tokenizers.Tokenizer` of `builtin:tiny`; identical on every call (no randomness)."""
    vocab: list[tuple[str, float]] = []
    for i, piece in enumerate(_tiny_pieces()):
        if i < len(SPECIAL_TOKENS):
            score = 0.0
        elif piece.startswith("<unused_"):
            score = -1e6  # never chosen: characters always give a cheaper segmentation
        else:
            score = -10.0 + 0.01 * len(piece)  # fewest tokens wins; ties go to longer pieces
        vocab.append((piece, score))
    tok = Tokenizer(models.Unigram(vocab, unk_id=UNK_ID, byte_fallback=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


@functools.cache
def _bpe_tokenizer_text() -> str:
    return BPE_TOKENIZER_FILE.read_text(encoding="utf-8")


def build_bpe_tokenizer_object() -> Tokenizer:
    """The raw `tokenizers.Tokenizer` of `builtin:bpe`, a fresh object each call, read from `BPE_TOKENIZER_FILE`
    (the file's text is read once per process)."""
    return Tokenizer.from_str(_bpe_tokenizer_text())


def build_builtin_tokenizer_object(spec: str) -> Tokenizer:
    """The raw `tokenizers.Tokenizer` of the built-in `spec` (one of `BUILTIN_SPECS`); ValueError for another."""
    if spec == BUILTIN_TINY:
        return build_tiny_tokenizer_object()
    if spec == BUILTIN_BPE:
        return build_bpe_tokenizer_object()
    raise ValueError(f"unknown builtin tokenizer {spec!r}; known: {', '.join(map(repr, BUILTIN_SPECS))}")


def _fast_tokenizer(backend: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    """`backend` as a transformers fast tokenizer with the built-in specials and chat template."""
    import transformers  # lazy: importing transformers is slow and environments do not need it

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The `builtin:tiny` tokenizer as a transformers fast tokenizer (pad=0, bos=1, eos=2, unk=3)."""
    return _fast_tokenizer(build_tiny_tokenizer_object())


def save_tiny_tokenizer(directory: str | os.PathLike[str]) -> str:
    """Write `builtin:tiny` to a folder loadable by `AutoTokenizer.from_pretrained(dir, local_files_only=True)`.

    Returns the folder path as a string.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(str(path))
    return str(path)


class BuiltinTokenizer:
    """A built-in tokenizer (`builtin:tiny`, `builtin:bpe`) without importing transformers, for checks that only
    encode and decode (`steps.run.check_prompts`). Promises exactly what `load_tokenizer(spec)` gives for the same
    calls: `encode(text, add_special_tokens=...)`, `decode(ids)` (special tokens kept), `bos_token_id`,
    `eos_token_id`, `pad_token_id`, `unk_token_id` and `len()` — that tokenizer hands them to the same
    `tokenizers` object, which adds no special tokens, and it cleans up no spaces. It has no chat template
    (`has_chat_template` is False): rendering chats needs `load_tokenizer`. TokenizerLoadError for another spec."""

    chat_template = None

    def __init__(self, spec: str) -> None:
        try:
            self.backend = build_builtin_tokenizer_object(spec)
        except ValueError as e:
            raise TokenizerLoadError(str(e)) from e
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = (
            self.backend.token_to_id(t) for t in SPECIAL_TOKENS
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text` (the built-ins add no special tokens either way)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included."""
        return str(self.backend.decode([int(t) for t in ids], skip_special_tokens=False))

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))


class TokenizerLoadError(ValueError):
    """A tokenizer spec could not be loaded; the message names the spec and the cause."""


def has_chat_template(tokenizer: object) -> bool:
    """True when the tokenizer carries a chat template (`apply_chat_template` can render messages)."""
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_lessons(lessons: Mapping[str, Any], tokenizer: object, tokenizer_spec: str = "model.tokenizer") -> None:
    """Raise ConfigError naming `lessons.<id>.chat` when a chat-formatted lesson meets a tokenizer without a chat
    template (`lessons`: lesson id -> LessonConfig)."""
    from pipeline.config import ConfigError

    if has_chat_template(tokenizer):
        return
    for lesson_id, lesson in lessons.items():
        if getattr(lesson, "chat", False):
            raise ConfigError(
                f"lessons.{lesson_id}.chat",
                True,
                f"the tokenizer ({tokenizer_spec}) has no chat template; use an instruct model's tokenizer or set "
                "chat: false",
            )


def render_chat(
    tokenizer: transformers.PreTrainedTokenizerFast,
    messages: list[dict[str, object]],
    tools: list[dict[str, object]] | None = None,
) -> list[int]:
    """The prompt ids of a conversation: `messages` (and `tools`) rendered by the tokenizer's chat template with the
    generation prompt appended (`apply_chat_template(tokenize=True, add_generation_prompt=True)`), exactly as
    the template says (no BOS added or removed). Raises ValueError when the tokenizer has no chat template."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    render: Any = tokenizer.apply_chat_template
    ids: Any = render(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):  # transformers versions returning a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def render_chats(
    tokenizer: transformers.PreTrainedTokenizerFast,
    chats: Sequence[tuple[list[dict[str, Any]], bool]],
    tools: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """The ids of each (messages, generation prompt) of `chats`, in order, each exactly what
    `apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt)` gives it
    (`render_chat` for a generation prompt). Promises the same ids at less cost: the template renders each distinct
    conversation once (the same `repr`, the same flag), in one batched call per flag, and the distinct texts are
    encoded in one tokenizer call, as `apply_chat_template` encodes its text (`tokenizer(text,
    add_special_tokens=False)`, no padding, no truncation). Raises ValueError when the tokenizer has no chat
    template; the template's errors propagate."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    distinct: dict[bool, dict[str, int]] = {True: {}, False: {}}
    convs: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
    where: list[tuple[bool, int]] = []  # chat k -> (its flag, its index among that flag's distinct conversations)
    for messages, gen in chats:
        gen = bool(gen)
        # repr tells apart what a template could render differently (key order, 1 and "1", True and 1; an
        # object without its own repr by its id)
        key = repr(messages)
        if key not in distinct[gen]:
            distinct[gen][key] = len(convs[gen])
            convs[gen].append(list(messages))
        where.append((gen, distinct[gen][key]))
    render: Any = tokenizer.apply_chat_template
    texts = {
        gen: list(render(convs[gen], tools=tools, tokenize=False, add_generation_prompt=gen)) if convs[gen] else []
        for gen in (True, False)
    }
    unique = list(dict.fromkeys(t for gen in (True, False) for t in texts[gen]))  # templates often ignore call ids
    if not unique:
        return []
    encoded: Any = tokenizer(unique, add_special_tokens=False, padding=False, truncation=False, max_length=None)
    ids = dict(zip(unique, ([int(t) for t in e] for e in encoded["input_ids"]), strict=True))
    return [list(ids[texts[gen][k]]) for gen, k in where]


def load_tokenizer(spec: str) -> transformers.PreTrainedTokenizerFast:
    """Load a tokenizer: `builtin:tiny`, `builtin:bpe`, or a local folder holding a Hugging Face tokenizer.

    Never downloads (`local_files_only=True`). Raises TokenizerLoadError naming the spec when the
    folder is missing or holds no loadable fast tokenizer.
    """
    import transformers

    if spec.startswith("builtin:"):
        try:
            return _fast_tokenizer(build_builtin_tokenizer_object(spec))
        except ValueError as e:
            raise TokenizerLoadError(str(e)) from e
    if not Path(spec).is_dir():
        known = " or ".join(map(repr, BUILTIN_SPECS))
        raise TokenizerLoadError(f"tokenizer folder {spec!r} does not exist (or spec is not {known})")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(spec, local_files_only=True, use_fast=True)
    except Exception as e:  # re-raised with the path named
        raise TokenizerLoadError(f"cannot load tokenizer from {spec!r}: {type(e).__name__}: {e}") from e
    if not isinstance(tok, transformers.PreTrainedTokenizerFast):
        raise TokenizerLoadError(f"tokenizer at {spec!r} is not a fast tokenizer ({type(tok).__name__})")
    return tok


EXPORT_INPUT_NAMES = ("input_ids", "attention_mask")
"""What an exported tokenizer returns when called: exactly the inputs a causal LM's `generate` takes."""


def save_for_export(tokenizer: transformers.PreTrainedTokenizerFast, directory: str | os.PathLike[str]) -> None:
    """Write `tokenizer` into the local folder `directory` for users of the exported model.

    Promises: `AutoTokenizer.from_pretrained(directory)(text)["input_ids"]` equals the prompt ids the rollout
    workers use (`pipeline.environments.base.encode_prompt(tokenizer, text)`: BOS first when the tokenizer has
    one), and the call returns only `input_ids` and `attention_mask`, so `model.generate(**enc)` works. The
    folder holds `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`.
    """
    import json

    from tokenizers import processors

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    probe = tokenizer.encode("a")
    if bos is not None and bos_id is not None and (not probe or probe[0] != bos_id):
        # The training prompt carries BOS but this tokenizer's own encoding does not add it: add it on export.
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
        backend.save(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_input_names"] = list(EXPORT_INPUT_NAMES)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
