"""LoRA (`model.lora`): the learner trains only adapters; published policies (merged or adapters) sample what the
learner computes; the HF export (merged, plus a PEFT folder) loads in transformers; bad configs are refused.

The learning test (slow): the `make demo` job (configs/demo_cats.yaml, seed 0, its 20 learner steps),
`model.lora: {r: 8, alpha: 16, publish: adapters}` on every block projection and `lm_head`, learning rate
0.02 instead of 0.005; it asserts what the demo asserts of the reward: the mean cats reward of rollouts from the
last 3 policies is >= 3x and >= 0.2 above that of the first 3. Measured on the shared 2-core VM (start -> end):
20 steps 0.092 -> 0.913; 12 steps 0.066 -> 0.644, 0.097 -> 0.517, 0.088 -> 0.342 (too close to the margin);
14 steps 0.120 -> 0.763, 0.079 -> 0.654, 0.081 -> 0.719 (without lm_head, 20 steps are too close to the
margin: 0.101 -> 0.484, 0.088 -> 0.507, 0.098 -> 0.238; r=32, alpha=64 without lm_head: 0.080 -> 0.982).
14 steps were used for a while (27-30 CPU-s instead of ~39) until CI ended one at 0.098 -> 0.215; seven more runs
on the VM: 0.784, 0.737, 0.349, 0.418, 0.577, 0.732, 0.739 (r=32, alpha=64 at 14 steps: 0.560 to 0.997). The
reward curve takes off between steps 5 and 12 depending on which policy each rollout happened to be sampled from,
so at 14 the last three policies sit on its steep part. At 20 steps, in pairs (a loaded VM): 0.908, 0.909, 1.000,
0.970, then alone 0.908, 0.846, 0.677: the slowest take-off seen still ends ~0.4 above the margin.

One learner run (module fixture, tiny model, 3 batch slots, `publish: adapters`, KL on so the reference model is
built) serves most checks; the merged publish mode is checked by publishing the same trained model again with
`publish: merged`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import draccus
import numpy as np
import pytest
from jobs import demo_job_rewards
from test_learner import SEQ_LEN, VOCAB, tiny_config, write_batches

from pipeline.config import (
    ConfigError,
    LoraSpec,
    MeshConfig,
    ModelSpec,
    RLJobConfig,
    RLOOLossConfig,
    StoreConfig,
    validate_learner,
)
from pipeline.run_contract import RunConfigMismatchError, check_run_config
from pipeline.store import layout
from pipeline.store.storage import RunStore

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from pipeline.config import DenseInferenceConfig, ServerInferenceConfig  # noqa: E402
from pipeline.environments.tokenizer import load_tokenizer  # noqa: E402
from policy import learner as L  # noqa: E402
from policy import lora  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from policy.inference import GenerationRequest, make_backend  # noqa: E402
from steps import export as export_step  # noqa: E402
from steps import learn  # noqa: E402
from steps import replay as replay_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LORA = LoraSpec(r=4, alpha=8.0, publish="adapters")
SPEC = ModelSpec(max_seq_len=SEQ_LEN * 4, lora=LORA)


@dataclasses.dataclass
class Trained:
    store: RunStore
    cfg: Any
    final: Any
    """The learner's model (loraized) of checkpoint STEPS."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = str(tmp_path_factory.mktemp("lora") / "run")
    store = RunStore(root)
    write_batches(store, range(1, STEPS + 1))
    cfg = tiny_config(root, steps=STEPS, model=SPEC, loss=RLOOLossConfig(kl_coef=0.05))
    learn.main(cfg)
    optimizer = L.build_optimizer(cfg.optimizer, STEPS)
    final = pf.read_checkpoint(store, STEPS, cfg.model, VOCAB, optimizer)
    return Trained(store, cfg, final)


def test_only_adapters_change_and_the_optimizer_holds_only_adapters(trained: Trained) -> None:
    store, cfg = trained.store, trained.cfg
    base = M.build_model(dataclasses.replace(SPEC, lora=None), VOCAB)
    p0 = pf.read_policy(store, 0, cfg.model, VOCAB)
    # policy 0 (also the KL reference) is exactly the base model: B starts at zero
    assert all(np.array_equal(a, b) for a, b in zip(M.numpy_params(base), M.numpy_params(p0), strict=True))
    model = trained.final.model
    assert lora.is_loraized(model)
    _, frozen = lora.split(model)
    base_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(frozen)]
    assert len(base_leaves) == len(M.numpy_params(base))
    for a, b in zip(base_leaves, M.numpy_params(base), strict=True):  # every non-adapter leaf, bitwise
        assert a.dtype == b.dtype and np.array_equal(a, b)
    initial = lora.loraize(base, LORA, SPEC.seed)
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(lora.adapter_arrays(initial))]
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(lora.adapter_arrays(model))]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))  # every adapter trained
    # the optimizer state is sized to the adapters: Adam's two moments of each adapter tensor, plus step counts
    n_adapter = lora.count_adapter_params(model)
    assert n_adapter < M.count_params(base) / 10
    opt_leaves = jax.tree_util.tree_leaves(trained.final.opt_state)
    moments = [x for x in opt_leaves if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter
    assert len(moments) == 2 * len(after)


def test_published_adapters_reference_the_base_and_replay_is_bitwise(trained: Trained) -> None:
    store, cfg = trained.store, trained.cfg
    marker = pf.policy_metadata(store, STEPS)
    assert set(marker.files) == {pf.ADAPTERS_BLOB}
    assert marker.extra["base_policy"] == 0 and marker.extra["lora"]["r"] == LORA.r
    assert pf.POLICY_WEIGHTS in pf.policy_metadata(store, 0).files  # the base, in full
    # replaying slot STEPS from checkpoint STEPS-1 gives the learner's model bit for bit
    replayed = L.replay_slots(store, cfg, STEPS - 1, STEPS)
    ours, theirs = M.numpy_params(replayed.model), M.numpy_params(trained.final.model)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    ours, theirs = M.numpy_params(replayed.opt_state), M.numpy_params(trained.final.opt_state)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _sampled_vs_teacher_forced(policy: Any, learner_model: Any) -> float:
    """Max |sampler logprob - learner teacher-forced logprob| over sampled completions of `policy`."""
    tok = load_tokenizer("builtin:tiny")
    backend = make_backend(DenseInferenceConfig(max_seqs=8), policy, tok, SPEC.max_seq_len, fast_compile=True)
    prompts = [[1, 40, 41, 42], [1, 7, 8]]
    try:
        out = backend.generate(GenerationRequest(prompts, n=2, temperature=1.0, max_tokens=10, stop_tokens=[], seed=5))
    finally:
        backend.shutdown()
    worst = 0.0
    for p, comps in zip(prompts, out, strict=True):
        for c in comps:
            seq = list(p) + list(c.tokens)
            lp = np.asarray(M.teacher_forced_logprobs(learner_model, jnp.asarray([seq], jnp.int32)))[0]
            worst = max(worst, float(np.abs(lp[len(p) :] - np.asarray(c.logprobs)).max()))
    return worst


@pytest.mark.parametrize("publish", ["adapters", "merged"])
def test_published_policy_samples_the_learners_logprobs(trained: Trained, tmp_path: Path, publish: str) -> None:
    spec = dataclasses.replace(SPEC, lora=dataclasses.replace(LORA, publish=publish))
    store = trained.store
    if publish == "merged":  # the same trained model published merged, in a second run root
        store = RunStore(str(tmp_path / "merged"))
        pf.write_policy(store, STEPS, trained.final.model, spec=spec)
        assert pf.POLICY_WEIGHTS in pf.policy_metadata(store, STEPS).files
    policy = pf.read_policy(store, STEPS, spec, VOCAB)
    assert not lora.is_loraized(policy)
    assert _sampled_vs_teacher_forced(policy, trained.final.model) <= 1e-4


def test_export_merged_loads_in_transformers_and_writes_a_peft_folder(trained: Trained, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    export_step.export(trained.store, SPEC, STEPS, str(out), peft=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok(["the cat"], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    ours = np.asarray(M.teacher_forced_logprobs(trained.final.model, jnp.asarray([ids], jnp.int32)))[0]
    # the folder a `server` backend is given for this adapter policy (`inference.export_hf`) holds the same weights
    server = ServerInferenceConfig(openai_base_url="http://127.0.0.1:9/v1", export_hf=True)
    pf.publish_hf_if_needed(
        trained.store, SimpleNamespace(inference=server, model=SPEC), STEPS, load_tokenizer("builtin:tiny")
    )
    served = Path(trained.store.root) / layout.policy_dir(STEPS) / "hf"
    for folder in (out, served):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
        generated = hf.generate(**enc, max_new_tokens=4, do_sample=False)
        assert generated.shape[1] == enc["input_ids"].shape[1] + 4
        with torch.no_grad():
            theirs = torch.log_softmax(hf(**enc).logits[0], -1).numpy()
        np.testing.assert_allclose(ours[1:], theirs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
    # the PEFT folder: PEFT's names and shapes, its config, a base it names
    from safetensors.numpy import load_file

    peft_dir = out / "peft"
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == LORA.r and config["lora_alpha"] == LORA.alpha
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    assert config["base_model_name_or_path"] == f"{peft_dir}/base"
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    n_layers = SPEC.num_layers
    assert len(tensors) == 2 * len(LORA.target_modules) * n_layers
    h, mlp = SPEC.hidden_dim, SPEC.intermediate_dim
    q = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert q.shape == (h, LORA.r)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (LORA.r, mlp)
    # base + B·A·alpha/r per layer is the merged export's weight (checked on one projection)
    merged = load_file(str(out / "model.safetensors"))
    base = load_file(str(peft_dir / "base" / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj"
    a = tensors[f"base_model.model.{name}.lora_A.weight"]
    expect = base[f"{name}.weight"] + (q @ a) * (LORA.alpha / LORA.r)
    np.testing.assert_allclose(merged[f"{name}.weight"], expect, atol=1e-6)
    try:
        import peft
    except ImportError:  # peft is not a dependency: then the folder's files, names and shapes are what is checked
        return
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(peft_dir / "base"))
    with_adapters = peft.PeftModel.from_pretrained(base_model, str(peft_dir))
    with torch.no_grad():
        merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
        np.testing.assert_allclose(with_adapters(**enc).logits.numpy(), merged_hf(**enc).logits.numpy(), atol=1e-4)


def test_export_peft_refuses_a_policy_without_adapters(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "plain"))
    spec = dataclasses.replace(SPEC, lora=None)
    pf.write_policy(store, 0, M.build_model(spec, VOCAB))
    with pytest.raises(ConfigError, match="peft"):
        export_step.export(store, spec, 0, str(tmp_path / "out"), peft=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"r": 0}, "model.lora.r"),
        ({"alpha": 0.0}, "model.lora.alpha"),
        ({"target_modules": ()}, "model.lora.target_modules"),
        ({"target_modules": ("q_proj", "qkv")}, "model.lora.target_modules"),
        ({"target_modules": ("q_proj", "q_proj")}, "model.lora.target_modules"),
        ({"publish": "both"}, "model.lora.publish"),
    ],
)
def test_bad_lora_config_is_refused(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        LoraSpec(**kwargs)
    assert e.value.field == field


def test_lora_with_tensor_parallel_mesh_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        validate_learner(tiny_config("/tmp/unused", model=SPEC, mesh=MeshConfig(fsdp=1, model=2)))
    assert e.value.field == "model.lora"


def test_run_json_drift_covers_model_lora(tmp_path: Path) -> None:
    cfg = draccus.parse(RLJobConfig, config_path=str(ROOT / "configs/test_cats.yaml"), args=[])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraSpec(r=8)))
    store = RunStore(str(tmp_path / "run"))
    check_run_config(store, cfg)
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraSpec(r=4)))
    with pytest.raises(RunConfigMismatchError) as e:
        check_run_config(store, changed)
    assert e.value.field == "model.lora.r"
    off = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=None))
    with pytest.raises(RunConfigMismatchError, match=r"model\.lora"):
        check_run_config(store, off)
    check_run_config(store, cfg)  # unchanged: accepted


# ---------------------------------------------------------------------------------------------
# learning: the cats demo job with adapters only
# ---------------------------------------------------------------------------------------------

DEMO_STEPS = 20
"""Learner steps of the job: the demo's 20 (configs/demo_cats.yaml). At 14 the last policies sit on the steep part of
the learning curve, where the asynchrony (which policy each rollout is sampled from) moves the take-off by several
steps: 2 of 8 runs ended at 0.215 (a CI failure) and 0.349 against a margin of ~0.3 (see the module docstring)."""
DEMO_LR = 0.02
"""4x the demo's full fine-tuning rate: adapters (r=8, alpha=16) learn too slowly at 0.005."""
DEMO_TARGETS = (*LoraSpec().target_modules, "lm_head")
"""Every block projection and the output projection."""


@pytest.mark.slow
def test_lora_learns_cats(tmp_path: Path) -> None:
    """The demo job (evaluator off: only its rollouts are read) with adapters only learns cats as `make demo`
    measures it, sampling from published adapters, and its last checkpoint interval replays bitwise."""
    run = demo_job_rewards(
        tmp_path,
        f"--train.num_train_steps={DEMO_STEPS}",
        *("--model.lora.r=8", "--model.lora.alpha=16", "--model.lora.publish=adapters"),
        f"--model.lora.target_modules=[{','.join(DEMO_TARGETS)}]",
        f"--optimizer.learning_rate={DEMO_LR}",
    )
    start, end = run.start, run.end
    print(f"lora: start {start:.3f} end {end:.3f}")
    assert max(run.last_policies) >= DEMO_STEPS - 2
    store = RunStore(str(run.root))
    assert set(pf.policy_metadata(store, DEMO_STEPS).files) == {pf.ADAPTERS_BLOB}  # sampled from adapters
    # `make replay` of the last checkpoint interval gives the run's adapter policy bit for bit
    config = replay_step.ReplayConfig(store=StoreConfig(run_root=str(run.root)), from_step=10)
    assert replay_step.main(config) == 0
    assert end >= 3.0 * start and end - start >= 0.2, (start, end)
