"""Staging one rollout file: validate, group, score and measure every row (a pure function of the file and config).

What `stage` decides does not depend on the slot being built: malformed rows, zero-variance groups and
zero-advantage rows (under `filter_zero_variance`), and the overlong rule. Staleness and future policies depend
on the slot and are decided by the BatchMaker afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.batch_maker.arrays import column, list_parts, segment_any
from pipeline.batch_maker.chunk import NO_SIGNAL_DETAILS, NO_SIGNAL_REASONS, Chunk
from pipeline.config import TrainParams

LIST_COLUMNS = ("response_tokens", "response_logprobs", "token_rewards", "response_loss_mask")

Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass
class Staged:
    """One staged file: the chunk over *all* its rows, each row's drop `reason` ('' = admissible), `detail`,
    and the rows' policy steps."""

    chunk: Chunk
    reason: np.ndarray  # object: '' or a drop reason
    detail: np.ndarray  # object: why
    policy: np.ndarray  # int64


class _Verdicts:
    """Per-row drop reason and detail; the first reason given to a row sticks."""

    def __init__(self, n: int) -> None:
        self.reason = np.full(n, "", dtype=object)
        self.detail = np.full(n, "", dtype=object)

    def ok(self) -> np.ndarray:
        return self.reason == ""

    def malformed(self, mask: np.ndarray, why: str) -> None:
        sel = mask & self.ok()
        self.reason[sel] = "malformed"
        self.detail[sel] = why

    def set(self, mask: np.ndarray, reason: str, why: str) -> None:
        self.reason[mask] = reason
        self.detail[mask] = why


@dataclasses.dataclass
class _Columns:
    """The columns of a rollout table that staging reads, as numpy buffers."""

    p_vals: np.ndarray
    p_off: np.ndarray
    r_vals: np.ndarray
    r_off: np.ndarray
    lp_vals: np.ndarray
    m_vals: np.ndarray
    tr_vals: np.ndarray
    reward: np.ndarray
    policy: np.ndarray
    temperature: np.ndarray
    rollout_ids: pa.Array
    group_keys: pa.Array


def _check_rows(table: pa.Table, v: _Verdicts, dir_policy_step: int | None) -> _Columns:
    """Mark malformed rows (the detail says which check failed) and return the columns read."""
    p_vals, p_off, p_null = list_parts(table.column("prompt_tokens"))
    parts = {name: list_parts(table.column(name)) for name in LIST_COLUMNS}
    r_vals, r_off, _ = parts["response_tokens"]
    lp_vals, lp_off, _ = parts["response_logprobs"]
    tr_vals, tr_off, _ = parts["token_rewards"]
    any_null = p_null.copy()
    for name in LIST_COLUMNS:
        any_null |= parts[name][2]
    v.malformed(any_null, "a token list is null")
    lens = {name: np.diff(parts[name][1]) for name in LIST_COLUMNS}
    same = np.ones(table.num_rows, dtype=bool)
    for name in LIST_COLUMNS[1:]:
        same &= lens[name] == lens["response_tokens"]
    for i in np.flatnonzero(~same & v.ok()).tolist():
        v.reason[i] = "malformed"
        v.detail[i] = "lengths disagree: " + ", ".join(f"{k}={int(lens[k][i])}" for k in LIST_COLUMNS)
    v.malformed(np.diff(p_off) <= 0, "prompt_tokens is empty")
    reward = column(table, "episode_reward", np.float64)
    v.malformed(~np.isfinite(reward), "episode_reward is not finite")
    v.malformed(segment_any(~np.isfinite(lp_vals), lp_off), "response_logprobs holds a non-finite value")
    v.malformed(segment_any(~np.isfinite(tr_vals), tr_off), "token_rewards holds a non-finite value")
    v.malformed(segment_any(p_vals < 0, p_off) | segment_any(r_vals < 0, r_off), "negative token id")
    policy = column(table, "policy_step", np.int64)
    v.malformed(policy < 0, "policy_step is negative")
    if dir_policy_step is not None:
        v.malformed(policy != dir_policy_step, f"policy_step differs from its folder's step {dir_policy_step}")
    if "token_policy_steps" in table.column_names:
        _check_token_policy_steps(table, v, policy, lens["response_tokens"])
    temperature = column(table, "temperature", np.float32)
    v.malformed(~np.isfinite(temperature) | (temperature < 0), "temperature is not a finite value >= 0")
    rollout_ids = table.column("rollout_id").combine_chunks()
    group_keys = table.column("group_key").combine_chunks()
    v.malformed(np.asarray(pc.equal(pc.utf8_length(rollout_ids), 0).to_numpy(zero_copy_only=False)), "empty rollout_id")
    v.malformed(np.asarray(pc.equal(pc.utf8_length(group_keys), 0).to_numpy(zero_copy_only=False)), "empty group_key")
    m_vals = parts["response_loss_mask"][0]
    return _Columns(
        p_vals, p_off, r_vals, r_off, lp_vals, m_vals, tr_vals, reward, policy, temperature, rollout_ids, group_keys
    )


def _check_token_policy_steps(table: pa.Table, v: _Verdicts, policy: np.ndarray, r_len: np.ndarray) -> None:
    """Rollout schema v4 (partial rollouts): each token's policy step; empty means all at `policy_step`. The lag
    rule applies to the oldest token (`pipeline.store.staleness`): the BatchMaker applies it to
    `policy_step`, so a row whose tokens include one older than its `policy_step` (which would dodge the rule) is
    malformed, as is a list of another length than the response."""
    s_vals, s_off, s_null = list_parts(table.column("token_policy_steps"))
    s_len = np.diff(s_off)
    v.malformed(s_null | ((s_len != 0) & (s_len != r_len)), "token_policy_steps and response_tokens lengths disagree")
    older = np.asarray(s_vals, dtype=np.int64) < np.repeat(policy, s_len)
    v.malformed(segment_any(older, s_off), "token_policy_steps holds a step older than policy_step")


def episode_codes(table: pa.Table) -> np.ndarray:
    """Per row, its episode's code within the file: rows sharing a non-empty `episode_id` (the segments of one
    episode) share a code; every other row is an episode of its own."""
    n = table.num_rows
    if "episode_id" not in table.column_names:
        return np.arange(n, dtype=np.int64)
    ids = table.column("episode_id").to_pylist()
    if not any(ids):
        return np.arange(n, dtype=np.int64)
    # '\x00' + row number cannot collide with a real id's key ('\x01' + id)
    keys = [f"\x01{e}" if e else f"\x00{i}" for i, e in enumerate(ids)]
    _, codes = np.unique(np.asarray(keys, dtype=object), return_inverse=True)
    return np.asarray(codes, dtype=np.int64).reshape(-1)


def spread_over_episodes(reason: np.ndarray, detail: np.ndarray, episode: np.ndarray) -> None:
    """Whole episodes only: a row still admissible ('') whose episode has a dropped segment gets that segment's
    reason (the first such segment's), its detail saying so. In place."""
    dropped = reason != ""
    if not dropped.any() or dropped.all():
        return
    n_ep = int(episode.max()) + 1
    hit = np.zeros(n_ep, dtype=bool)
    hit[episode[dropped]] = True
    fix = ~dropped & hit[episode]
    if not fix.any():
        return
    d_idx = np.flatnonzero(dropped)
    eps, first = np.unique(episode[d_idx], return_index=True)
    src_of = np.full(n_ep, -1, dtype=np.int64)
    src_of[eps] = d_idx[first]
    for i in np.flatnonzero(fix).tolist():
        j = int(src_of[episode[i]])
        reason[i] = reason[j]
        detail[i] = f"another segment (row {j}) of its episode was dropped: {detail[j]}"


def _check_episodes(table: pa.Table, cols: _Columns, v: _Verdicts, episode: np.ndarray) -> None:
    """Segments of one episode must agree on `group_key` and `episode_reward` (else the episode is malformed);
    then a segment dropped so far takes its whole episode with it."""
    n = len(episode)
    if n and len(np.unique(episode)) < n:
        reward = cols.reward
        gk = np.asarray(cols.group_keys.dictionary_encode().indices.to_numpy(zero_copy_only=False), dtype=np.int64)
        _, first = np.unique(episode, return_index=True)
        rep = np.zeros(int(episode.max()) + 1, dtype=np.int64)
        rep[episode[first]] = first
        r0 = rep[episode]
        v.malformed(gk != gk[r0], "segments of its episode disagree on group_key")
        same_reward = (reward == reward[r0]) | (~np.isfinite(reward) & ~np.isfinite(reward[r0]))
        v.malformed(~same_reward, "segments of its episode disagree on episode_reward")
    spread_over_episodes(v.reason, v.detail, episode)


def _score_groups(
    cols: _Columns, v: _Verdicts, estimator: Estimator, filtering: bool, filter_no_signal: bool, episode: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group codes ((group_key, episode policy step) among well-formed rows; -1 elsewhere), advantages, and (with
    `filtering`, i.e. `train.filter_zero_variance`) each row's want of signal as a `NO_SIGNAL_REASONS` code; with
    `filter_no_signal` as well, zero-variance groups and zero-advantage rows are marked.

    The group's samples are episodes, not rows: the segments of one episode (`episode`, whole by now: see
    `_check_episodes`) are one sample whose reward is the episode's, the estimator sees one reward per episode,
    and every segment gets its episode's advantage. An episode's policy step is its oldest segment's.
    """
    n = len(v.reason)
    ok = v.ok()
    codes = np.full(n, -1, dtype=np.int64)
    advantage = np.zeros(n, dtype=np.float64)
    no_signal = np.zeros(n, dtype=np.int8)
    if not ok.any():
        return codes, advantage, no_signal
    reward = cols.reward
    # one representative row per episode (its first well-formed segment), the episode's oldest policy step
    ok_idx = np.flatnonzero(ok)
    eps, first = np.unique(episode[ok_idx], return_index=True)
    n_ep = int(episode.max()) + 1
    ep_policy = np.full(n_ep, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(ep_policy, episode[ok_idx], cols.policy[ok_idx])
    policy = np.where(ok, ep_policy[episode], 0)
    gk = np.asarray(cols.group_keys.dictionary_encode().indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    p_rel = policy - int(policy[ok].min())
    p_rel = np.where(ok, p_rel, 0)
    _, codes_all = np.unique(gk * (int(p_rel.max()) + 1) + p_rel, return_inverse=True)
    codes_all = codes_all.reshape(-1).astype(np.int64)
    codes[ok] = codes_all[ok]
    reps = ok_idx[first]
    ep_adv = np.zeros(n_ep, dtype=np.float64)
    ep_adv[eps] = estimator(reward[reps], codes[reps])
    advantage[ok] = ep_adv[episode[ok]]
    if filtering:
        n_codes = int(codes_all.max()) + 1
        gmax = np.full(n_codes, -np.inf)
        gmin = np.full(n_codes, np.inf)
        np.maximum.at(gmax, codes[ok], reward[ok])
        np.minimum.at(gmin, codes[ok], reward[ok])
        flat = ok & (gmax == gmin)[np.maximum(codes, 0)]
        zv, za = NO_SIGNAL_REASONS.index("zero_variance"), NO_SIGNAL_REASONS.index("zero_advantage")
        no_signal[flat] = zv
        no_signal[ok & ~flat & (advantage == 0.0)] = za
        if filter_no_signal:
            v.set(flat, "zero_variance", NO_SIGNAL_DETAILS[zv])
            v.set(v.ok() & (advantage == 0.0), "zero_advantage", NO_SIGNAL_DETAILS[za])
    return codes, advantage, no_signal


def _apply_overlong(
    p_len: np.ndarray, r_len: np.ndarray, v: _Verdicts, params: TrainParams
) -> tuple[np.ndarray, np.ndarray]:
    """(response lengths after cutting, which rows were cut) under the overlong rule; marks `too_long` drops."""
    seq_len = params.seq_len
    over = v.ok() & (p_len + r_len > seq_len)
    cut = np.zeros(len(p_len), dtype=bool)
    if not over.any():
        return r_len, cut
    prompt_full = over & (p_len >= seq_len)
    v.set(prompt_full, "too_long", "the prompt alone fills seq_len")
    rest = over & ~prompt_full
    if params.overlong == "drop":
        v.set(rest, "too_long", f"prompt + response exceed seq_len {seq_len} (overlong rule: drop)")
        return r_len, cut
    return np.where(rest, seq_len - p_len, r_len), rest


def _problem_keys(table: pa.Table) -> pa.Array:
    """env_name + '\\x1f' + example_id per row (pc.binary_join_element_wise costs seconds on first use)."""
    envs, examples = table.column("env_name").to_pylist(), table.column("example_id").to_pylist()
    return pa.array([f"{e}\x1f{x}" for e, x in zip(envs, examples, strict=True)], type=pa.string())


def stage(
    table: pa.Table,
    source_file: str,
    dir_policy_step: int | None,
    params: TrainParams,
    estimator: Estimator,
    *,
    filter_no_signal: bool = True,
) -> Staged:
    """Validate, group, score and measure all rows of one file; no row is admitted yet (`alive` all False).

    Zero-variance / zero-advantage filtering applies when `params.filter_zero_variance` and `filter_no_signal`.
    """
    n = table.num_rows
    v = _Verdicts(n)
    cols = _check_rows(table, v, dir_policy_step)
    episode = episode_codes(table)
    _check_episodes(table, cols, v, episode)
    codes, advantage, no_signal = _score_groups(
        cols, v, estimator, params.filter_zero_variance, filter_no_signal, episode
    )
    p_len = np.diff(cols.p_off)
    r_len, cut = _apply_overlong(p_len, np.diff(cols.r_off), v, params)
    spread_over_episodes(v.reason, v.detail, episode)  # a segment too long for seq_len takes its episode along
    truncated = np.asarray(table.column("truncated").to_numpy(), dtype=bool) | cut
    policy = cols.policy
    chunk = Chunk(
        source_file=source_file,
        seq=-1,
        policy_step=int(dir_policy_step if dir_policy_step is not None else (policy.max() if n else 0)),
        rows=np.arange(n, dtype=np.int64),
        rollout_ids=cols.rollout_ids,
        problems=_problem_keys(table),
        group=codes,
        episode=episode,
        reward=cols.reward,
        advantage=advantage.astype(np.float32),
        temperature=cols.temperature,
        truncated=truncated,
        cut=cut,
        prompt_len=p_len.astype(np.int64),
        resp_len=r_len.astype(np.int64),
        prompt_off=cols.p_off[:-1],
        resp_off=cols.r_off[:-1],
        prompt_vals=np.asarray(cols.p_vals, dtype=np.int32),
        resp_vals=np.asarray(cols.r_vals, dtype=np.int32),
        logprob_vals=np.asarray(cols.lp_vals, dtype=np.float32),
        reward_vals=np.asarray(cols.tr_vals, dtype=np.float32),
        mask_vals=np.asarray(cols.m_vals, dtype=np.int8),
        uses=np.zeros(n, dtype=np.int64),
        alive=np.zeros(n, dtype=bool),
        no_signal=no_signal,
    )
    return Staged(chunk, v.reason, v.detail, policy)
