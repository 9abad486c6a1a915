"""The long tier (`make test-guides`, marker `guides_long`; not in `make test` nor CI): every command block of the
guides that costs CPU-minutes to CPU-hours, or binds a fixed port, run exactly as written and checked against what
its page claims.

Each block is read from its page (`tests/test_guide_commands.py`'s `WHERE` names the test here that runs it: a
`LONG` entry) and run as that file runs blocks: each line as typed, a `make …` line as the Makefile's recipe line,
in one `bash -e` from a fresh page folder (links to the checkout's `configs/` and `.venv/`, so every `runs/…` the
page writes is new). Unlike the suite, the blocks run in the Makefile's environment without the suite's test XLA
flags (`tests/jobs.py`, `TEST_XLA_FLAGS`): as in a user's shell, so the figures the pages measured with `make`
(held-out success of an SFT policy, to the problem) apply. Blocks that build on each other run in one test, in page
order: the judged job, then its rescoring (docs/reference/steps.md) against the same judge; the distillation
guide's teacher, then its student.

The judge example serves on the fixed port 8000: its blocks run in a network namespace of their own (`unshare
--user --map-root-user --net`, loopback brought up inside), so nothing else on the machine can hold or take that
port; "the second shell" of the page is a background process in the same namespace. Without `unshare` the test
fails in one line (the tier needs it).

A learning claim is asserted with a stated margin below the page's smallest measured gain (the pipeline is
asynchronous: runs differ); the page's figures that do not depend on the asynchronous RL run (an SFT policy's
held-out success, a benchmark's table) are asserted as the page states them.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from jobs import TEST_XLA_FLAGS
from makefile import REPO, make_env
from test_guide_commands import (
    LONG,
    Block,
    block_lines,
    blocks_of,
    contract,
    learner_done,
    page_folder,
    run_block,
    run_script,
    shell_line,
)

from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
from schemas import ROLLOUT

pytestmark = pytest.mark.guides_long

MINUTE = 60


def user_env() -> dict[str, str]:
    """The Makefile's environment as a user's shell has it: without the suite's test XLA flags."""
    env = make_env()
    flags = " ".join(env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").split())
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def long_blocks(page: str, test: str) -> list[Block]:
    return blocks_of(page, test, LONG)


def run_long(block: Block, cwd: Path, minutes: float) -> subprocess.CompletedProcess[str]:
    return run_block(block, cwd, env=user_env(), timeout_s=minutes * MINUTE)


def success(root: Path, step: int, lesson: str) -> float:
    """Held-out `success_rate` of policy `step` on `lesson` (its evaluation summary)."""
    table = pq.read_table(root / layout.eval_summary_file(step, lesson))
    return float(table.to_pylist()[0]["success_rate"])


def finished_run(tmp_path: Path, page: str, test: str, run: str, steps: int, minutes: float) -> Path:
    """`page`'s block of `test` in a fresh page folder: the run root `runs/<run>` it writes completes its `steps`
    learner steps and has its report; returns the run root."""
    (block,) = long_blocks(page, test)
    cwd = page_folder(tmp_path)
    run_long(block, cwd, minutes)
    root = cwd / "runs" / run
    learner_done(root, steps)
    assert (root / "report" / "index.html").stat().st_size > 0, f"{root}: no report"
    return root


def tool_use_section(root: Path) -> None:
    assert "Tool use" in (root / "report" / "index.html").read_text(), f"{root}: no Tool use section in the report"


def held_out_gain(root: Path, lesson: str, steps: list[int], margin: float) -> list[float]:
    """Held-out success at `steps` (policy 0 first, the run's last policy last); asserts the last is at least
    `margin` above policy 0's. Prints them (`make test-guides` shows them)."""
    rates = [success(root, s, lesson) for s in steps]
    print(f"{root.name}: held-out success " + ", ".join(f"step {s} {r:.4f}" for s, r in zip(steps, rates, strict=True)))
    assert rates[-1] >= rates[0] + margin, f"{root}: held-out {rates[0]:.3f} -> {rates[-1]:.3f}, under +{margin}"
    return rates


# ---------------------------------------------------------------------------------------------
# minutes
# ---------------------------------------------------------------------------------------------


def test_bench_tokenizer_reproduces_the_table(tmp_path: Path) -> None:
    """The benchmark prints the reasoning-tasks guide's table: tokens per character of both tokenizers, the ratio,
    how many tasks fit a 32- and a 128-token row, and the 39 (and 4) tasks the page lists."""
    page = "docs/guides/reasoning-tasks.md"
    (block,) = long_blocks(page, "test_bench_tokenizer_reproduces_the_table")
    out = run_long(block, page_folder(tmp_path), 10).stdout
    text = (REPO / page).read_text()
    tiny, bpe, ratio = re.search(
        r"tokens per character of the questions \| ([\d.]+) \| ([\d.]+) \(([\d.]+)x", text
    ).groups()  # type: ignore[union-attr]
    assert f"tokens per character {tiny} (tiny) vs {bpe} (bpe), {ratio}x fewer tokens" in out, out[-1500:]
    fit = re.findall(r"tasks fitting a (\d+)-token row \| (\d+) \| (\d+) \|", text)
    assert [n for n, _, _ in fit] == ["32", "128"], fit
    for n, t, b in fit:
        assert f"tasks fitting a {n}-token row: tiny {t}, bpe {b}" in out, out[-1500:]
    listed = re.search(
        r"The 39\s+tasks fitting 128 tokens with `builtin:bpe`: (.*?) \(32 tokens:\s+(.*?)\)", text, re.S
    )
    assert listed is not None
    tasks_128, tasks_32 = (" ".join(g.split()) for g in listed.groups())  # the page wraps its lines
    assert f"bpe, 128-token rows: {tasks_128}" in out, out[-1500:]
    assert f"bpe, 32-token rows: {tasks_32}" in out, out[-1500:]


def test_uv_add_keeps_a_local_package_installed(tmp_path: Path) -> None:
    """In a copy of the repository (its tracked files, the checkout's `.tools/` uv; a `.venv` of its own, never the
    checkout's), `uv add --editable ../my_env` then `make setup` (the real make) record the package in
    pyproject.toml and uv.lock and install it, and it stays installed through the next `make setup` that syncs."""
    page = "docs/guides/environments.md"
    (block,) = long_blocks(page, "test_uv_add_keeps_a_local_package_installed")
    repo = tmp_path / "rlpipe"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, repo / rel)
    (repo / ".tools").symlink_to(REPO / ".tools")
    pkg = tmp_path / "my_env"
    (pkg / "my_env").mkdir(parents=True)
    (pkg / "my_env" / "__init__.py").write_text("MARK = 'my_env here'\n")
    (pkg / "pyproject.toml").write_text(
        '[project]\nname = "my_env"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n\n'
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    )
    env = {k: v for k, v in user_env().items() if k != "VIRTUAL_ENV"}
    try:
        run_script(block, block.text, repo, env=env, timeout_s=10 * MINUTE)  # `make setup` is the real make here
        project = tomllib.loads((repo / "pyproject.toml").read_text())
        assert any(d.replace("_", "-").startswith("my-env") for d in project["project"]["dependencies"]), project
        assert project["tool"]["uv"]["sources"]["my-env"] == {"path": "../my_env", "editable": True}
        assert 'name = "my-env"' in (repo / "uv.lock").read_text()
        check = ".venv/bin/python -c 'import my_env; print(my_env.MARK, my_env.__file__)'"
        assert str(pkg) in run_script("import my_env", check, repo, env=env).stdout
        # "my_env stays installed from now on": a later `make setup` that syncs (uv.lock newer than the stamp)
        run_script("make setup again", "touch uv.lock\nmake setup\n" + check, repo, env=env, timeout_s=10 * MINUTE)
    finally:
        shutil.rmtree(repo / ".venv", ignore_errors=True)  # 1.6 GB of hard links into uv's cache


def example_job(tmp_path: Path, test: str, run: str, steps: int) -> list[dict]:
    """bring-your-environment.md's block of `test` in a fresh page folder: `runs/<run>` completes its `steps`
    learner steps; its committed rollout rows."""
    (block,) = long_blocks("docs/guides/bring-your-environment.md", test)
    cwd = page_folder(tmp_path)
    run_long(block, cwd, 20)
    learner_done(cwd / "runs" / run, steps)
    rows = committed_rows(cwd / "runs" / run)
    assert rows
    return rows


def test_verifiers_example_job(tmp_path: Path) -> None:
    """The 2-step verifiers job (configs/verifiers_example.yaml, its own run root runs/verifiers_example) completes,
    every row with the reward components of verifiers' episode."""
    rows = example_job(tmp_path, "test_verifiers_example_job", "verifiers_example", 2)
    assert all(r["reward_components"] for r in rows), rows[:1]


def test_agent_example_job(tmp_path: Path) -> None:
    """The 4-step agent job (configs/agent_example.yaml): every row is a captured call of the agent script, with the
    two reward components it reports (how often it said "cat", a brevity bonus)."""
    rows = example_job(tmp_path, "test_agent_example_job", "agent_example", 4)
    assert all(len(dict(r["reward_components"])) == 2 for r in rows), rows[:1]


def committed_rows(root: Path, folder: str = layout.ROLLOUTS) -> list[dict]:
    store = RunStore(str(root))
    files = [f for d in store.list(folder) for f in store.list_committed(d)]
    return [r for f in files for r in store.read_committed(f, ROLLOUT).to_pylist()]


NAMESPACE = ("unshare", "--user", "--map-root-user", "--net")
"""A network namespace of the test's own (its loopback brought up first): port 8000 there is the test's alone."""

WAIT_FOR_8000 = """wait_for_judge() {
  .venv/bin/python -c '
import time, urllib.request
deadline = time.monotonic() + 600
while True:
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise SystemExit("nothing answers on 127.0.0.1:8000 after 600 s")
        time.sleep(0.2)
'
}"""
"""A shell function: returns once the judge answers on 127.0.0.1:8000 (a user waits for the second shell's line)."""


def in_second_shell(line: str) -> list[str]:
    """`line` (its words, without the comment that tells the user to use a second shell) started as from a second
    shell: in the background, its pid kept; the script's exit ends it whatever happened."""
    return [f"{shlex.join(shlex.split(line, comments=True))} &", "second_shell=$!"]


def end_second_shell() -> list[str]:
    """Stop the second shell's server with SIGTERM (a background process of a script ignores SIGINT, the signal a
    Ctrl-C in the second shell would send; the page names both): it must exit 0."""
    return ["kill -TERM $second_shell", "wait $second_shell"]


def test_judge_example_on_port_8000(tmp_path: Path) -> None:
    """bring-your-environment.md's judged job with its judge (policy 0 of the same run, `python -m steps.serve` on
    127.0.0.1:8000 "in a second shell"), then `make serve` of the same policy on port 8000, against which
    docs/reference/steps.md's two `make rescore` lines run: every training row holds the cats rule and the judge's
    score, the first rescore writes one new file per source file, the second (`--max_files 2`) two."""
    probe = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"the long tier needs `{' '.join(NAMESPACE)}` (port 8000 of its own): {probe.stderr.strip()}")
    test = "test_judge_example_on_port_8000"
    job, serve = long_blocks("docs/guides/bring-your-environment.md", test)
    (rescore,) = long_blocks("docs/reference/steps.md", test)
    lines = ["ip link set lo up", WAIT_FOR_8000, "trap 'kill -TERM $(jobs -p) 2>/dev/null || true' EXIT"]
    for ln in job.text.splitlines():
        if ln.strip():
            lines += in_second_shell(ln) if "in a second shell" in ln else [shell_line(ln)]
    lines += end_second_shell()
    (serve_line,) = block_lines(serve)
    lines += [*in_second_shell(serve_line), "wait_for_judge", *block_lines(rescore), *end_second_shell()]
    cwd = page_folder(tmp_path)
    run_script(f"{job} / {serve} / {rescore}", "\n".join(lines), cwd, env=user_env(), timeout_s=30 * MINUTE,
               prefix=NAMESPACE)  # fmt: skip

    root = cwd / "runs/judge_example"
    learner_done(root, 4)
    rows = committed_rows(root)
    assert rows
    for r in rows:
        comps = dict(r["reward_components"])
        assert set(comps) == {"cats", "judge"} and comps["judge"] in (0.0, 1.0), comps
        assert r["episode_reward"] == pytest.approx(comps["cats"] + comps["judge"]), r
    store = RunStore(str(root))
    sources = [f for d in store.list(layout.ROLLOUTS) for f in store.list_committed(d)]
    first = [f for d in store.list(f"{layout.RESCORED}/judge_number") for f in store.list_committed(d)]
    assert sorted(first) == sorted(layout.rescored_file("judge_number", s) for s in sources)
    second = [f for d in store.list(f"{layout.RESCORED}/judge_b") for f in store.list_committed(d)]
    assert len(second) == 2, second
    scored = committed_rows(root, f"{layout.RESCORED}/judge_number")
    assert scored and all(0.0 <= dict(r["reward_components"])["judge_number"] <= 1.0 for r in scored)
    yes = sum(dict(r["reward_components"])["judge"] for r in rows)
    print(f"judge_example: {len(rows)} judged rows ({yes:.0f} judged yes); {len(first)} files rescored into")
    print(f"judge_number ({len(scored)} rows), 2 into judge_b")


def test_distillation_teacher_then_student(tmp_path: Path) -> None:
    """The distillation guide's teacher (the 20-step demo job on runs/cats-teacher), then its student as the page
    writes it (the inline `python -m steps.run … --store.run_root runs/cats-opd --loss.distill.teacher …` command,
    once the teacher has committed a policy): the student's learner loads the teacher, and `teacher_kl` (the
    reverse-KL estimate) falls as the student matches it."""
    page = "docs/guides/distillation.md"
    (block,) = long_blocks(page, "test_distillation_teacher_then_student")
    text = (REPO / page).read_text()
    m = re.search(r"`(python -m steps\.run [^`]*--store\.run_root runs/cats-opd[^`]*)`", text)
    assert m is not None, "the student's command is not on the page"
    student = " ".join(m.group(1).split())
    cwd = page_folder(tmp_path)
    run_script(block, "\n".join([*block_lines(block), student]), cwd, env=user_env(), timeout_s=30 * MINUTE)
    learner_done(cwd / "runs/cats-teacher", 20)
    root = cwd / "runs/cats-opd"
    learner_done(root, 20)
    assert contract(root)["loss"]["distill"]["teacher"] == "runs/cats-teacher"
    logs = "".join(p.read_text(errors="replace") for p in (root / "logs").rglob("*.log"))
    assert "distillation teacher loaded" in logs
    kl = [r["teacher_kl"] for r in read_metrics(RunStore(str(root)), "learner") if "teacher_kl" in r]
    assert len(kl) >= 10, kl
    early, late = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"cats-opd: teacher_kl mean of the first 5 steps {early:.4f}, of the last 5 {late:.4f}")
    assert late < early, kl


# ---------------------------------------------------------------------------------------------
# the recipes (tens of CPU-minutes each)
# ---------------------------------------------------------------------------------------------


def test_basic_arithmetic_recipe(tmp_path: Path) -> None:
    """`make recipe`: SFT, the 75-step RL run, its evaluations at 0/25/50/75 and the report. The SFT policy's
    held-out success is the page's 0.172 (the same SFT bit for bit in every run); RL raises it by at least 10
    points (the page: +13.7, +16.0 and +19.5 in three runs)."""
    root = finished_run(tmp_path, "docs/guides/sft-and-recipe.md", "test_basic_arithmetic_recipe", "basic_arithmetic",
                        75, minutes=60)  # fmt: skip
    rates = held_out_gain(root, "arithmetic", [0, 25, 50, 75], margin=0.10)
    assert round(rates[0], 3) == 0.172, rates


TOOL_PAGE = "docs/guides/tool-use-recipe.md"


def test_tool_calculator_recipe(tmp_path: Path) -> None:
    """`make recipe RECIPE=tool_calculator`: SFT, 40 RL steps, evaluations at 0/20/40 and the report with its Tool
    use section. The SFT policy solves 43 of the 256 held-out problems (the page, both runs); RL raises that by at
    least 7 points at step 40 (the page: +10.2 and +14.1)."""
    root = finished_run(tmp_path, TOOL_PAGE, "test_tool_calculator_recipe", "tool_calculator", 40, minutes=90)
    tool_use_section(root)
    rates = held_out_gain(root, "calc", [0, 20, 40], margin=0.07)
    assert rates[0] == 43 / 256, rates


def tool_path(tmp_path: Path, test: str, run: str) -> list[float]:
    """The tool-use page's block for `test` (make sft, make run, make report) in a fresh page folder; the run
    `runs/<run>` completes its 20 steps with its report (Tool use section); held-out success at 0 and 20, policy 0
    within 3 problems of the class's 43/256 (the summary counts rows, and 0 to 3 episodes of the 256 are two rows),
    step 20 at least 5 points above (the page: +9.0 to +10.2 through the agent, +9.8 through verifiers)."""
    root = finished_run(tmp_path, TOOL_PAGE, test, run, 20, minutes=120)
    tool_use_section(root)
    rates = held_out_gain(root, "calc", [0, 20], margin=0.05)
    assert abs(rates[0] - 43 / 256) <= 3 / 256, rates
    return rates


def test_tool_calculator_agent(tmp_path: Path) -> None:
    """The tool task's RL through the openai-SDK agent (configs/tool_calculator_agent.yaml), from its own SFT."""
    tool_path(tmp_path, "test_tool_calculator_agent", "tool_calculator_agent")


def test_tool_calculator_verifiers(tmp_path: Path) -> None:
    """The tool task's RL as a verifiers environment (configs/tool_calculator_verifiers.yaml), from its own SFT."""
    tool_path(tmp_path, "test_tool_calculator_verifiers", "tool_calculator_verifiers")


PRIME_ANSWER = re.compile(r"<answer>\d+(?: × \d+)*</answer>")


def test_prime_factorization_recipe(tmp_path: Path) -> None:
    """`make recipe RECIPE=prime_factorization` runs end to end with `builtin:bpe` (SFT, 75 RL steps, evaluations
    at 0/25/50/75, the report); 255 of the SFT policy's 256 greedy held-out responses are a well-formed
    `<answer>… × …</answer>` (the page's), and it solves the page's 0.012 of the problems. The page claims no gain."""
    root = finished_run(tmp_path, "docs/guides/reasoning-tasks.md", "test_prime_factorization_recipe",
                        "prime_factorization", 75, minutes=180)  # fmt: skip
    rates = [success(root, s, "factors") for s in (0, 25, 50, 75)]
    print(f"prime_factorization: held-out success at steps 0/25/50/75: {rates}")
    assert round(rates[0], 3) == 0.012, rates
    responses = [r["response_text"] for r in pq.read_table(root / layout.eval_rollouts_file(0, "factors")).to_pylist()]
    assert len(responses) == 256
    bad = [t for t in responses if not PRIME_ANSWER.fullmatch(t.strip())]
    assert len(bad) <= 1, bad[:5]  # the page: 255 of 256 (one drops a `×`)
