"""SFT examples and their packed rows (JAX-free): what `steps.sft` trains on.

An example is a token list with a loss mask: 0 on prompt tokens, 1 on response tokens (and the EOS that ends a
response), so the loss is on response tokens only. Examples come from `pipeline.config.sft` sources:

- files: jsonl / parquet records of `prompt` + `response` (the prompt encoded as a lesson encodes it:
  `pipeline.environments.base.encode_prompt`, BOS + text, or the chat template with `chat`; the response's tokens
  then EOS), or `messages` (a chat rendered by the tokenizer's chat template, with the record's `tools` function
  schemas when it has them, as a tool-using lesson renders its prompts; loss on the tokens each assistant message
  adds);
- reasoning_gym: the lesson's own training draws (`ReasoningGymEnv.examples(n, rng, "train")`), the reference
  answer rendered in the lesson's answer format.

Rows: examples are packed greedily in order into rows of `seq_len` tokens, each example its own segment
(`segment_ids` 0, 1, … within the row, -1 in padding; `position_ids` restart at 0), so attention never crosses two
examples (`policy.model.attention_mask`) and no token is predicted from another example's tokens. The order of
the examples is reshuffled for every pass over the data (seeded), so the rows of optimizer step t depend only on
(data, seed, t): a resumed run sees exactly the rows an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.config.base import ConfigError
from pipeline.config.sft import FilesSourceConfig, ReasoningGymSourceConfig, SFTStepConfig
from pipeline.environments.base import encode_prompt

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training example: token ids and a loss mask of the same length (1: a response token)."""

    tokens: list[int]
    loss_mask: list[int]


# ---------------------------------------------------------------------------------------------
# examples
# ---------------------------------------------------------------------------------------------


def load_examples(config: SFTStepConfig, tokenizer: Any) -> list[SFTExample]:
    """Every example of `config.source`, tokenized (see the module docstring)."""
    source = config.source
    if isinstance(source, FilesSourceConfig):
        return [_record_example(r, source, tokenizer, config.chat, where) for where, r in read_records(source)]
    if isinstance(source, ReasoningGymSourceConfig):
        return reasoning_gym_examples(source, tokenizer, config.chat)
    raise ConfigError("source.type", type(source).__name__, "unknown SFT source")


def read_records(source: FilesSourceConfig) -> list[tuple[str, dict[str, Any]]]:
    """(`file:line` or `file:row`, record) of every record of the source's files, in order."""
    import fsspec
    import pyarrow.parquet as pq

    out: list[tuple[str, dict[str, Any]]] = []
    for path in source.paths:
        with fsspec.open(path, "rb", **source.storage_options) as f:
            if path.endswith(".parquet"):
                for i, row in enumerate(pq.read_table(f).to_pylist()):
                    out.append((f"{path}:row {i}", row))
                continue
            for i, line in enumerate(f.read().decode("utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError("source.paths", path, f"line {i} is not JSON: {e}") from None
                if not isinstance(record, dict):
                    raise ConfigError("source.paths", path, f"line {i} is not a JSON object")
                out.append((f"{path}:{i}", record))
    return out


def _record_example(
    record: dict[str, Any], source: FilesSourceConfig, tokenizer: Any, chat: bool, where: str
) -> SFTExample:
    prompt, response = record.get(source.prompt_field), record.get(source.response_field)
    if isinstance(prompt, str) and isinstance(response, str):
        return prompt_response_example(tokenizer, prompt, response, chat)
    messages = record.get(source.messages_field)
    if isinstance(messages, list) and messages:
        tools = record.get("tools")
        return chat_example(tokenizer, messages, tools if isinstance(tools, list) else None)
    raise ConfigError(
        "source.paths",
        where,
        f"a record needs string fields {source.prompt_field!r} and {source.response_field!r}, "
        f"or a list {source.messages_field!r}",
    )


def prompt_response_example(tokenizer: Any, prompt: str, response: str, chat: bool = False) -> SFTExample:
    """The prompt as a lesson encodes it (loss 0), then the response's tokens and EOS (loss 1)."""
    p = encode_prompt(tokenizer, prompt, add_bos=True, chat=chat)
    r = [int(t) for t in tokenizer.encode(response)] + [int(tokenizer.eos_token_id)]
    return SFTExample(p + r, [0] * len(p) + [1] * len(r))


def chat_example(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> SFTExample:
    """A chat rendered by the tokenizer's chat template (offering `tools`, OpenAI function schemas, when given),
    loss on the tokens each assistant message adds.

    The rendering of messages[:i+1] must extend that of messages[:i] (with the generation prompt before an
    assistant message), as chat templates do; ValueError otherwise."""
    render: Any = tokenizer.apply_chat_template

    def ids(msgs: Sequence[dict[str, Any]], gen: bool) -> list[int]:
        kwargs: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools else {}
        out: Any = render(list(msgs), tokenize=True, add_generation_prompt=gen, **kwargs)
        return [int(t) for t in (out if isinstance(out, list) else out["input_ids"])]

    tokens: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        assistant = m.get("role") == "assistant"
        if assistant:  # the generation prompt belongs to the prompt side
            before = ids(messages[:i], True)
            if before[: len(tokens)] != tokens:
                raise ValueError("the chat template's rendering is not incremental")
            mask += [0] * (len(before) - len(tokens))
            tokens = before
        after = ids(messages[: i + 1], False)
        if after[: len(tokens)] != tokens:
            raise ValueError("the chat template's rendering is not incremental")
        mask += [int(assistant)] * (len(after) - len(tokens))
        tokens = after
    return SFTExample(tokens, mask)


def answer_template(source: ReasoningGymSourceConfig) -> str:
    """The response template of a reasoning-gym source (its own, or the lesson's answer format's)."""
    if source.answer_template is not None:
        return source.answer_template
    fmt = source.env_args.get("answer_format", "tag")
    if fmt == "tag":
        tag = source.env_args.get("answer_tag", "answer")
        return f"<{tag}>{{answer}}</{tag}>"
    if fmt == "boxed":
        return "\\boxed{{{answer}}}"
    return "{answer}"


def reasoning_gym_examples(source: ReasoningGymSourceConfig, tokenizer: Any, chat: bool = False) -> list[SFTExample]:
    """`source.n` training draws of the lesson `source` describes, each answered with its reference answer."""
    from pipeline.environments.reasoning_gym_env import ReasoningGymEnv

    env = ReasoningGymEnv(**source.lesson_env_args())
    template = answer_template(source)
    out = []
    for ex in env.examples(source.n, np.random.default_rng(source.draw_seed), "train"):
        if ex.prompt is None:
            logger.warning("skipped %s: %s", ex.example_id, ex.error)
            continue
        entry = ex.target[0]
        out.append(prompt_response_example(tokenizer, ex.prompt, template.format(answer=entry["answer"]), chat))
    return out


# ---------------------------------------------------------------------------------------------
# packed rows
# ---------------------------------------------------------------------------------------------

ROW_FIELDS = ("tokens", "segment_ids", "position_ids", "loss_mask")


def pack_rows(examples: Sequence[SFTExample], seq_len: int, pack: bool = True) -> dict[str, np.ndarray]:
    """Rows [R, seq_len] of the examples in order (module docstring); examples longer than `seq_len` are left out
    (the caller counts them with `too_long`). Without `pack`, one example per row."""
    rows: list[list[SFTExample]] = []
    used = seq_len
    for ex in examples:
        n = len(ex.tokens)
        if n > seq_len:
            continue
        if not pack or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += n
    R = len(rows)
    out = {
        "tokens": np.zeros((R, seq_len), np.int32),
        "segment_ids": np.full((R, seq_len), -1, np.int32),
        "position_ids": np.zeros((R, seq_len), np.int32),
        "loss_mask": np.zeros((R, seq_len), np.float32),
    }
    for r, row in enumerate(rows):
        at = 0
        for seg, ex in enumerate(row):
            n = len(ex.tokens)
            out["tokens"][r, at : at + n] = ex.tokens
            out["segment_ids"][r, at : at + n] = seg
            out["position_ids"][r, at : at + n] = np.arange(n)
            out["loss_mask"][r, at : at + n] = ex.loss_mask
            at += n
    return out


def too_long(examples: Sequence[SFTExample], seq_len: int) -> int:
    """How many examples do not fit in one row."""
    return sum(len(ex.tokens) > seq_len for ex in examples)


class RowStream:
    """The rows of every optimizer step: pass e over the data packs the examples in the order of a permutation
    seeded by (seed, e); step t takes rows t·B … t·B + B - 1 of the concatenated passes."""

    def __init__(self, examples: Sequence[SFTExample], seq_len: int, batch_size: int, seed: int, pack: bool) -> None:
        self.examples = [ex for ex in examples if len(ex.tokens) <= seq_len]
        if not self.examples:
            raise ConfigError("seq_len", seq_len, "no example fits in one row")
        self.seq_len, self.batch_size, self.seed, self.pack = seq_len, batch_size, seed, pack
        self._passes: dict[int, dict[str, np.ndarray]] = {}
        self._counts: dict[int, int] = {}

    def rows_of_pass(self, e: int) -> dict[str, np.ndarray]:
        """The packed rows of pass `e` (cached: the newest few)."""
        if e not in self._passes:
            order = np.random.default_rng([self.seed, e]).permutation(len(self.examples))
            self._passes = {k: v for k, v in self._passes.items() if k >= e - 1}
            self._passes[e] = pack_rows([self.examples[i] for i in order], self.seq_len, self.pack)
            self._counts[e] = len(self._passes[e]["tokens"])
        return self._passes[e]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The [batch_size, seq_len] row arrays of optimizer step `step` (1-based)."""
        picked: dict[str, list[np.ndarray]] = {k: [] for k in ROW_FIELDS}
        g = (step - 1) * self.batch_size  # global row index
        # passes hold the same examples, so their row counts differ by packing order only: walk them in order
        e, start = 0, 0
        while len(picked["tokens"]) < self.batch_size:
            R = self._counts[e] if e in self._counts else len(self.rows_of_pass(e)["tokens"])
            if g < start + R:
                rows = self.rows_of_pass(e)
                for k in ROW_FIELDS:
                    picked[k].append(rows[k][g - start])
                g += 1
            else:
                start += R
                e += 1
        return {k: np.stack(v) for k, v in picked.items()}
