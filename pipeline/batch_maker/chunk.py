"""`Chunk`: the live rows of one rollout file inside the BatchMaker's reservoir, as compact numpy buffers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from pipeline.batch_maker.arrays import ranges

NO_SIGNAL_REASONS = ("", "zero_variance", "zero_advantage")
"""`Chunk.no_signal` codes: the drop reason a row would have had for want of learning signal under
`train.filter_zero_variance` (0: it has signal)."""
NO_SIGNAL_DETAILS = ("", "all rewards of the group are equal", "advantage is exactly 0")
"""The detail of each `NO_SIGNAL_REASONS` drop."""


@dataclasses.dataclass
class Chunk:
    """Live rows of one source file: metadata arrays plus compact flat token buffers."""

    source_file: str
    seq: int
    policy_step: int
    rows: np.ndarray  # int64 row index in the source file
    rollout_ids: pa.Array  # string
    problems: pa.Array  # string: env_name + '\x1f' + example_id
    group: np.ndarray  # int64 group code within the file
    episode: np.ndarray  # int64 episode code within the file (segments of one episode share it; else one per row)
    reward: np.ndarray  # float64
    advantage: np.ndarray  # float32
    temperature: np.ndarray  # float32
    truncated: np.ndarray  # bool (rollout hit its limit, or cut to fit)
    cut: np.ndarray  # bool (cut to fit seq_len here)
    prompt_len: np.ndarray  # int64
    resp_len: np.ndarray  # int64 (after cutting)
    prompt_off: np.ndarray  # int64 starts into prompt_vals
    resp_off: np.ndarray  # int64 starts into resp_* values
    prompt_vals: np.ndarray  # int32
    resp_vals: np.ndarray  # int32
    logprob_vals: np.ndarray  # float32
    reward_vals: np.ndarray  # float32 per-token rewards (the rollouts' token_rewards), aligned with resp_vals
    mask_vals: np.ndarray  # int8
    uses: np.ndarray  # int64
    alive: np.ndarray  # bool
    no_signal: np.ndarray  # int8 index into NO_SIGNAL_REASONS (rows admitted without signal by the no-signal fill)

    @property
    def n_alive(self) -> int:
        """Rows of this chunk still live in the reservoir."""
        return int(self.alive.sum())

    def nbytes(self) -> int:
        """Bytes held by this chunk's arrays."""
        arrays = (self.rows, self.group, self.episode, self.reward, self.advantage, self.temperature, self.truncated,
                  self.cut, self.prompt_len, self.resp_len, self.prompt_off, self.resp_off, self.prompt_vals,
                  self.resp_vals, self.logprob_vals, self.reward_vals, self.mask_vals, self.uses,
                  self.alive, self.no_signal)  # fmt: skip
        return sum(a.nbytes for a in arrays) + self.rollout_ids.nbytes + self.problems.nbytes

    def take(self, keep: np.ndarray) -> Chunk:
        """A compact copy holding only rows `keep` (indices), token buffers re-gathered."""
        p_idx = ranges(self.prompt_off[keep], self.prompt_len[keep])
        r_idx = ranges(self.resp_off[keep], self.resp_len[keep])
        p_len, r_len = self.prompt_len[keep], self.resp_len[keep]
        keep_arr = pa.array(keep, type=pa.int64())
        return Chunk(
            source_file=self.source_file,
            seq=self.seq,
            policy_step=self.policy_step,
            rows=self.rows[keep],
            rollout_ids=self.rollout_ids.take(keep_arr),
            problems=self.problems.take(keep_arr),
            group=self.group[keep],
            episode=self.episode[keep],
            reward=self.reward[keep],
            advantage=self.advantage[keep],
            temperature=self.temperature[keep],
            truncated=self.truncated[keep],
            cut=self.cut[keep],
            prompt_len=p_len,
            resp_len=r_len,
            prompt_off=np.cumsum(p_len) - p_len,
            resp_off=np.cumsum(r_len) - r_len,
            prompt_vals=np.ascontiguousarray(self.prompt_vals[p_idx]),
            resp_vals=np.ascontiguousarray(self.resp_vals[r_idx]),
            logprob_vals=np.ascontiguousarray(self.logprob_vals[r_idx]),
            reward_vals=np.ascontiguousarray(self.reward_vals[r_idx]),
            mask_vals=np.ascontiguousarray(self.mask_vals[r_idx]),
            uses=self.uses[keep],
            alive=self.alive[keep],
            no_signal=self.no_signal[keep],
        )
