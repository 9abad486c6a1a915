"""Schema contracts: lossless round trips, validation errors naming the field, versioned metadata."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import pyarrow as pa
import pytest

from schemas import (
    BATCH,
    DROPPED,
    EVAL_ROW,
    EVAL_SUMMARY,
    LINEAGE,
    ROLLOUT,
    SCHEMA_NAME_KEY,
    SCHEMA_VERSION_KEY,
    BatchRow,
    EvalRow,
    EvalSummaryRow,
    RolloutRow,
    SchemaMismatchError,
    ValidationError,
)
from schemas.base import Float32, Int8, arrow_schema
from schemas.rollout import validate_group


def rollout(**kw: object) -> RolloutRow:
    base: dict[str, object] = dict(
        rollout_id="w0-1-0",
        env_name="cats",
        example_id="ex0",
        lesson_id="l0",
        group_key="g0",
        prompt_tokens=[5, 6, 2_000_000_000],
        response_tokens=[7, 8, 9],
        response_logprobs=[-0.5, -0.25, -1.0],
        token_rewards=[0.0, 0.0, 1.0],
        response_loss_mask=[1, 0, 1],
        episode_reward=1.0,
        truncated=False,
        finish_reason="stop",
        temperature=0.5,
        policy_step=3,
        worker_id="w0",
        timestamp=1_732_000_000.123456,
    )
    base.update(kw)
    return RolloutRow(**base)  # type: ignore[arg-type]


def batch_row(**kw: object) -> BatchRow:
    base: dict[str, object] = dict(
        tokens=[1, 2, 3, 4, 0],
        loss_mask=[0, 1, 0, 1, 0],
        segment_ids=[0, 0, 1, 1, -1],
        position_ids=[0, 1, 0, 1, 0],
        advantages=[0.0, 0.5, 0.0, -0.5, 0.0],
        generator_logprobs=[0.0, -0.5, 0.0, -0.25, 0.0],
        reference_logprobs=None,
        truncated=[False, True],
        temperatures=[1.0, 0.5],
        policy_steps=[3, 4],
        rollout_ids=["a", "b"],
        source_files=["f1", "f2"],
    )
    base.update(kw)
    return BatchRow(**base)  # type: ignore[arg-type]


def test_rollout_round_trip_is_lossless() -> None:
    rows = [
        rollout(),
        rollout(
            rollout_id="w0-1-1",
            response_tokens=[],
            response_logprobs=[],
            token_rewards=[],
            response_loss_mask=[],
            truncated=True,
            finish_reason="length",
        ),
    ]
    table = ROLLOUT.to_table(rows)
    back = ROLLOUT.from_table(table)
    assert back == rows
    assert all(type(t) is int for t in back[0].prompt_tokens + back[0].response_tokens)
    assert back[0].prompt_tokens[-1] == 2_000_000_000
    assert type(back[0].timestamp) is float and back[0].timestamp == 1_732_000_000.123456  # float64 kept
    assert table.schema.field("timestamp").type == pa.float64()
    assert table.schema.metadata[SCHEMA_NAME_KEY] == b"rollout"
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == str(ROLLOUT.version).encode()


def test_batch_eval_and_summary_round_trips() -> None:
    b = [batch_row(), batch_row(reference_logprobs=[0.0, -0.5, 0.0, -0.25, 0.0])]
    assert BATCH.from_table(BATCH.to_table(b)) == b
    e = [EvalRow(**dataclasses.asdict(rollout()), eval_type="micro_eval")]
    assert EVAL_ROW.from_table(EVAL_ROW.to_table(e)) == e
    s = [EvalSummaryRow(3, "l0", "eval", 10, 0.5, 0.25, 12.5, 0.0, 0.5, "file.jsonl", 1_732_000_000.5)]
    assert EVAL_SUMMARY.from_table(EVAL_SUMMARY.to_table(s)) == s


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(response_logprobs=[-0.5]), "lengths disagree"),
        (dict(response_loss_mask=[1, 1]), "response_loss_mask=2"),
        (dict(episode_reward=math.nan), "episode_reward must be finite"),
        (dict(token_rewards=[0.0, math.inf, 1.0]), "token_rewards[1]"),
        (dict(rollout_id=""), "rollout_id must be a non-empty"),
        (dict(group_key=""), "group_key must be a non-empty"),
        (dict(prompt_tokens=[]), "prompt_tokens must not be empty"),
        (dict(response_tokens=[1.0, 2, 3]), "response_tokens must hold integers"),
        (dict(prompt_tokens=[True]), "prompt_tokens must hold integers"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(policy_step=-1), "policy_step must be >= 0"),
    ],
)
def test_rollout_validation_names_the_problem(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError) as ei:
        ROLLOUT.to_table([rollout(), rollout(**change)])
    assert fragment in str(ei.value) and "row 1" in str(ei.value)


def test_validation_can_be_skipped_but_arrow_types_still_hold() -> None:
    table = ROLLOUT.to_table([rollout(episode_reward=math.nan)], validate=False)
    assert math.isnan(table.column("episode_reward")[0].as_py())


def test_group_members_must_share_prompt_and_key() -> None:
    validate_group([rollout(), rollout(rollout_id="x")])
    validate_group([])
    with pytest.raises(ValidationError, match="do not share a prompt"):
        validate_group([rollout(), rollout(rollout_id="x", prompt_tokens=[5, 6, 7])])
    with pytest.raises(ValidationError, match="mixes keys"):
        validate_group([rollout(), rollout(group_key="g1")])


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(loss_mask=[0, 1, 0, 1]), "lengths disagree"),
        (dict(reference_logprobs=[0.0]), "reference_logprobs=1"),
        (dict(truncated=[False]), "truncated=1"),
        (dict(rollout_ids=["a", "b", "c"]), "rollout_ids=3"),
        (dict(loss_mask=[0, 1, 0, 1, 1]), "padding position"),
        (dict(tokens=[1, 2, 3, 4.5, 0]), "tokens must hold integers"),
    ],
)
def test_batch_row_checks(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError, match="batch@v2 row 0") as ei:
        BATCH.to_table([batch_row(**change)])
    assert fragment in str(ei.value)


def test_eval_summary_rates_checked() -> None:
    with pytest.raises(ValidationError, match="success_rate must be in"):
        EVAL_SUMMARY.to_table([EvalSummaryRow(3, "l0", "eval", 10, 0.5, 1.5, 1.0, 0.0, 0.5, "s", 0.0)])
    with pytest.raises(ValidationError, match="eval_type"):
        EVAL_ROW.to_table([EvalRow(**dataclasses.asdict(rollout()), eval_type="bogus")])


def test_check_metadata_and_conform() -> None:
    table = ROLLOUT.to_table([rollout()])
    ROLLOUT.check_metadata(table.schema.metadata, "f.parquet")
    newer = ROLLOUT.version + 1
    with pytest.raises(
        SchemaMismatchError,
        match=re.escape(f"f.parquet: expected schema rollout@v{newer}, found rollout@v{ROLLOUT.version}"),
    ):
        dataclasses.replace(ROLLOUT, version=newer).check_metadata(table.schema.metadata, "f.parquet")
    with pytest.raises(SchemaMismatchError, match="found <none>@v<none>"):
        ROLLOUT.check_metadata(None, "f.parquet")
    with pytest.raises(SchemaMismatchError, match="without columns \\['worker_id'\\]"):
        ROLLOUT.conform(table.drop_columns(["worker_id"]), "f.parquet")
    # extra columns are dropped, order is restored, narrower types are cast to the declared ones
    shuffled = table.select(list(reversed(table.column_names))).append_column("extra", pa.array([1]))
    widened = shuffled.set_column(shuffled.column_names.index("policy_step"), "policy_step", pa.array([3], pa.int32()))
    out = ROLLOUT.conform(widened, "f.parquet")
    assert out.schema.equals(ROLLOUT.arrow_schema(), check_metadata=True)
    assert ROLLOUT.from_table(out) == [rollout()]


def test_version_1_rollout_files_stay_readable(tmp_path) -> None:
    """A committed rollout file of version 1 (no top_p/top_k/min_p columns, none of version 3's) reads as the current
    version with the controls off and the text columns empty; the same for eval rows; a version 2 file (no text
    columns) reads with them empty; a version the spec cannot upgrade is still refused."""
    from pipeline.store.storage import RunStore
    from schemas.rollout import TEXT_COLUMNS_V3

    store = RunStore(str(tmp_path))
    v3_names = [n for n, _ in TEXT_COLUMNS_V3] + ["token_policy_steps"]  # with version 4's column

    def derived(row: RolloutRow) -> RolloutRow:  # before version 4 every token is of the row's policy step
        return dataclasses.replace(row, token_policy_steps=[row.policy_step] * len(row.response_tokens))

    v2_cols = [n for n in ROLLOUT.schema.names if n not in v3_names]
    v2 = dataclasses.replace(ROLLOUT, version=2, schema=pa.schema([ROLLOUT.schema.field(n) for n in v2_cols]))
    v2_row = rollout(top_k=7)
    store.commit_data(
        "rollouts/v2.parquet", ROLLOUT.to_table([v2_row]).select(v2_cols).replace_schema_metadata(v2.metadata), v2
    )
    v2_read = store.read_committed("rollouts/v2.parquet", ROLLOUT)
    assert v2_read is not None
    [v2_back] = ROLLOUT.from_table(v2_read)
    assert v2_back == derived(v2_row) and v2_back.top_k == 7 and v2_back.reward_components == {}
    assert v2_back.extracted_answer is None and v2_back.response_text == ""
    v1_cols = [n for n in v2_cols if n not in ("top_p", "top_k", "min_p")]
    v1 = dataclasses.replace(ROLLOUT, version=1, schema=pa.schema([ROLLOUT.schema.field(n) for n in v1_cols]))
    new = rollout(top_p=0.9, top_k=5, min_p=0.05)
    old_table = ROLLOUT.to_table([rollout(), new]).select(v1_cols).replace_schema_metadata(v1.metadata)
    store.commit_data("rollouts/old.parquet", old_table, v1)
    store.commit_data("rollouts/new.parquet", ROLLOUT.to_table([new]), ROLLOUT)
    old = store.read_committed("rollouts/old.parquet", ROLLOUT)
    assert old is not None and old.schema.metadata[SCHEMA_VERSION_KEY] == str(ROLLOUT.version).encode()
    assert ROLLOUT.from_table(old) == [derived(rollout())] * 2  # v1 did not record the controls: read as off
    read_new = store.read_committed("rollouts/new.parquet", ROLLOUT)
    assert read_new is not None
    [back] = ROLLOUT.from_table(read_new)
    assert (back.top_p, back.top_k, back.min_p) == (pytest.approx(0.9), 5, pytest.approx(0.05))
    ev_cols = [n for n in EVAL_ROW.schema.names if n not in ("top_p", "top_k", "min_p", *v3_names)]
    ev1 = dataclasses.replace(EVAL_ROW, version=1, schema=pa.schema([EVAL_ROW.schema.field(n) for n in ev_cols]))
    ev_table = EVAL_ROW.to_table([EvalRow(**dataclasses.asdict(rollout()), eval_type="eval")]).select(ev_cols)
    store.commit_data("evals/old.parquet", ev_table.replace_schema_metadata(ev1.metadata), ev1)
    ev = store.read_committed("evals/old.parquet", EVAL_ROW)
    assert ev is not None and EVAL_ROW.from_table(ev)[0].top_k == 0
    with pytest.raises(SchemaMismatchError, match=f"found rollout@v{ROLLOUT.version + 1}"):
        dataclasses.replace(ROLLOUT, version=ROLLOUT.version + 2, upgrades={2: lambda t: t}).check_metadata(
            dataclasses.replace(ROLLOUT, version=ROLLOUT.version + 1).metadata, "f.parquet"
        )


def test_sampling_controls_are_validated() -> None:
    for change, fragment in (({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p")):
        with pytest.raises(ValidationError, match=fragment):
            ROLLOUT.to_table([rollout(**change)])


def test_version_3_columns_round_trip_and_are_validated() -> None:
    """Response text, the extracted answer (or none), the ground truth, each reward function's value and the
    episode segment survive a write and read exactly; a non-finite component or a negative segment is refused."""
    row = rollout(
        response_text="the answer is <answer>3</answer>",
        extracted_answer="3",
        ground_truth="3",
        reward_components={"exact": 1.0, "format": 0.25},
        episode_id="w0-1-0",
        segment_index=1,
    )
    none_row = rollout(rollout_id="w0-1-1", extracted_answer=None)
    back = ROLLOUT.from_table(ROLLOUT.to_table([row, none_row]))
    assert back == [row, none_row]
    assert back[0].reward_components == {"exact": 1.0, "format": 0.25} and back[1].extracted_answer is None
    for change, fragment in (
        ({"reward_components": {"judge": float("nan")}}, "reward_components"),
        ({"segment_index": -1}, "segment_index"),
    ):
        with pytest.raises(ValidationError, match=fragment):
            ROLLOUT.to_table([rollout(**change)])


def test_version_4_token_policy_steps_round_trip_and_are_validated(tmp_path) -> None:
    """Per-token policy steps survive a write and read; a version-3 file reads with every token at the row's
    policy step; a list of another length, or with a step older than the row's policy_step, is refused."""
    from pipeline.store.storage import RunStore
    from schemas.rollout import oldest_token_step

    row = rollout(policy_step=4, response_tokens=[5, 6, 7], response_logprobs=[-1.0] * 3, token_rewards=[0.0] * 3)
    row = dataclasses.replace(row, response_loss_mask=[1, 1, 1], token_policy_steps=[4, 4, 5])
    assert ROLLOUT.from_table(ROLLOUT.to_table([row])) == [row]
    assert oldest_token_step(row) == 4 and oldest_token_step(dataclasses.replace(row, token_policy_steps=[])) == 4
    assert oldest_token_step(dataclasses.replace(row, token_policy_steps=[5, 5, 6])) == 5
    with pytest.raises(ValidationError, match="token_policy_steps"):
        ROLLOUT.to_table([dataclasses.replace(row, token_policy_steps=[4, 5])])
    with pytest.raises(ValidationError, match="older than policy_step 4"):
        ROLLOUT.to_table([dataclasses.replace(row, token_policy_steps=[3, 4, 4])])
    store = RunStore(str(tmp_path))
    v3_cols = [n for n in ROLLOUT.schema.names if n != "token_policy_steps"]
    v3 = dataclasses.replace(ROLLOUT, version=3, schema=pa.schema([ROLLOUT.schema.field(n) for n in v3_cols]))
    table = ROLLOUT.to_table([row, rollout(policy_step=2)]).select(v3_cols).replace_schema_metadata(v3.metadata)
    store.commit_data("rollouts/v3.parquet", table, v3)
    back = store.read_committed("rollouts/v3.parquet", ROLLOUT)
    assert back is not None and back.schema.metadata[SCHEMA_VERSION_KEY] == b"4"
    a, b = ROLLOUT.from_table(back)
    assert a.token_policy_steps == [4, 4, 4] and b.token_policy_steps == [2] * len(b.response_tokens)


SCHEMA_FINGERPRINTS = {
    "batch@v2": "313591b7e1801395",
    "dropped@v1": "cea7de843b2354c7",
    "eval_rollout@v4": "fb34944bed815300",
    "eval_summary@v3": "39c8653f8b34a0fc",
    "lineage@v1": "757c70ba08d8f02c",
    "rollout@v4": "a8b9d58bb26e58eb",
}
"""sha256 (first 16 hex digits) of each table's columns, read off its row dataclass: a changed row class (a field
added, moved, renamed, retyped or made nullable) changes the file format, so it must come with a new version (and
an upgrade for the files already written), and then a new line here."""


def test_the_columns_of_every_table_are_pinned_to_its_version() -> None:
    specs = [BATCH, DROPPED, EVAL_ROW, EVAL_SUMMARY, LINEAGE, ROLLOUT]
    found = {
        spec.tag: hashlib.sha256(spec.schema.to_string(show_schema_metadata=False).encode()).hexdigest()[:16]
        for spec in specs
    }
    assert found == SCHEMA_FINGERPRINTS


def test_arrow_schema_reads_types_widths_and_nullability_off_the_row_class() -> None:
    @dataclasses.dataclass
    class Row:
        name: str
        mask: list[Int8]
        score: Float32
        maybe: list[float] | None
        extra: dict[str, int]

    assert arrow_schema(Row) == pa.schema(
        [
            pa.field("name", pa.string(), nullable=False),
            pa.field("mask", pa.list_(pa.int8()), nullable=False),
            pa.field("score", pa.float32(), nullable=False),
            pa.field("maybe", pa.list_(pa.float64()), nullable=True),
            pa.field("extra", pa.map_(pa.string(), pa.int64()), nullable=False),
        ]
    )
