"""Exact-answer (and multiple-choice) problems read from a jsonl or parquet file, local or remote (gs://, ...).

Each row holds a prompt and an answer (`prompt_field`, `answer_field`; optionally `choices_field` for
multiple choice and `id_field` for stable ids). The file is read once, at construction, through fsspec
(`storage_options` are passed to the filesystem). A missing file raises FileNotFoundError naming the path;
a row without the needed fields becomes a per-example failure naming the row and the field.

Before anything starts, the config validators call `ExactAnswerEnv.check_args` (the `Environment` hook), which
refuses (`ConfigError` naming the argument) a `path` / `eval_path` that does not exist, is a folder, has a format
other than JSON lines or parquet, holds no rows, holds a line that is not JSON, or whose rows never carry the
prompt / answer / choices field. A local file is read in full; a remote one (gs://, ...) is only looked up, within
`CHECK_TIMEOUT_S` seconds (a store that does not answer by then is refused rather than retried for minutes).

Scoring: `verifier(response_text, answer) -> float | bool` (reward in [0, 1]; success iff reward >= 1).
The default verifier `normalized_match` compares normalised strings; `verifier: math_verify` checks mathematical
equivalence with math-verify (`math_verify_match`: LaTeX, boxed answers, fractions and decimals); pass a dotted path
(`package.module.function`) to plug in another. Rows keep the response, the answer the named verifiers extract (none
for a plugged-in one) and the reference answer.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import numpy as np
import pyarrow.parquet as pq

from pipeline.config.base import ConfigError
from pipeline.environments.base import (
    Example,
    Score,
    SingleTurnEnvironment,
    check_mode,
)
from pipeline.environments.loading import import_object
from pipeline.store.urls import is_local, local_path

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


MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own time limit per parse / comparison, in seconds, applied in the main thread only (see
`math_verify_match`)."""
_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def _math_verify_timeout() -> int | None:
    # math-verify times out with signal.alarm, which only the main thread may set (elsewhere it raises ValueError):
    # in other threads it runs without its time limit
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_parse(text: str) -> list[Any]:
    from math_verify import parse

    return list(parse(text, parsing_timeout=_math_verify_timeout()))  # type: ignore[arg-type]


def math_verify_answer(response: str) -> str | None:
    """The answer math-verify reads from `response` (the last `\\boxed{}`, LaTeX or plain expression; inside the
    last `<answer>…</answer>` when there is one), as the text it matched; None when it finds none."""
    tags = _ANSWER_TAG.findall(response)
    parsed = _math_parse(tags[-1] if tags else response)
    return str(parsed[-1]) if parsed else None


def math_verify_match(response: str, answer: str) -> float:
    """1.0 when math-verify (`math_verify.parse` + `verify`) finds the response's answer mathematically equal to
    `answer` (LaTeX, `\\boxed{}`, fractions, decimals, numeric equivalence), else 0.0.

    The response is read as by `math_verify_answer`; the reference is parsed as it is, else wrapped in `$...$`
    (plain LaTeX like `\\frac{1}{2}`). An answer math-verify cannot read, or a check that times out, scores 0.0.
    math-verify's time limit (`MATH_VERIFY_TIMEOUT_S`) uses SIGALRM, so it applies in the main thread only; called
    from another thread the check runs without it."""
    from math_verify import verify

    gold = _math_parse(str(answer)) or _math_parse(f"${answer}$")
    tags = _ANSWER_TAG.findall(response)
    pred = _math_parse(tags[-1] if tags else response)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=_math_verify_timeout()) else 0.0


VERIFIERS: dict[str, Verifier] = {"normalized_match": normalized_match, "math_verify": math_verify_match}
"""Named verifiers (`verifier: <name>`); any other value is a dotted path to a function."""
EXTRACTORS: dict[Verifier, Callable[[str], str | None]] = {
    normalized_match: normalize_answer,
    math_verify_match: math_verify_answer,
}
"""How the named verifiers read the answer out of a response (kept on rollout rows as `extracted_answer`)."""


FORMATS = ("jsonl", "parquet")
"""The accepted data formats: JSON lines (`.jsonl`, `.json`: one JSON object per line) and parquet (`.parquet`)."""
CHECK_TIMEOUT_S = 15.0
"""How long `ExactAnswerEnv.check_args` waits for a remote store to say whether a data file exists."""


def data_format(path: str, file_format: str | None = None) -> str | None:
    """`file_format` when given, else the format the extension names (`.parquet`; `.jsonl`/`.json`), else None."""
    if file_format:
        return file_format
    return "parquet" if path.endswith(".parquet") else "jsonl" if path.endswith((".jsonl", ".json")) else None


def _format_problem(path: str, file_format: str | None) -> str | None:
    if file_format is not None and file_format not in FORMATS:
        return f"file_format {file_format!r} is not supported: use one of {FORMATS}"
    if data_format(path, file_format) is None:
        ext = os.path.splitext(path.rstrip("/"))[1] or "no extension"
        return (
            f"unsupported format ({ext}): the exact-answer environment reads JSON lines (.jsonl, .json) or "
            "parquet (.parquet) files; set env_args.file_format for another extension"
        )
    return None


def _parse_jsonl(data: bytes, path: str) -> list[dict]:
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


def read_rows(
    path: str,
    *,
    file_format: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[dict]:
    """The rows of a jsonl or parquet file (format from the extension unless given).

    Raises FileNotFoundError naming the path when it does not exist, ValueError naming the path and
    line for bad JSON, a folder, or an unknown format.
    """
    problem = _format_problem(path, file_format)
    if problem is not None:
        raise ValueError(f"{path!r}: {problem}")
    fmt = data_format(path, file_format)
    fs, fpath = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(fpath):
        raise FileNotFoundError(f"exact-answer data file {path!r} does not exist")
    if fs.isdir(fpath):
        raise ValueError(f"exact-answer data file {path!r} is a folder, not a file")
    data = fs.cat_file(fpath)
    if fmt == "parquet":
        return [dict(r) for r in pq.read_table(io.BytesIO(data)).to_pylist()]
    return _parse_jsonl(data, path)


def _local_problem(path: str, local: str, fmt: str, required: list[str]) -> str | None:
    """Why the local data file `path` (on disk at `local`, which exists and is a file) cannot be used (None: it
    can): unreadable, no rows, bad rows."""
    try:
        if fmt == "parquet":
            try:
                meta = pq.read_metadata(local)
            except Exception as e:
                return f"is not a readable parquet file ({type(e).__name__}: {' '.join(str(e).split())})"
            columns = set(meta.schema.names)
            n_rows = meta.num_rows
        else:
            with open(local, "rb") as f:
                data = f.read()
            try:
                rows = _parse_jsonl(data, path)
            except UnicodeDecodeError as e:
                return f"is not UTF-8 text (JSON lines): {e}"
            except ValueError as e:
                return str(e).removeprefix(f"{path!r} ")
            columns = {k for r in rows for k in r}
            n_rows = len(rows)
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    if n_rows == 0:
        return "holds no rows"
    missing = [c for c in required if c not in columns]
    if missing:
        found = sorted(columns)[:10]
        return f"no row has the field(s) {missing} (fields found: {found})"
    return None


def _remote_problem(path: str, storage_options: Mapping[str, Any] | None, timeout_s: float) -> str | None:
    """Why the remote data file `path` cannot be used (None: it exists and is a file), looked up within
    `timeout_s` seconds in a daemon thread (a store that does not answer is not waited for)."""
    result: list[str | None] = []

    def look() -> None:
        try:
            fs, fpath = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
            info = fs.info(fpath)
            result.append("is a folder, not a data file" if info.get("type") == "directory" else None)
        except FileNotFoundError:
            result.append("no such file")
        except Exception as e:
            result.append(f"cannot be looked up ({type(e).__name__}: {' '.join(str(e).split())[:300]})")

    t = threading.Thread(target=look, name="exact-answer-check", daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        return (
            f"could not be looked up within {timeout_s:g} s (storage unreachable or credentials missing? "
            "check env_args.storage_options)"
        )
    return result[0]


def check_data_file(
    path: str,
    *,
    file_format: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    required: list[str] | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> str | None:
    """Why the data file `path` cannot be used (a short reason), or None: the checks of the module docstring."""
    local = local_path(path) if is_local(path) else None
    if local is not None and not os.path.exists(local):
        return "no such file"
    if local is not None and os.path.isdir(local):
        return "is a folder, not a data file (name the .jsonl / .parquet file inside it)"
    problem = _format_problem(path, file_format)
    if problem is not None:
        return problem
    if local is None:
        return _remote_problem(path, storage_options, timeout_s)
    return _local_problem(path, local, data_format(path, file_format) or "jsonl", list(required or []))


class ExactAnswerEnv(SingleTurnEnvironment):
    """Problems from a file, scored by a verifier (default: normalised exact match).

    The prompt is `prompt_template.format(prompt=<prompt field>)`; with `choices_field` the choices are
    appended as lines "A. ...", "B. ...", and an integer answer is taken as the index of the right choice
    (scored against its letter). Train mode draws rows with rng; eval mode walks the rows of `eval_path`
    (default: the training file) in order, cycling. Example ids: the `id_field` value when present, else
    `row-<index>` (`eval-<index>` for a separate eval file).
    """

    name = "exact_answer"

    @classmethod
    def check_args(cls, env_args: Mapping[str, Any]) -> None:
        """Refuse (ConfigError naming the argument) a `path` / `eval_path` that cannot be read: see the module
        docstring. Missing or misspelled arguments are left to the constructor's signature check."""
        file_format = env_args.get("file_format")
        if file_format is not None and file_format not in FORMATS:
            raise ConfigError("file_format", file_format, f"must be one of {FORMATS} or null (from the extension)")
        storage_options = env_args.get("storage_options")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError("storage_options", storage_options, "must be a mapping of fsspec options")
        required = [
            str(env_args.get("prompt_field", "prompt")),
            str(env_args.get("answer_field", "answer")),
        ]
        if env_args.get("choices_field"):
            required.append(str(env_args["choices_field"]))
        for arg in ("path", "eval_path"):
            if arg not in env_args or (arg == "eval_path" and env_args[arg] is None):
                continue
            value = env_args[arg]
            if not isinstance(value, str) or not value:
                raise ConfigError(arg, value, "must be the path or URL of a .jsonl or .parquet file")
            problem = check_data_file(
                value, file_format=file_format, storage_options=storage_options, required=required
            )
            if problem is not None:
                raise ConfigError(arg, value, problem)

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
        if verifier in VERIFIERS:
            self.verifier = VERIFIERS[verifier]
        elif verifier is not None:
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

    def reference_response(self, example: Example) -> str | None:
        """The row's answer itself (a choice's letter for multiple choice): what the verifier must accept."""
        return None if example.target is None else str(example.target)

    def score(self, example: Example, text: str) -> Score:
        reward = float(self.verifier(text, str(example.target)))
        extract = EXTRACTORS.get(self.verifier)
        return Score(reward=reward, success=reward >= 1.0, extracted_answer=extract(text) if extract else None)
