"""HF export (`python -m steps.export`, `make export`): a committed policy exported as a Hugging Face folder loads
with transformers and gives the same next-token logprobs as levanter (within 1e-4); the folder also loads back
into levanter; the exported tokenizer and `generate(**enc)` behave as the rollout workers do. (`make export RUN=…
STEP=… OUT=…` on a real run, the model read from run.json: tests/test_readme_commands.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from pipeline.config import ModelSpec  # noqa: E402
from pipeline.store.storage import RunStore  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}


def check_export(out: Path, model: object) -> None:
    """`out` loads in transformers (AutoModel + AutoTokenizer), matches `model`'s logprobs, and loads back."""
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


@pytest.mark.slow
def test_export_with_model_flags_loads_in_transformers(tmp_path: Path) -> None:
    """A run root without run.json: the model flags given on the command line describe the policy."""
    spec = ModelSpec(max_seq_len=32)
    store = RunStore(str(tmp_path / "run"))
    model = M.build_model(spec, VOCAB)
    pf.write_policy(store, 0, model, {"batch_slot": 0})
    out = tmp_path / "hf"
    subprocess.run(
        [sys.executable, "-m", "steps.export", "--store.run_root", str(tmp_path / "run"),
         "--model.max_seq_len", "32", "--step", "0", "--out", str(out)],
        cwd=REPO, check=True, env=ENV,
    )  # fmt: skip
    check_export(out, model)
    # round trip: the HF folder as a ModelSpec.hf_checkpoint gives the same weights
    back = M.build_model(ModelSpec(max_seq_len=32, hf_checkpoint=str(out)), VOCAB)
    for a, b in zip(M.numpy_params(model), M.numpy_params(back), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


# `make export RUN=… STEP=… OUT=…` on a real run (model from run.json): tests/test_readme_commands.py.


PROMPTS = ("Do you like cats?", "Tell me about your favorite animal.")


@pytest.mark.slow
def test_exported_folder_generates_like_our_sampler(tmp_path: Path) -> None:
    """The exported folder as a user loads it: `AutoTokenizer` encodes a prompt to the ids the rollout workers
    use (BOS included, no `token_type_ids`), `model.generate(**enc)` runs, and its greedy tokens equal the dense
    sampler's greedy tokens for the same prompt; the folder holds what vLLM/SGLang loaders read."""
    from pipeline.config import DenseInferenceConfig
    from pipeline.environments.base import encode_prompt
    from pipeline.environments.tokenizer import BOS_ID, load_tokenizer
    from policy.inference import GenerationRequest, make_backend

    spec = ModelSpec(max_seq_len=64)
    train_tok = load_tokenizer("builtin:tiny")
    model = M.build_model(spec, VOCAB)
    out = tmp_path / "hf"
    pf.export_hf(model, str(out), train_tok)

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):  # fmt: skip
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    gen_config = json.loads((out / "generation_config.json").read_text())
    assert (gen_config["bos_token_id"], gen_config["eos_token_id"], gen_config["pad_token_id"]) == (1, 2, 0)

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    sampler = make_backend(DenseInferenceConfig(max_seqs=4), model, train_tok, spec.max_seq_len, fast_compile=True)
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        assert set(enc) == {"input_ids", "attention_mask"}
        ids = enc["input_ids"][0].tolist()
        assert ids[0] == BOS_ID and ids == encode_prompt(train_tok, prompt)
        with torch.no_grad():
            generated = hf.generate(**enc, do_sample=False, max_new_tokens=12)[0, len(ids) :].tolist()
        ours = sampler.generate(
            GenerationRequest([ids], n=1, temperature=0.0, max_tokens=12, stop_tokens=None, seed=0)
        )[0][0].tokens
        assert len(generated) > 1 and generated == list(ours), (prompt, generated, ours)
        assert tok.decode(generated, skip_special_tokens=True) == train_tok.decode(ours, skip_special_tokens=True)


def test_published_hf_folder_is_committed_by_a_typed_marker(tmp_path: Path) -> None:
    """`policies/step-S/hf/COMMITTED` is an HfFolderMarker listing every file of the folder with its size and
    sha256, read back through from_json; a second publish of the same step writes nothing."""
    import hashlib
    from types import SimpleNamespace

    from pipeline.config import ServerInferenceConfig
    from pipeline.environments.tokenizer import load_tokenizer
    from policy.policy_format import publish_hf_if_needed, read_hf_marker

    spec = ModelSpec(max_seq_len=32)
    store = RunStore(str(tmp_path / "run"))
    pf.write_policy(store, 0, M.build_model(spec, VOCAB), {"batch_slot": 0})
    server = ServerInferenceConfig(export_hf=True, adapter="sglang", openai_base_url="http://127.0.0.1:1/v1")
    config = SimpleNamespace(inference=server, model=spec)
    assert read_hf_marker(store, 0) is None
    assert publish_hf_if_needed(store, config, 0, load_tokenizer(spec.tokenizer))
    marker = read_hf_marker(store, 0)
    assert marker is not None and marker.step == 0
    folder = tmp_path / "run" / "policies" / "step-00000000" / "hf"
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "COMMITTED")
    assert sorted(marker.files) == on_disk and "model.safetensors" in on_disk
    for name, f in marker.files.items():
        data = (folder / name).read_bytes()
        assert f.size == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()
    assert not publish_hf_if_needed(store, config, 0, load_tokenizer(spec.tokenizer))
