"""The SFT step (`steps.sft`): response-only loss over packed rows, its loss falls, its policy is what an RL learner
starts from (bitwise), a SIGKILLed run resumes to the same parameters, and bad configs are one line, exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config.sft import FilesSourceConfig, ReasoningGymSourceConfig, SFTStepConfig
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.sft_data import RowStream, load_examples, pack_rows
from pipeline.store import layout
from pipeline.store.storage import RunStore

REPO = Path(__file__).resolve().parents[1]
MODEL = {
    "family": "llama",
    "hidden_dim": 32,
    "intermediate_dim": 64,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "max_seq_len": 48,
    "tokenizer": "builtin:tiny",
    "seed": 0,
}
SOURCE = {
    "type": "reasoning_gym",
    "task": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "n": 64,
    "env_args": {"seed": 0, "n_eval": 8},
}


def sft_yaml(root: Path, **over: object) -> dict:
    cfg = {
        "store": {"run_root": str(root)},
        "model": MODEL,
        "optimizer": {"learning_rate": 0.01},
        "source": SOURCE,
        "num_train_steps": 24,
        "batch_size": 4,
        "seq_len": 48,
        "checkpoint_interval": 4,
        "keep_checkpoints": 2,
    }
    cfg.update(over)
    return cfg


def parse(cfg: dict) -> SFTStepConfig:
    import draccus

    return draccus.decode(SFTStepConfig, cfg)


# ---------------------------------------------------------------------------------------------
# data: masks and packing (no JAX)
# ---------------------------------------------------------------------------------------------


def test_files_prompt_response_messages_and_parquet(tmp_path: Path) -> None:
    tok = load_tokenizer("builtin:tiny")
    jl = tmp_path / "a.jsonl"
    jl.write_text(
        json.dumps({"prompt": "1+2=", "response": "3"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "cat"}]})
        + "\n"
    )
    pq.write_table(pa.table({"prompt": ["2+2="], "response": ["4"]}), tmp_path / "b.parquet")
    cfg = SFTStepConfig(source=FilesSourceConfig(paths=[str(jl), str(tmp_path / "b.parquet")]), seq_len=32)
    ex = load_examples(cfg, tok)
    assert len(ex) == 3
    # prompt/response: BOS + prompt unmasked, response + EOS masked in
    assert ex[0].tokens == [tok.bos_token_id, *tok.encode("1+2="), *tok.encode("3"), tok.eos_token_id]
    assert ex[0].loss_mask == [0] * (1 + len(tok.encode("1+2="))) + [1] * (len(tok.encode("3")) + 1)
    # chat: loss exactly on the assistant's content and its EOS (the template's `<bos>assistant\n` is prompt)
    chat = ex[1]
    response = [t for t, m in zip(chat.tokens, chat.loss_mask, strict=True) if m]
    assert tok.decode(response) == "cat" + tok.eos_token
    assert ex[2].tokens[-2:] == [*tok.encode("4"), tok.eos_token_id]


def test_packing_segments_positions_and_resumable_order() -> None:
    tok = load_tokenizer("builtin:tiny")
    cfg = parse(sft_yaml(Path("unused")))
    examples = load_examples(cfg, tok)
    assert len(examples) == SOURCE["n"]
    rows = pack_rows(examples, 48)
    assert len(rows["tokens"]) < len(examples)  # several examples per row
    for r in range(len(rows["tokens"])):
        seg, pos = rows["segment_ids"][r], rows["position_ids"][r]
        for s in set(seg[seg >= 0].tolist()):
            idx = np.flatnonzero(seg == s)
            assert (pos[idx] == np.arange(len(idx))).all()  # positions restart per example
            assert rows["loss_mask"][r, idx[0]] == 0  # an example's first token is prompt (BOS)
        assert (rows["loss_mask"][r][seg < 0] == 0).all()
    # the rows of a step depend on (data, seed, step) alone: a fresh stream gives the same rows for step 7
    a = RowStream(examples, 48, 4, 0, True).batch(7)
    s = RowStream(examples, 48, 4, 0, True)
    s.batch(1)
    b = s.batch(7)
    assert all((a[k] == b[k]).all() for k in a)
    # reasoning-gym draws come from the lesson's train seeds: no eval question among them
    from pipeline.environments.reasoning_gym_env import ReasoningGymEnv

    src = cfg.source
    assert isinstance(src, ReasoningGymSourceConfig)
    env = ReasoningGymEnv(**src.lesson_env_args())
    eval_prompts = {encode(tok, ex.prompt) for ex in env.examples(8, np.random.default_rng(0), "eval")}
    assert not eval_prompts & {tuple(ex.tokens[: ex.loss_mask.index(1)]) for ex in examples}


def encode(tok: object, prompt: str) -> tuple[int, ...]:
    from pipeline.environments.base import encode_prompt

    return tuple(encode_prompt(tok, prompt))


# ---------------------------------------------------------------------------------------------
# the step: loss falls, RL starts from its policy bitwise
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("jax")
    from steps import sft

    root = tmp_path_factory.mktemp("sft")
    assert sft.main(parse(sft_yaml(root / "run"))) == 0
    return root / "run"


def _final_params(root: Path, steps: int = 24) -> list[np.ndarray]:
    from policy import model as M
    from policy import policy_format as pf

    cfg = parse(sft_yaml(root))
    vocab = M.model_vocab_size(load_tokenizer("builtin:tiny"))
    return M.numpy_params(pf.read_policy(RunStore(str(root)), steps, cfg.model, vocab))


def test_sft_loss_falls(sft_run: Path) -> None:
    """Response NLL of the training rows of step 1 under policy 0 vs the final policy: down by >= 30% (seed 0)."""
    import jax.numpy as jnp

    from policy import model as M
    from policy import policy_format as pf

    cfg = parse(sft_yaml(sft_run))
    tok = load_tokenizer("builtin:tiny")
    vocab = M.model_vocab_size(tok)
    rows = RowStream(load_examples(cfg, tok), 48, 4, 0, True).batch(1)
    mask = rows["loss_mask"]

    def nll(step: int) -> float:
        model = pf.read_policy(RunStore(str(sft_run)), step, cfg.model, vocab)
        lp = M.teacher_forced_logprobs(
            model, rows["tokens"], segment_ids=rows["segment_ids"], position_ids=rows["position_ids"]
        )
        return float(-(jnp.asarray(lp) * mask).sum() / mask.sum())

    first, last = nll(0), nll(24)
    assert last < 0.7 * first, (first, last)
    records = [
        json.loads(line)
        for f in sorted((sft_run / "metrics" / "learner").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert sorted(r["step"] for r in records) == list(range(1, 25))
    assert all(r["tokens_per_s"] > 0 and np.isfinite(r["loss"]) for r in records)


def test_rl_learner_starts_from_sft_policy_bitwise(sft_run: Path, tmp_path: Path) -> None:
    """`model.init_policy: <sft run>`: the RL learner's policy 0 is the SFT run's final policy, bit for bit."""
    from pipeline.config import LearnerStepConfig, ModelSpec, StoreConfig, TrainParams
    from policy import learner_loop
    from policy import model as M
    from policy import policy_format as pf

    spec = ModelSpec(**{**MODEL, "init_policy": str(sft_run)})
    config = LearnerStepConfig(
        store=StoreConfig(run_root=str(tmp_path / "rl")),
        model=spec,
        train=TrainParams(num_train_steps=2, batch_size=4, seq_len=32, replay_buffer_capacity=4),
    )
    learner = learner_loop.open_learner(config)
    state = learner_loop.resume(learner)
    assert state.step == 0
    vocab = learner.vocab_size
    rl0 = M.numpy_params(pf.read_policy(RunStore(str(tmp_path / "rl")), 0, spec, vocab))
    sft_final = _final_params(sft_run)
    assert len(rl0) == len(sft_final)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(rl0, sft_final, strict=True))
    # a policy step named explicitly works too; a missing one is a one-line config error
    from pipeline.config import ConfigError
    from pipeline.store.init_policy import resolve_init_policy

    assert resolve_init_policy(str(sft_run / layout.policy_dir(0)))[1] == 0
    with pytest.raises(ConfigError, match=r"model\.init_policy"):
        resolve_init_policy(str(tmp_path / "nothing"))


# ---------------------------------------------------------------------------------------------
# real processes: SIGKILL and resume; config errors
# ---------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}


@pytest.mark.slow
def test_sft_resumes_after_sigkill(sft_run: Path, tmp_path: Path) -> None:
    """`python -m steps.sft` killed (SIGKILL) after a checkpoint, then rerun: it resumes from the newest
    checkpoint and its final parameters equal, bitwise, the uninterrupted run's."""
    root = tmp_path / "killed"
    config_path = tmp_path / "sft.yaml"
    config_path.write_text(yaml.safe_dump(sft_yaml(root)))
    cmd = [sys.executable, "-m", "steps.sft", "--config_path", str(config_path)]
    store = RunStore(str(root))
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not store.exists(layout.checkpoint_marker(8)):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "no checkpoint 8 within 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not store.exists(layout.policy_marker(24)), "killed too late: the run had finished"
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming from checkpoint" in done.stderr
    killed, whole = _final_params(root), _final_params(sft_run)
    assert all(np.array_equal(a, b) for a, b in zip(killed, whole, strict=True))


def test_config_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    cases = [
        ({"source": {"type": "files", "paths": [str(tmp_path / "missing.jsonl")]}}, "source.paths"),
        ({"source": {**SOURCE, "task": "no_such_task"}}, "source.task"),
        ({"seq_len": 96}, "seq_len"),
    ]
    for over, field in cases:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(sft_yaml(tmp_path / "run", **over)))
        done = subprocess.run(
            [sys.executable, "-m", "steps.sft", "--config_path", str(path)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and len(errors) == 1 and f"{field}=" in errors[0], done.stderr[-2000:]
        assert not (tmp_path / "run" / "policies").exists()
