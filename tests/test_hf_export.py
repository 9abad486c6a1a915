"""HF export: a committed tiny policy exported by `python -m steps.learn export` loads with transformers and
gives the same next-token logprobs as levanter (within 1e-4); the folder also loads back into levanter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.config import ModelSpec  # noqa: E402
from pipeline.storage import RunStore  # noqa: E402
from policy import model as M  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


@pytest.mark.slow
def test_export_loads_in_transformers(tmp_path):
    spec = ModelSpec(max_seq_len=32)
    store = RunStore(str(tmp_path / "run"))
    model = M.build_model(spec, VOCAB)
    M.save_policy(store, 0, model, {"batch_slot": 0})
    out = tmp_path / "hf"
    subprocess.run(
        [sys.executable, "-m", "steps.learn", "export", "--store.run_root", str(tmp_path / "run"),
         "--model.max_seq_len", "32", "--step", "0", "--out", str(out)],
        cwd=REPO, check=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert (out / "config.json").exists()

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == VOCAB
    tokens = np.random.default_rng(0).integers(4, VOCAB, (2, 12))
    with torch.no_grad():
        logits = hf(torch.tensor(tokens)).logits.float()
    hf_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(tokens[:, 1:, None])).squeeze(-1).numpy()
    lev_lp = np.asarray(M.teacher_forced_logprobs(model, tokens))[:, 1:]
    np.testing.assert_allclose(hf_lp, lev_lp, atol=1e-4)

    # round trip: the HF folder as a ModelSpec.hf_checkpoint gives the same weights
    back = M.build_model(ModelSpec(max_seq_len=32, hf_checkpoint=str(out)), VOCAB)
    for a, b in zip(M.numpy_params(model), M.numpy_params(back), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
