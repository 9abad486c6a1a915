"""Model families beyond Llama: for Qwen2 (also Qwen2.5), Mistral and Gemma a tiny random Hugging Face model built
locally with transformers loads through `model.hf_checkpoint`, gives transformers' logits (within 1e-4, f32
CPU), trains one learner step, exports back to a Hugging Face folder that transformers loads with the trained
model's logits. `model.hf_checkpoint: gs://…` (the GCS emulator) is streamed onto the learner's mesh: a tiny Llama
(bfloat16, in several safetensors files) and a tiny Qwen2 (with a vocabulary resize) become the initial learner
state on 4 simulated devices under FSDP, bit for bit the local-folder load (rows added by the resize: within 1e-6),
every parameter with an "embed" axis split 4 ways over the mesh, with no weights file written to local disk; a
checkpoint of another family is refused naming `model.family`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jobs import simulated_devices
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
from pipeline.environments.tokenizer import load_tokenizer  # noqa: E402
from policy import families  # noqa: E402
from policy import learner as L  # noqa: E402
from policy import mesh as mesh_lib  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402

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
TINY_CLASSES = {**HF_CLASSES, "llama": ("LlamaConfig", "LlamaForCausalLM", {})}


def tiny_hf_model(family: str, out: Path, dtype: str = "float32", max_shard_size: str | None = None) -> object:
    """A seeded random transformers model of `family`, saved to `out` in `dtype` (config.json + model.safetensors,
    or safetensors files of at most `max_shard_size` and their index)."""
    config_cls, model_cls, extra = TINY_CLASSES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE, **extra)).eval()
    if family == "qwen2":  # transformers initialises biases to 0: make them matter
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    sizes = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.to(getattr(torch, dtype)).save_pretrained(out, **sizes)
    return hf


def hf_logits(hf: object, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.float().numpy()  # type: ignore[operator]


TOKENS = np.random.default_rng(0).integers(4, VOCAB, (2, SEQ))
forward_logits = M.eqx.filter_jit(M.forward_logits)
"""`M.forward_logits` as one program per model structure (a family's initial and trained model share it), not op
by op."""


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_family_round_trip(family: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(family, tmp_path / "hf")
    spec = ModelSpec(family=family, hf_checkpoint=str(tmp_path / "hf"), max_seq_len=SEQ)
    model = M.build_model(spec, VOCAB)
    np.testing.assert_allclose(np.asarray(forward_logits(model, TOKENS)), hf_logits(hf, TOKENS), atol=ATOL)

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
    pf.export_hf(trained, str(out), load_tokenizer(spec.tokenizer), family=family)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert type(reloaded).__name__ == HF_CLASSES[family][1]
    ours = np.asarray(forward_logits(trained, TOKENS))
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


STREAM_SCRIPT = Path(__file__).with_name("hf_stream_load.py")
STREAMED = {"llama": ("bfloat16", VOCAB, "40KB"), "qwen2": ("float32", VOCAB + 64, None)}
"""Family -> (the dtype its tiny checkpoint is saved in, the model vocabulary it is loaded with (Qwen2's is resized),
the size of its safetensors files (Llama's is split into several files with an index))."""


def test_hf_checkpoint_streamed_from_gs(tmp_path: Path, gcs_endpoint: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    emu = gcs_endpoint
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.endpoint)  # type: ignore[attr-defined]
    monkeypatch.setenv(families.HF_CACHE_ENV, str(tmp_path / "cache-here"))
    fs = fsspec.filesystem("gs", **emu.storage_options)  # type: ignore[attr-defined]
    base = f"gs://{emu.bucket}/models/{tmp_path.name}"  # type: ignore[attr-defined]
    urls, weight_sizes = {}, []
    for family, (dtype, _, shard_size) in STREAMED.items():
        tiny_hf_model(family, tmp_path / family, dtype, shard_size)
        urls[family] = f"{base}/{family}"
        for f in (tmp_path / family).iterdir():
            fs.put_file(str(f), f"{urls[family]}/{f.name}")
            if f.suffix == ".safetensors":
                weight_sizes.append(f.stat().st_size)
    other_sizes = [f.stat().st_size for fam in STREAMED for f in (tmp_path / fam).iterdir() if f.suffix == ".json"]
    limit = min(weight_sizes) - 1  # no weights file fits under it; every config file does
    assert max(other_sizes) < limit
    out, cache, tmp = (tmp_path / d for d in ("out", "cache", "tmp"))
    for d in (out, cache, tmp):
        d.mkdir()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",  # no .pyc of any size is written under the file-size limit
        "USE_TORCH": "0",  # as in a step process: transformers skips importing torch (levanter reads safetensors)
        "PYTHONPATH": str(STREAM_SCRIPT.parent.parent),
        "XLA_FLAGS": simulated_devices(4),
        "STORAGE_EMULATOR_HOST": emu.endpoint,  # type: ignore[attr-defined]
        families.HF_CACHE_ENV: str(cache),
        "TMPDIR": str(tmp),
        "HF_STREAM_MAX_FILE_BYTES": str(limit),
    }
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    args = [f"{family}={STREAMED[family][1]}={url}" for family, url in urls.items()]
    # the 4-device process streams from gs:// while this one loads the same checkpoints from the local folders
    proc = subprocess.Popen(
        [sys.executable, str(STREAM_SCRIPT), str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        local = {
            family: M.numpy_params(
                M.build_model(ModelSpec(family=family, hf_checkpoint=str(tmp_path / family), max_seq_len=SEQ), vocab)
            )
            for family, (_, vocab, _) in STREAMED.items()
        }
    finally:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]

    for family in STREAMED:
        with np.load(out / f"{family}.npz") as f:
            streamed = [f[f"arr_{i}"] for i in range(len(f.files))]
        assert len(streamed) == len(local[family])
        vocab = STREAMED[family][1]
        for a, b in zip(local[family], streamed, strict=True):
            assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
            if a.shape[0] == vocab > VOCAB:  # rows added by the resize: drawn from the rows' mean and std, which
                # a sharded reduction sums in another order (last-bit differences)
                np.testing.assert_allclose(a[VOCAB:], b[VOCAB:], rtol=1e-6, atol=1e-8)
                a, b = a[:VOCAB], b[:VOCAB]
            assert np.array_equal(a, b)  # the checkpoint's weights: bit for bit
        placed = json.loads((out / f"{family}.json").read_text())
        assert len(placed) == len(streamed)
        for p in placed:
            assert p["devices"] == 4
            if "embed" in p["axes"]:  # FSDP: split 4 ways over the mesh's data axis, one quarter per device
                i = p["axes"].index("embed")
                assert (
                    not p["replicated"] and p["spec"][i] == "data" and p["shard_shape"][i] == SHAPE["hidden_size"] // 4
                )
            else:  # e.g. Qwen2's q/k/v biases: replicated over the mesh
                assert p["replicated"]
    written = [p for d in (cache, tmp) for p in d.rglob("*") if p.is_file()]
    assert not [p for p in written if p.name.endswith(families.WEIGHT_SUFFIXES)], written
    small = {fam: sorted(f.name for f in (tmp_path / fam).iterdir() if f.suffix != ".safetensors") for fam in STREAMED}
    assert len(small["llama"]) == 3  # config, generation config, the index of the weights files
    # one complete folder per URL, with the small files only
    assert sorted(sorted(f.name for f in d.iterdir()) for d in cache.iterdir()) == sorted(small.values())

    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        families.hf_metadata_folder(f"{base}/nothing-here")
    with pytest.raises(ConfigError, match=r"model.family='llama'.*'qwen2' checkpoint"):
        M.build_model(ModelSpec(family="llama", hf_checkpoint=urls["qwen2"], max_seq_len=SEQ), VOCAB)
