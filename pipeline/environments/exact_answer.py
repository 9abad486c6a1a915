"""Exact-answer (and multiple-choice) problems read from a jsonl or parquet file, local or remote (gs://, ...).

Each row holds a prompt and an answer (`prompt_field`, `answer_field`; optionally `choices_field` for
multiple choice and `id_field` for stable ids). The file is read once, at construction, through fsspec
(`storage_options` are passed to the filesystem). A missing file raises FileNotFoundError naming the path;
a row without the needed fields becomes a per-example failure naming the row and the field.

Scoring: `verifier(response_text, answer) -> float | bool` (reward in [0, 1]; success iff reward >= 1).
The default verifier `normalized_match` compares normalised strings; pass a dotted path
(`package.module.function`) to plug in another.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import Any

import fsspec
import numpy as np
import pyarrow.parquet as pq

from pipeline.environments.base import (
    Example,
    Score,
    SingleTurnEnvironment,
    check_mode,
)
from pipeline.environments.loading import import_object

Verifier = Callable[[str, str], "float | bool"]

_ANSWER_PREFIX = re.compile(r"^\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)?\s*", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """Normalised answer text: first non-empty line, 'Answer:'/'the answer is' prefix removed, lowercased,
    whitespace collapsed, surrounding quotes/brackets and trailing '.', '!', '?' stripped."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    s = lines[0] if lines else ""
    s = _ANSWER_PREFIX.sub("", s)
    s = " ".join(s.lower().split())
    s = s.strip().rstrip(".!?").strip().strip("\"'`()[]").strip()
    return s


def normalized_match(response: str, answer: str) -> float:
    """1.0 when `normalize_answer(response) == normalize_answer(answer)`, else 0.0."""
    return 1.0 if normalize_answer(response) == normalize_answer(str(answer)) else 0.0


def read_rows(
    path: str,
    *,
    file_format: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[dict]:
    """The rows of a jsonl or parquet file (format from the extension unless given).

    Raises FileNotFoundError naming the path when it does not exist, ValueError naming the path and
    line for bad JSON or an unknown format.
    """
    fmt = file_format or (
        "parquet" if path.endswith(".parquet") else "jsonl" if path.endswith((".jsonl", ".json")) else None
    )
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"{path!r}: unknown format {file_format!r}; use a .jsonl/.parquet file or file_format=")
    fs, fpath = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(fpath):
        raise FileNotFoundError(f"exact-answer data file {path!r} does not exist")
    data = fs.cat_file(fpath)
    if fmt == "parquet":
        return [dict(r) for r in pq.read_table(io.BytesIO(data)).to_pylist()]
    rows: list[dict] = []
    for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} line {lineno}: invalid JSON: {e}") from e
        rows.append(obj if isinstance(obj, dict) else {"_value": obj})
    return rows


class ExactAnswerEnv(SingleTurnEnvironment):
    """Problems from a file, scored by a verifier (default: normalised exact match).

    The prompt is `prompt_template.format(prompt=<prompt field>)`; with `choices_field` the choices are
    appended as lines "A. ...", "B. ...", and an integer answer is taken as the index of the right choice
    (scored against its letter). Train mode draws rows with rng; eval mode walks the rows of `eval_path`
    (default: the training file) in order, cycling. Example ids: the `id_field` value when present, else
    `row-<index>` (`eval-<index>` for a separate eval file).
    """

    name = "exact_answer"

    def __init__(
        self,
        path: str,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        *,
        choices_field: str | None = None,
        id_field: str | None = "id",
        prompt_template: str = "{prompt}",
        verifier: str | None = None,
        eval_path: str | None = None,
        file_format: str | None = None,
        storage_options: dict[str, Any] | None = None,
        name: str | None = None,
        max_prompt_tokens: int | None = None,
        add_bos: bool = True,
    ) -> None:
        super().__init__(max_prompt_tokens=max_prompt_tokens, add_bos=add_bos)
        self.path = path
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.choices_field = choices_field
        self.id_field = id_field
        self.prompt_template = prompt_template
        if name:
            self.name = name
        self.verifier: Callable[[str, str], Any] = normalized_match
        if verifier is not None:
            try:
                fn = import_object(verifier)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"verifier {verifier!r} cannot be imported: {e}") from e
            if not callable(fn):
                raise ValueError(f"verifier {verifier!r} is not callable")
            self.verifier = fn
        self.rows = read_rows(path, file_format=file_format, storage_options=storage_options)
        if not self.rows:
            raise ValueError(f"exact-answer data file {path!r} holds no rows")
        self.eval_rows = (
            read_rows(eval_path, file_format=file_format, storage_options=storage_options) if eval_path else self.rows
        )
        if not self.eval_rows:
            raise ValueError(f"exact-answer eval file {eval_path!r} holds no rows")
        self._eval_prefix = "eval" if eval_path else "row"

    def _example(self, row: dict, index: int, prefix: str) -> Example:
        rid = row.get(self.id_field) if self.id_field else None
        example_id = str(rid) if rid is not None else f"{prefix}-{index}"
        where = f"{self.path!r} row {index}"
        for f in (self.prompt_field, self.answer_field):
            if row.get(f) is None:
                return Example(example_id, None, error=f"{where} lacks field {f!r}")
        prompt = self.prompt_template.format(prompt=row[self.prompt_field])
        answer: Any = row[self.answer_field]
        if self.choices_field is not None:
            choices = row.get(self.choices_field)
            if not isinstance(choices, list) or not choices:
                return Example(
                    example_id,
                    None,
                    error=f"{where} lacks a non-empty list field {self.choices_field!r}",
                )
            letters = [chr(ord("A") + i) for i in range(len(choices))]
            prompt += "".join(f"\n{letter}. {c}" for letter, c in zip(letters, choices, strict=True))
            if isinstance(answer, int) and not isinstance(answer, bool):
                if not 0 <= answer < len(choices):
                    return Example(
                        example_id,
                        None,
                        error=f"{where}: answer index {answer} out of range",
                    )
                answer = letters[answer]
        return Example(example_id, prompt, target=str(answer))

    def examples(self, n: int, rng: np.random.Generator, mode: str) -> list[Example]:
        check_mode(mode)
        if mode == "eval":
            m = len(self.eval_rows)
            return [self._example(self.eval_rows[i % m], i % m, self._eval_prefix) for i in range(n)]
        picks = rng.integers(0, len(self.rows), size=n)
        return [self._example(self.rows[int(i)], int(i), "row") for i in picks]

    def score(self, example: Example, text: str) -> Score:
        reward = float(self.verifier(text, str(example.target)))
        return Score(reward=reward, success=reward >= 1.0)
