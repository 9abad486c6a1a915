"""Retention: deleting old policies, checkpoints, rollout and batch data from a run root while keeping lineage.

What is kept (`pipeline.config.RetentionConfig`, the job's `retention:` section; rules in `retention.keep`): policy
0 (the reference model), the newest `keep_policies` committed policies, every `keep_every`-th, every policy the next
batch slot may still use (staleness window) and every policy with an unfinished evaluation; the newest
`keep_checkpoints` committed checkpoints and every `keep_checkpoint_every`-th. Rollout and batch data files go once
the batch slot that last used or dropped their rows is `data_window_slots` older than the newest committed slot and
consumed by the newest checkpoint, every row of the rollout file has a recorded fate, the file is out of the
BatchMaker's scan window and not in its reservoir. Batch log entries, dropped records, evaluations, metrics and
curriculum states stay.

Lineage first: before deleting the data files of slots `a..b`, a run commits `lineage/slots-a-b-<attempt>.parquet`
(`schemas.lineage.LINEAGE`: rollout_id, source_file, policy_step, fate, slot), so "what happened to rollout X"
and the report still answer from the run root.

Deletion order (a reader never sees a commit marker without its data):
- a data file with a ready marker: the marker first (the file becomes uncommitted, invisible to every reader),
  then the data;
- a policy or checkpoint folder: `COMMITTED` first, then every other file of the folder.
A run writes its plan (`gc/plan-N.json`, create-if-absent) before its first deletion and `gc/plan-N.done.json`
after its last; a run killed at any point leaves at worst uncommitted leftovers named by its plan, which the next
run deletes before planning anew. One run at a time holds the `gc` lease.
"""

from pipeline.retention.collect import Collector, GcResult, RunFacts, collect
from pipeline.retention.keep import data_horizon, kept_checkpoints, kept_policies
from pipeline.retention.lineage import build_index, covered_through, index_files, read_index

__all__ = [
    "Collector",
    "GcResult",
    "RunFacts",
    "build_index",
    "collect",
    "covered_through",
    "data_horizon",
    "index_files",
    "kept_checkpoints",
    "kept_policies",
    "read_index",
]
