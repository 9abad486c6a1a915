"""One self-contained HTML report of a run, built from the run root alone (no tracker needed).

Reads (all relative to the run root, any fsspec URL: local path, file://, gs://, memory://):
    run.json                               the run config (a folded table) and its tokenizer
    metrics/{learner,batchmaker,rollout}/*.jsonl   metrics records (pipeline.telemetry.metrics), including the rollout
                                           workers' `samples` records (pipeline.rollout.samples)
    rollouts/step-P/*.parquet              the newest committed rollout file, decoded with the tokenizer that
                                           run.json's config.model.tokenizer names (sample completions)
    evals/*/<lesson>.summary.parquet       evaluation summaries (schemas.EVAL_SUMMARY): per checkpoint
                                           (step-S) and of external baselines (external-<name>)
    batches/log/step-T.json                committed batch slots; the data and dropped files they name
    batches/data/*.parquet                 only the `rollout_ids` lineage column of committed batches
    batches/dropped/*.parquet              rollouts dropped by the BatchMaker (schemas.dropped.DROPPED)
    curriculum/state-T.json                the newest readable state's "events" (every change so far)
    quarantine/*.json                      how many files were set aside

Writes `<out>/index.html` with every plot embedded as a base64 PNG (the page alone is the whole
report), and the same PNGs as `<out>/plots/<name>.png` for use elsewhere. The default `<out>` is
`<run_root>/report`, on a local run root and a remote one alike (uploaded there with the run root's storage
options; `--out` writes elsewhere, e.g. a local folder when the reader of a gs:// run may not write to it).

Sections, in page order (`SECTION_TITLES`): the curves first — reward per lesson, scorers (per reward function,
LLM judge or reward model: values, latency, failures, and why sampling calls committed nothing), tool use (turns,
tool calls and tool errors per episode, reward by the turn an episode ended at), evaluation, the learner
(one plot per term of its metrics record: loss, KL, entropy, clip fraction, ratio, grad norm, mismatch KL,
clamped fraction, skipped non-finite updates), staleness, throughput, learner idle time — then sample
completions (latest policy and recent ones), the summary table, rollout fates, curriculum events, and the run
config folded in a `<details>` at the end. A section without data says "no data" (a learner term no record
carries is named in a note); a section whose data is malformed says so with the error and the rest of the
report is still written.

Run it:
    python -m pipeline.report RUN_ROOT [--out DIR]      (or `make report RUN=...`)

Modules: `data` reads the run root into `RunData`, `sections` (with `learner` for the learner's curves, `text` for
the samples and config, `scorers` and `tools` for their sections) turns it into titled sections with plots (`plots`
holds the figure and table helpers), `page` renders and writes the HTML, `cli` is the command line.
"""

from pipeline.report.cli import main
from pipeline.report.data import METRIC_KINDS, RunData, load_run
from pipeline.report.page import build_report, default_out_dir, render_html
from pipeline.report.plots import Plot, Section, fmt
from pipeline.report.sections import SECTION_TITLES, SECTIONS

__all__ = [
    "METRIC_KINDS",
    "SECTIONS",
    "SECTION_TITLES",
    "Plot",
    "RunData",
    "Section",
    "build_report",
    "default_out_dir",
    "fmt",
    "load_run",
    "main",
    "render_html",
]
