"""Model families beyond Llama: for Qwen2 (also Qwen2.5), Mistral and Gemma a tiny random Hugging Face model built
locally with transformers loads through `model.hf_checkpoint`, gives transformers' logits (within 1e-4, f32
CPU), trains one learner step, exports back to a Hugging Face folder that transformers loads with the trained
model's logits. `model.hf_checkpoint: gs://…` is copied from the GCS emulator and loads the same weights bit for
bit; a checkpoint of another family is refused naming `model.family`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_learner import make_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")

from pipeline.config import (  # noqa: E402
    ConfigError,
    DenseInferenceConfig,
    LearnerStepConfig,
    ModelSpec,
    OptimizerSpec,
    TrainParams,
)
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from policy import families  # noqa: E402
from policy import learner as L  # noqa: E402
from policy import mesh as mesh_lib  # noqa: E402
from policy import model as M  # noqa: E402

VOCAB, SEQ = 512, 16
ATOL = 1e-4
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
}


def tiny_hf_model(family: str, out: Path) -> object:
    """A seeded random transformers model of `family`, saved to `out` (config.json + model.safetensors)."""
    config_cls, model_cls, extra = HF_CLASSES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE, **extra)).eval()
    if family == "qwen2":  # transformers initialises biases to 0: make them matter
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    hf.save_pretrained(out)
    return hf


def hf_logits(hf: object, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.float().numpy()  # type: ignore[operator]


TOKENS = np.random.default_rng(0).integers(4, VOCAB, (2, SEQ))


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_family_round_trip(family: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(family, tmp_path / "hf")
    spec = ModelSpec(family=family, hf_checkpoint=str(tmp_path / "hf"), max_seq_len=SEQ)
    model = M.build_model(spec, VOCAB)
    np.testing.assert_allclose(np.asarray(M.forward_logits(model, TOKENS)), hf_logits(hf, TOKENS), atol=ATOL)

    # one learner step on a real batch
    config = LearnerStepConfig(
        model=spec,
        train=TrainParams(batch_size=4, seq_len=SEQ, replay_buffer_capacity=4, num_train_steps=1),
        optimizer=OptimizerSpec(learning_rate=1e-2),
    )
    lm = mesh_lib.build_mesh(config.mesh)
    optimizer = L.build_optimizer(config.optimizer, 1)
    state = L.shard_state(L.LearnerState(0, model, optimizer.init(M.eqx.filter(model, M.eqx.is_array)), None), lm)
    batch = L.batch_arrays(make_rows(1), config.train, VOCAB, "x")
    trained, _, metrics = L.mesh_train_step(config, lm)(state.model, state.opt_state, None, batch)
    trained = mesh_lib.to_host(trained)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    before, after = M.numpy_params(model), M.numpy_params(trained)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))

    # export back and reload in transformers: the trained model's logits
    out = tmp_path / "export"
    M.export_hf(trained, str(out), load_tokenizer(spec.tokenizer), family=family)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(reloaded).__name__ == HF_CLASSES[family][1]
    ours = np.asarray(M.forward_logits(trained, TOKENS))
    np.testing.assert_allclose(ours, hf_logits(reloaded, TOKENS), atol=ATOL)
    assert np.abs(ours - hf_logits(hf, TOKENS)).max() > 10 * ATOL  # the export holds the trained weights

    # the dense sampler: the family's logprobs as teacher-forced (Gemma is refused by name)
    from pipeline.environments.generation import GenerationRequest
    from policy.inference import make_backend
    from policy.inference.dense_params import UnsupportedModelError

    dense = DenseInferenceConfig(max_seqs=2)
    if family == "gemma":
        with pytest.raises(UnsupportedModelError, match="Gemma"):
            make_backend(dense, trained, load_tokenizer(spec.tokenizer), SEQ, fast_compile=True)
        return
    backend = make_backend(dense, trained, load_tokenizer(spec.tokenizer), SEQ, fast_compile=True)
    prompt = [1, 40, 41, 42]
    (group,) = backend.generate(GenerationRequest([prompt], n=1, temperature=1.0, max_tokens=6, stop_tokens=[], seed=3))
    tf = np.asarray(M.teacher_forced_logprobs(trained, prompt + group[0].tokens))[len(prompt) :]
    np.testing.assert_allclose(np.asarray(group[0].logprobs), tf, atol=1e-4)


def test_hf_checkpoint_from_gs(tmp_path: Path, gcs_endpoint: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    emu = gcs_endpoint
    tiny_hf_model("qwen2", tmp_path / "hf")
    fs = fsspec.filesystem("gs", **emu.storage_options)  # type: ignore[attr-defined]
    url = f"gs://{emu.bucket}/models/{tmp_path.name}/qwen2"  # type: ignore[attr-defined]
    for f in (tmp_path / "hf").iterdir():
        fs.put_file(str(f), f"{url}/{f.name}")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.endpoint)  # type: ignore[attr-defined]
    monkeypatch.setenv(families.HF_CACHE_ENV, str(tmp_path / "cache"))

    local = M.build_model(ModelSpec(family="qwen2", hf_checkpoint=str(tmp_path / "hf"), max_seq_len=SEQ), VOCAB)
    remote = M.build_model(ModelSpec(family="qwen2", hf_checkpoint=url, max_seq_len=SEQ), VOCAB)
    for a, b in zip(M.numpy_params(local), M.numpy_params(remote), strict=True):
        assert np.array_equal(a, b)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # copied once, into one complete folder

    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        families.local_hf_folder(f"gs://{emu.bucket}/models/{tmp_path.name}/nothing-here")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"model.family='llama'.*'qwen2' checkpoint"):
        M.build_model(ModelSpec(family="llama", hf_checkpoint=url, max_seq_len=SEQ), VOCAB)
