"""The README's commands run as a user runs them, against one short job, each checked by its effect.

The report's plot names are read from the report paragraph of the docs (`docs/reference/metrics.md`; `docs_text`
reads README.md and every page under docs/).

One module-scoped run root is built by the README's bounded step commands (`make rollout`, `make batches`,
`make learn` with the flags the README shows, run side by side as a user would in three terminals); then
`make evaluate`, `make report` and `make export` run on it. Commands are the Makefile's own recipe lines
(`tests/makefile.py`), since `make` itself would first re-sync the environment. `make demo` and `make run` are
covered by `test_demo` and the `test_job_*` files.

The report is also opened in a real browser when a `chromium` binary is on PATH (headless screenshot); without
one that test is skipped, so CI skips it unless chromium is installed.
"""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from jobs import job_config
from makefile import REPO, make_env, recipe_command, wait_all

from pipeline.store import layout
from pipeline.store.storage import RunStore

pytestmark = pytest.mark.slow

NUM_STEPS = 2
STEP_TIMEOUT_S = 600


def _run(target: str, timeout: float = STEP_TIMEOUT_S, **variables: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(recipe_command(target, **variables), cwd=REPO, env=make_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, f"make {target} failed:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root made by the three bounded step commands of the README, run at the same time."""
    tmp = tmp_path_factory.mktemp("readme")
    root = tmp / "run"
    # kl_coef > 0: the learner logs KL, so every learner plot the README names is drawn
    # the bounded steps run side by side: each may wait for the others' work (polling.bounded_wait_s) as long as a
    # loaded CI machine needs, rather than the scheduled-job default of 10 s
    overrides = {"train.num_train_steps": str(NUM_STEPS), "loss.kl_coef": "0.01", "polling.bounded_wait_s": "600"}
    config = job_config(tmp, str(root), **overrides)
    common = {"CONFIG": str(config), "RUN": str(root)}
    args = {
        "rollout": "--worker_id w7 --max_rollouts 1024 --follow true",
        "batches": f"--max_batches {NUM_STEPS}",
        "learn": f"--max_steps {NUM_STEPS}",
    }
    logs = {target: tmp / f"{target}.log" for target in args}
    procs = {}
    for target, a in args.items():
        with logs[target].open("w") as log:
            cmd = recipe_command(target, ARGS=a, **common)
            procs[target] = subprocess.Popen(cmd, cwd=REPO, env=make_env(), stdout=log, stderr=subprocess.STDOUT)
    errors = wait_all(procs, logs, STEP_TIMEOUT_S)
    assert not errors, errors
    _run("evaluate", ARGS="--steps [0,2]", **common)
    return root


def test_bounded_steps_commit_their_work(run_root: Path) -> None:
    store = RunStore(str(run_root))
    assert store.exists(layout.policy_marker(NUM_STEPS)), "make learn --max_steps 2 published policy 2"
    assert [s for s in range(1, NUM_STEPS + 1) if store.exists(layout.batch_log_entry(s))] == [1, 2]
    files = [r for d in store.list(layout.ROLLOUTS) for r in store.list_committed(d)]
    assert files and all("/w7" in f for f in files), files  # --worker_id w7
    # make evaluate ARGS="--steps [0,2]": exactly those policies were scored
    assert store.exists(layout.eval_summary_file(0, "cats")) and store.exists(layout.eval_summary_file(2, "cats"))
    assert not store.exists(layout.eval_summary_file(1, "cats"))


class _Page(html.parser.HTMLParser):
    """Section titles (h2), image alts per section, and the tags each section holds."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: dict[str, list[str]] = {}
        self.tags: dict[str, list[str]] = {}
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h2":
            self._in_h2 = True
        elif self.sections:
            self.tags[self.sections[-1]].append(tag)
            if tag == "img":
                self.images[self.sections[-1]].append(dict(attrs).get("alt") or "")

    def handle_endtag(self, tag: str) -> None:
        self._in_h2 = self._in_h2 and tag != "h2"

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.sections.append(data)
            self.images[data], self.tags[data] = [], []


def docs_text() -> str:
    """The user documentation: README.md and every page under docs/, one string."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def readme_report_plots() -> list[str]:
    """The plot names the report paragraph of the docs (docs/reference/metrics.md) promises."""
    m = re.search(r"Its\s+plots,\s+in\s+page\s+order[^:]*:(.*?)\.\n", docs_text(), re.S)
    assert m, "the docs' report paragraph lists no plots"
    names = re.findall(r"`([a-z_]+)`", m.group(1))
    assert len(names) >= 10
    return names


@pytest.fixture(scope="module")
def report_page(run_root: Path) -> Path:
    out = _run("report", RUN=str(run_root)).stdout.strip().splitlines()[-1]
    assert Path(out) == run_root / "report" / "index.html"
    return Path(out)


def test_make_report_has_every_plot_the_readme_names_and_samples(report_page: Path, run_root: Path) -> None:
    page = _Page()
    page.feed(report_page.read_text())
    drawn = [alt for alts in page.images.values() for alt in alts]
    missing = [name for name in readme_report_plots() if name not in drawn]
    assert not missing, f"plots the README names but the report lacks: {missing} (drawn: {drawn})"
    assert page.sections.index("Reward per lesson") == 0  # the curves lead
    assert page.sections[-1] == "Run config" and "details" in page.tags["Run config"]
    assert page.sections.index("Sample completions") < page.sections.index("Summary")
    text = report_page.read_text()
    samples = text[text.index("<h2>Sample completions</h2>") :].split("</section>")[0]
    assert samples.count('<td class="text">') >= 2, "no decoded sample completions"
    assert "Recent policies" in samples, "no samples records of recent policies"
    # the samples metrics record each rollout worker writes per policy step
    records = [
        json.loads(line)
        for f in (run_root / "metrics" / "rollout").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    logged = [r for r in records if r.get("event") == "samples"]
    assert logged and all(r["samples"] and r["samples"][0]["prompt"] for r in logged)
    assert len({r["policy_step"] for r in logged}) == len(logged)  # one per policy step (one worker)


def test_make_export_needs_only_run_step_out_and_generates(run_root: Path, tmp_path: Path) -> None:
    """`make export RUN=… STEP=… OUT=…` on a real run whose model is not the default shape: the model comes from
    run.json; the folder matches the policy's logprobs in transformers (within 1e-4) and `generate(**enc)` runs;
    without STEP the newest committed policy is exported."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import draccus
    from test_hf_export import VOCAB, check_export

    from pipeline.config import ModelSpec
    from policy import policy_format as pf

    store = RunStore(str(run_root))
    spec = draccus.decode(ModelSpec, json.loads(store.get(layout.RUN_CONFIG))["config"]["model"])
    assert spec != ModelSpec(), "the test needs a model whose shape differs from the default"
    out = tmp_path / "hf"
    _run("export", RUN=str(run_root), STEP="1", OUT=str(out))
    check_export(out, pf.read_policy(store, 1, spec, VOCAB))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    enc = tok("Do you like cats?", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > enc["input_ids"].shape[1]

    newest = tmp_path / "hf-newest"  # no STEP: policy NUM_STEPS, the newest
    _run("export", RUN=str(run_root), OUT=str(newest))
    check_export(newest, pf.read_policy(store, NUM_STEPS, spec, VOCAB))
    assert (newest / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()


def chromium() -> str | None:
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


@pytest.mark.skipif(chromium() is None, reason="no chromium binary on PATH (apt-get install chromium to run it)")
def test_report_renders_in_headless_chromium(report_page: Path, tmp_path: Path) -> None:
    """The page as a browser draws it: a screenshot that is mostly not blank, with the first plot in it."""
    from PIL import Image

    shot = tmp_path / "report.png"
    subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600",
         f"--screenshot={shot}", report_page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    image = Image.open(shot).convert("L")
    assert image.size == (1200, 1600)
    hist = image.histogram()
    non_white = sum(hist[:250]) / (image.size[0] * image.size[1])
    assert non_white > 0.05, f"the screenshot is nearly blank ({non_white:.1%} non-white pixels)"
