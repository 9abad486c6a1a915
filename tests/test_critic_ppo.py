"""Critic PPO (`loss.type: ppo_critic`): GAE and the clipped value loss against float64 numpy references written
here independently (a plain per-episode loop, not the scan), the objective's gradients, the value head's one-pass
forward, and the value head's life in the learner: checkpoint -> resume bitwise, `steps.replay` bitwise, never in
published policies or the HF export. The learning test (cats) is in tests/test_loss_learning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from test_learner import BATCH, SEQ_LEN, VOCAB, make_rows, params, tiny_config, write_batch

from pipeline.config import (
    ConfigError,
    CriticPPOLossConfig,
    LearnerStepConfig,
    LoraSpec,
    ModelSpec,
    StoreConfig,
    TrainParams,
    validate_learner,
)
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics

jax = pytest.importorskip("jax")
jnp = jax.numpy

import policy.losses.terms as T  # noqa: E402
from policy import learner  # noqa: E402
from policy import model as M  # noqa: E402
from policy import policy_format as pf  # noqa: E402
from policy import value_head as VH  # noqa: E402
from policy.losses import Batch, CriticPPOLoss, loss_module_from_config  # noqa: E402
from steps import export as export_step  # noqa: E402
from steps import learn  # noqa: E402

STEPS = 3


# ---------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------


def gae_reference(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, seg: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """GAE per episode (segment) over its loss tokens, in float64: the textbook backward recursion on the list of
    steps; a reward on a non-loss token goes to the nearest loss token before it (dropped when there is none)."""
    adv = np.zeros(rewards.shape, np.float64)
    for b in range(rewards.shape[0]):
        for s in sorted(set(seg[b].tolist()) - {-1}):
            positions = [t for t in range(rewards.shape[1]) if seg[b, t] == s]
            steps = [t for t in positions if mask[b, t] > 0]
            step_reward = {t: 0.0 for t in steps}
            for t in positions:
                before = [u for u in steps if u <= t]
                if before:
                    step_reward[before[-1]] += float(rewards[b, t])
            next_v = next_a = 0.0
            for t in reversed(steps):
                delta = step_reward[t] + gamma * next_v - float(values[b, t])
                a = delta + gamma * lam * next_a
                adv[b, t] = a
                next_v, next_a = float(values[b, t]), a
    returns = np.where(mask > 0, adv + values, 0.0)
    return adv, returns


def value_loss_reference(v: np.ndarray, v_old: np.ndarray, r: np.ndarray, clip: float) -> np.ndarray:
    v_clip = v_old + np.clip(v - v_old, -clip, clip)
    return 0.5 * np.maximum((v - r) ** 2, (v_clip - r) ** 2)


def test_gae_hand_computed_single_episode() -> None:
    """Three policy tokens, rewards 0, 0, 1, V = 0.5, 0.2, 0.1, γ = 0.9, λ = 0.8, by hand:
    δ2 = 1 − 0.1 = 0.9;  δ1 = 0 + 0.9·0.1 − 0.2 = −0.11;  δ0 = 0 + 0.9·0.2 − 0.5 = −0.32;
    A2 = 0.9;  A1 = −0.11 + 0.72·0.9 = 0.538;  A0 = −0.32 + 0.72·0.538 = 0.06736."""
    r = jnp.array([[0.0, 0.0, 0.0, 1.0]])
    v = jnp.array([[0.0, 0.5, 0.2, 0.1]])
    m = jnp.array([[0.0, 1.0, 1.0, 1.0]])
    seg = jnp.array([[0, 0, 0, 0]], jnp.int32)
    adv, ret = T.gae_advantages(r, v, m, seg, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(adv)[0], [0.0, 0.06736, 0.538, 0.9], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(ret)[0], [0.0, 0.56736, 0.738, 1.0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.7), (0.99, 0.0)])
def test_gae_packed_rows_with_tool_tokens_match_numpy(gamma: float, lam: float) -> None:
    """Several episodes packed per row, tool/environment tokens (mask 0) inside responses carrying rewards of
    their own (process rewards), prompts, padding: the scan equals the per-episode float64 loop."""
    rng = np.random.default_rng(7)
    B, S = 3, 24
    seg = np.full((B, S), -1, np.int32)
    mask = np.zeros((B, S), np.float32)
    layout_rows = [  # (segment lengths, prompt length of each)
        ([9, 8, 5], [3, 2, 2]),
        ([24], [4]),
        ([6, 10], [1, 3]),
    ]
    for b, (lens, prompts) in enumerate(layout_rows):
        start = 0
        for s, (n, p) in enumerate(zip(lens, prompts, strict=True)):
            seg[b, start : start + n] = s
            mask[b, start + p : start + n] = 1.0
            start += n
    mask[0, 5] = mask[0, 6] = 0.0  # a tool call's output inside episode 0 of row 0
    mask[1, 10:14] = 0.0  # an environment turn in row 1
    mask[1, 23] = 0.0  # the episode ends on an environment token (its reward goes to the last action)
    rewards = np.where(seg >= 0, rng.normal(size=(B, S)), 0.0).astype(np.float32)
    rewards[mask == 0] *= rng.integers(0, 2, size=(B, S))[mask == 0]  # some tool tokens rewarded, some not
    values = np.where(seg >= 0, rng.normal(size=(B, S)), 0.0).astype(np.float32)
    adv, ret = T.gae_advantages(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), jnp.asarray(seg), gamma, lam
    )
    ref_adv, ref_ret = gae_reference(rewards.astype(np.float64), values.astype(np.float64), mask, seg, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[mask == 0] == 0.0)


def test_clipped_value_loss_matches_numpy_and_its_gradient_is_the_active_branch() -> None:
    v = np.array([0.0, 0.5, -0.4, 1.0, 0.25, 2.0], np.float64)
    v_old = np.array([0.0, 0.1, 0.0, 1.0, 0.25, 1.0], np.float64)
    r = np.array([1.0, 2.0, 0.3, 1.0, 0.0, 3.0], np.float64)
    clip = 0.2
    got, clipped = T.clipped_value_loss(jnp.asarray(v, jnp.float32), jnp.asarray(v_old, jnp.float32),
                                        jnp.asarray(r, jnp.float32), clip)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), value_loss_reference(v, v_old, r, clip), rtol=1e-6)
    # by hand, token 1: V − V_old = 0.4 > ε_v, V_clip = 0.3 lies farther from R = 2 than V = 0.5 does:
    # ½·max(1.5², 1.7²) = ½·2.89 = 1.445, the clipped branch (no gradient)
    assert float(got[1]) == pytest.approx(1.445) and bool(clipped[1])
    # the gradient is (V − R) where the unclipped error is the larger, 0 where the clipped one is
    grad = jax.grad(lambda x: T.clipped_value_loss(x, jnp.asarray(v_old, jnp.float32), jnp.asarray(r, jnp.float32),
                                                   clip)[0].sum())(jnp.asarray(v, jnp.float32))  # fmt: skip
    expect = np.where(np.asarray(clipped), 0.0, v - r)
    np.testing.assert_allclose(np.asarray(grad), expect, rtol=1e-6, atol=1e-7)
    plain, never = T.clipped_value_loss(jnp.asarray(v), jnp.asarray(v_old), jnp.asarray(r), None)
    np.testing.assert_allclose(np.asarray(plain), 0.5 * (v - r) ** 2, rtol=1e-6)
    assert not np.any(np.asarray(never))


def test_whiten_and_explained_variance_match_numpy() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(2.0, 3.0, size=(2, 7))
    m = (rng.random((2, 7)) > 0.3).astype(np.float64)
    sel = x[m > 0]
    expect = np.where(m > 0, (x - sel.mean()) / np.sqrt(sel.var() + 1e-8), 0.0)
    np.testing.assert_allclose(np.asarray(T.whiten(jnp.asarray(x, jnp.float32), jnp.asarray(m))), expect, atol=1e-5)
    v = x + rng.normal(0, 1.0, size=x.shape)
    ev = 1.0 - np.var(sel - v[m > 0]) / np.var(sel)
    got = T.explained_variance(jnp.asarray(v, jnp.float32), jnp.asarray(x, jnp.float32), jnp.asarray(m))
    assert float(got) == pytest.approx(ev, rel=1e-4)


# ---------------------------------------------------------------------------------------------
# the objective and the one-pass forward
# ---------------------------------------------------------------------------------------------


def critic_batch() -> Batch:
    rows = make_rows(1)
    for i, row in enumerate(rows):  # the reward on the last response token of each segment, a process reward
        tr = [0.0] * SEQ_LEN
        for s in range(2):
            tr[8 * s + 7] = float((i + s) % 2)
            tr[8 * s + 5] = 0.25
        row.token_rewards = tr
    return learner.batch_arrays(rows, TrainParams(batch_size=BATCH, seq_len=SEQ_LEN), VOCAB, "x")


def test_objective_is_ppo_on_gae_plus_the_value_loss() -> None:
    cfg = CriticPPOLossConfig(gamma=0.95, lam=0.9, vf_coef=0.5, whiten_advantages=False)
    module = loss_module_from_config(cfg)
    assert isinstance(module, CriticPPOLoss)
    batch = critic_batch()
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=batch.tokens.shape), jnp.float32)
    logp = batch.generator_logprobs + 0.05 * jnp.asarray(rng.normal(size=batch.tokens.shape), jnp.float32)
    loss, metrics = module.objective(logp, batch, None, None, None, values)
    m = np.asarray(batch.loss_mask, np.float64)
    ref_adv, ref_ret = gae_reference(np.asarray(batch.token_rewards, np.float64), np.asarray(values, np.float64), m,
                                     np.asarray(batch.segment_ids), 0.95, 0.9)  # fmt: skip
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.generator_logprobs, np.float64))
    surrogate = np.minimum(ratio * ref_adv, np.clip(ratio, 0.8, 1.2) * ref_adv)
    pg = -(surrogate * m).sum() / m.sum()
    # V_old = V (one update per slot): the value clip cannot act, the value loss is ½(V − R)²
    vl = (0.5 * (np.asarray(values, np.float64) - ref_ret) ** 2 * m).sum() / m.sum()
    assert float(metrics["pg_loss"]) == pytest.approx(pg, rel=1e-4, abs=1e-6)
    assert float(metrics["value_loss"]) == pytest.approx(vl, rel=1e-4)
    assert float(loss) == pytest.approx(pg + 0.5 * vl, rel=1e-4)
    assert float(metrics["gae_advantage_mean"]) == pytest.approx((ref_adv * m).sum() / m.sum(), rel=1e-4, abs=1e-6)
    assert float(metrics["value_clip_fraction"]) == 0.0
    # the policy term sees the values only through stop-gradient advantages: ∂L/∂V is vf_coef·(V − R)/N
    grad = jax.grad(lambda v: module.objective(logp, batch, None, None, None, v)[0])(values)
    np.testing.assert_allclose(np.asarray(grad), 0.5 * (np.asarray(values) - ref_ret) * m / m.sum(), atol=1e-6)


def test_value_head_shares_the_forward_and_is_aligned_like_logprobs() -> None:
    spec = ModelSpec(max_seq_len=SEQ_LEN)
    policy_model = M.build_model(spec, VOCAB)
    head = VH.ValueHead(jnp.asarray(np.random.default_rng(1).normal(size=VH.embed_size(policy_model)), jnp.float32),
                        jnp.asarray(0.5, jnp.float32))  # fmt: skip
    model = VH.attach(policy_model, head)
    batch = critic_batch()
    fn = learner.make_logprob_fn("float32")
    logp, ent, values = jax.jit(fn.values_fn)(model, batch)
    logp_plain, ent_plain = jax.jit(fn)(policy_model, batch)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_plain), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(ent_plain), atol=1e-6)
    # values[t] = V(hidden state at t − 1); 0 where a segment starts (position 0) and in padding
    seg = np.asarray(batch.segment_ids)
    starts = np.concatenate([np.ones((BATCH, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    assert np.all(np.asarray(values)[starts] == 0.0) and np.all(np.asarray(values)[~starts] != 0.0)
    assert VH.policy_of(model) is policy_model and VH.policy_of(policy_model) is policy_model
    assert np.all(np.asarray(VH.init_value_head(8).weight) == 0.0)


def test_bad_critic_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"loss\.lam"):
        CriticPPOLossConfig(lam=1.5)
    with pytest.raises(ConfigError, match=r"loss\.mis_level"):
        CriticPPOLossConfig(mis_level="token")
    critic = CriticPPOLossConfig()
    validate_learner(LearnerStepConfig(train=TrainParams(ppo_epochs=2, minibatches_per_slot=2), loss=critic))
    with pytest.raises(ConfigError, match=r"model\.lora"):
        validate_learner(LearnerStepConfig(model=ModelSpec(lora=LoraSpec()), loss=critic))


# ---------------------------------------------------------------------------------------------
# several updates per slot: V_old, R and Â fixed at the slot's first update
# ---------------------------------------------------------------------------------------------


def whiten_reference(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    mu = (x * m).sum() / m.sum()
    var = ((x - mu) ** 2 * m).sum() / m.sum()
    return np.where(m > 0, (x - mu) / np.sqrt(var + 1e-8), 0.0)


def critic_slot_step(epochs: int, minibatches: int, cfg_loss: CriticPPOLossConfig) -> tuple[object, object, dict]:
    """One learner slot (`policy.learner.mesh_train_step`) from a fixed tiny policy with a random value head:
    (initial model, model after the slot, the slot's metrics)."""
    import equinox as eqx

    from policy import mesh as mesh_lib

    train = TrainParams(num_train_steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, replay_buffer_capacity=BATCH,
                        ppo_epochs=epochs, minibatches_per_slot=minibatches)  # fmt: skip
    cfg = tiny_config("unused", loss=cfg_loss, train=train)
    lm = mesh_lib.build_mesh(cfg.mesh)
    rng = np.random.default_rng(3)
    head = VH.ValueHead(jnp.asarray(0.3 * rng.normal(size=64), jnp.float32), jnp.asarray(0.2, jnp.float32))
    model0 = VH.attach(M.build_model(cfg.model, VOCAB, jax.random.PRNGKey(0)), head)
    optimizer = learner.build_optimizer(cfg.optimizer, train.num_train_steps, learner.updates_per_slot(train))
    state = learner.shard_state(learner.LearnerState(0, model0, optimizer.init(eqx.filter(model0, eqx.is_array)),
                                                     None), lm)  # fmt: skip
    model, _, metrics = learner.mesh_train_step(cfg, lm)(state.model, state.opt_state, None, critic_batch())
    return model0, jax.device_get(model), {k: float(v) for k, v in metrics.items()}


def test_several_updates_per_slot_clip_the_value_to_the_pre_update_critic() -> None:
    """With 2 epochs (or 2 minibatches) the second update's value loss is clipped around V_old, the values before
    the slot's first update (value_clip_fraction > 0; one update per slot gives 0), and that update's loss equals
    a float64 numpy reference given V_old, with GAE targets and the slot-whitened Â from V_old."""
    loss_cfg = CriticPPOLossConfig(gamma=0.95, lam=0.9, vf_coef=0.5, value_clip=0.02, whiten_advantages=True)
    model0, model1, m1 = critic_slot_step(1, 1, loss_cfg)
    _, _, m2 = critic_slot_step(2, 1, loss_cfg)
    _, _, mb = critic_slot_step(1, 2, loss_cfg)
    assert m1["value_clip_fraction"] == 0.0 and m1["value_loss"] > 0
    assert m2["optimizer_updates"] == 2.0 and m2["value_clip_fraction"] > 0.05, m2
    assert mb["optimizer_updates"] == 2.0 and mb["value_clip_fraction"] > 0.0, mb
    assert m2["value_mean"] == pytest.approx(m1["value_mean"], rel=1e-5)  # V_old: the same in both updates

    # the second update of the 2-epoch slot: its metrics are the slot's minus the first update's (= the 1-update
    # slot's), its loss the numpy objective of the once-updated model against the slot's fixed targets
    batch = critic_batch()
    fn = learner.make_logprob_fn("float32")
    v_old = np.asarray(jax.jit(fn.values_fn)(model0, batch)[2], np.float64)
    logp1, _, v1 = (np.asarray(x, np.float64) for x in jax.jit(fn.values_fn)(model1, batch))
    m = np.asarray(batch.loss_mask, np.float64)
    adv, ret = gae_reference(np.asarray(batch.token_rewards, np.float64), v_old, m, np.asarray(batch.segment_ids),
                             0.95, 0.9)  # fmt: skip
    adv_w = whiten_reference(adv, m)
    ratio = np.exp(logp1 - np.asarray(batch.generator_logprobs, np.float64))
    pg = -(np.minimum(ratio * adv_w, np.clip(ratio, 0.8, 1.2) * adv_w) * m).sum() / m.sum()
    vl = (value_loss_reference(v1, v_old, ret, 0.02) * m).sum() / m.sum()
    v_clip = v_old + np.clip(v1 - v_old, -0.02, 0.02)
    clip_fraction = (((v_clip - ret) ** 2 > (v1 - ret) ** 2) * m).sum() / m.sum()
    second = {k: 2 * m2[k] - m1[k] for k in ("loss", "pg_loss", "value_loss", "value_clip_fraction")}
    assert second["value_loss"] == pytest.approx(vl, rel=1e-3, abs=1e-5)
    assert second["pg_loss"] == pytest.approx(pg, rel=1e-3, abs=1e-5)
    assert second["loss"] == pytest.approx(pg + 0.5 * vl, rel=1e-3, abs=1e-5)
    assert second["value_clip_fraction"] == pytest.approx(clip_fraction, abs=1.5 / m.sum())
    assert clip_fraction > 0.1  # the reference itself clips: V moved by more than ε_v on many tokens

    # the fixed targets: the module's slot_targets against numpy, V_old the pre-update values
    module = loss_module_from_config(loss_cfg)
    targets = module.slot_targets(batch, jnp.asarray(v_old, jnp.float32))  # type: ignore[attr-defined]
    np.testing.assert_allclose(np.asarray(targets["returns"]) * m, ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(targets["advantages"]) * m, adv_w, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the learner: checkpoints, resume, replay, publish, export
# ---------------------------------------------------------------------------------------------


def critic_rows(slot: int) -> list:
    rows = make_rows(slot)
    rng = np.random.default_rng(100 + slot)
    for row in rows:
        tr = [0.0] * SEQ_LEN
        for s in range(2):
            tr[8 * s + 7] = float(rng.integers(0, 2))  # the episode reward on its last response token
            tr[8 * s + 5] = float(rng.uniform(-0.2, 0.2))  # a process reward
        row.token_rewards = tr
    return rows


def head_arrays(model: object) -> list[np.ndarray]:
    head = VH.value_head_of(model)
    assert head is not None
    return [np.asarray(head.weight), np.asarray(head.bias)]


@pytest.mark.slow  # three short learner runs (run, resume, replay) and an export
def test_value_head_checkpoint_resume_replay_bitwise_and_never_published(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    store = RunStore(root)
    cfg = tiny_config(root, steps=STEPS, loss=CriticPPOLossConfig(kl_coef=0.05))
    for t in range(1, STEPS + 1):
        write_batch(store, t, critic_rows(t))
    learn.main(cfg)
    recs = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for key in ("value_loss", "explained_variance", "value_mean", "gae_advantage_mean", "return_mean"):
        assert key in recs[0], recs[0]
    assert recs[0]["value_mean"] == 0.0 and recs[0]["value_loss"] > 0  # the zero head at step 1, real returns
    assert recs[-1]["value_mean"] != 0.0  # the head learned

    optimizer = learner.build_optimizer(cfg.optimizer, cfg.train.num_train_steps)
    ck3 = pf.read_checkpoint(store, 3, cfg.model, VOCAB, optimizer, value_head=True)
    assert isinstance(ck3.model, VH.PolicyWithValue) and np.any(head_arrays(ck3.model)[0] != 0.0)
    with pytest.raises(pf.CheckpointError, match="holds a value head"):  # read as a plain checkpoint
        pf.read_checkpoint(store, 3, cfg.model, VOCAB, optimizer)
    p3 = params(pf.read_policy(store, 3, cfg.model, VOCAB))
    assert all(np.array_equal(a, b) for a, b in zip(p3, params(VH.policy_of(ck3.model)), strict=True))

    # resume: checkpoint 2 (and policy 0) in a fresh root, slot 3 again: policy 3 and the value head bit for bit
    root2 = str(tmp_path / "again")
    store2 = RunStore(root2)
    for t in range(1, STEPS + 1):
        write_batch(store2, t, critic_rows(t))
    for folder in (layout.checkpoint_dir(2), layout.policy_dir(0)):
        for rel in store.list(folder):
            store2.put_unique(rel, store.get(rel))
    learn.main(cfg.__class__(**{**cfg.__dict__, "store": StoreConfig(run_root=root2)}))
    again = pf.read_checkpoint(store2, 3, cfg.model, VOCAB, optimizer, value_head=True)
    assert all(np.array_equal(a, b) for a, b in zip(p3, params(pf.read_policy(store2, 3, cfg.model, VOCAB)),
                                                    strict=True))  # fmt: skip
    assert all(np.array_equal(a, b) for a, b in zip(head_arrays(ck3.model), head_arrays(again.model), strict=True))

    # replay (`make replay`'s function) from checkpoint 2: the same policy and value head
    replayed = learner.replay_slots(store, cfg, 2, 3)
    host = jax.device_get(replayed.model)
    assert all(np.array_equal(a, b) for a, b in zip(p3, params(VH.policy_of(host)), strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(head_arrays(ck3.model), head_arrays(host), strict=True))

    # published policies and the HF export hold the policy only
    published = {k for rel in store.list(layout.policy_dir(3)) if rel.endswith(".safetensors")
                 for k in st_load(store.get(rel))}  # fmt: skip
    assert published and not [n for n in published if "value" in n], sorted(published)
    out = tmp_path / "hf"
    export_step.main(export_step.ExportConfig(store=StoreConfig(run_root=root), model=cfg.model, step=3, out=str(out)))
    names = {k for f in out.glob("*.safetensors") for k in st_load(f.read_bytes())}
    assert names and not [n for n in names if "value" in n or "v_head" in n], sorted(names)


@pytest.mark.slow  # a three-slot learner run and a replay
def test_several_updates_per_slot_replay_bitwise(tmp_path: Path) -> None:
    """epochs 2 × minibatches 2 × microbatches of 1 row, TIS on: the value clip acts, and `steps.replay` from
    checkpoint 2 gives policy 3 and the value head bit for bit (V_old and the targets recomputed per slot)."""
    root = str(tmp_path / "run")
    store = RunStore(root)
    train = TrainParams(num_train_steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, replay_buffer_capacity=BATCH,
                        ppo_epochs=2, minibatches_per_slot=2, microbatch_size=1)  # fmt: skip
    cfg = tiny_config(root, steps=STEPS, train=train, loss=CriticPPOLossConfig(kl_coef=0.05, tis_cap=2.0))
    for t in range(1, STEPS + 1):
        write_batch(store, t, critic_rows(t))
    learn.main(cfg)
    recs = [r for r in read_metrics(store, "learner") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["optimizer_updates"] == 4.0 for r in recs)
    assert all(r["value_clip_fraction"] > 0 for r in recs[1:]), recs  # step 1: the zero head moves from 0
    optimizer = learner.build_optimizer(cfg.optimizer, STEPS, learner.updates_per_slot(train))
    ck3 = pf.read_checkpoint(store, 3, cfg.model, VOCAB, optimizer, value_head=True)
    p3 = params(pf.read_policy(store, 3, cfg.model, VOCAB))
    host = jax.device_get(learner.replay_slots(store, cfg, 2, 3).model)
    assert all(np.array_equal(a, b) for a, b in zip(p3, params(VH.policy_of(host)), strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(head_arrays(ck3.model), head_arrays(host), strict=True))


def test_microbatches_give_the_slot_loss_gradient_and_metrics() -> None:
    """Accumulating 4 microbatches of 8 rows equals the 32-row slot (tolerances of tests/test_microbatch_exact.py):
    GAE runs within rows (whole episodes), the value loss shares the loss's denominator. Not exact, and so not
    compared: `explained_variance` (a ratio of variances, combined as a token-weighted mean) and, when on,
    advantage whitening (over each microbatch's tokens; off here)."""
    import equinox as eqx
    from mesh_run_steps import VOCAB as MVOCAB
    from mesh_run_steps import B, S, synthetic_rows

    from policy import sharding

    spec = ModelSpec(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=S)
    base = M.build_model(spec, MVOCAB, jax.random.PRNGKey(0))
    reference = M.build_model(spec, MVOCAB, jax.random.PRNGKey(1))
    rng = np.random.default_rng(5)
    head = VH.ValueHead(jnp.asarray(rng.normal(size=16), jnp.float32), jnp.asarray(0.1, jnp.float32))
    model = VH.attach(base, head)
    rows = synthetic_rows(1)
    rows["token_rewards"] = np.where(rows["segment_ids"] >= 0, rng.normal(size=(B, S)), 0.0).astype(np.float32)
    batch = Batch(**{k: jnp.asarray(v) for k, v in rows.items()})
    module = loss_module_from_config(CriticPPOLossConfig(kl_coef=0.1, whiten_advantages=False, gamma=0.99, lam=0.9))
    grad_fn = eqx.filter_value_and_grad(module.create_loss_fn(None, learner.make_logprob_fn("float32")), has_aux=True)
    grad_fn = eqx.filter_jit(grad_fn)  # one program per shape (slot, microbatch); the accumulation op by op
    results = []
    for n in (1, 4):
        loss, grads, metrics = sharding.accumulate(grad_fn, module, model, reference, batch, n)
        results.append((float(loss), M.numpy_params(grads), metrics))
    (l1, g1, m1), (l4, g4, m4) = results
    assert abs(l4 - l1) <= 1e-5 * abs(l1), (l1, l4)
    diff = np.sqrt(sum(float(np.sum((x.astype(np.float64) - y) ** 2)) for x, y in zip(g1, g4, strict=True)))
    assert diff <= 1e-5 * np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g1))
    assert float(m1["value_loss"]) > 0 and float(m1["kl"]) > 1e-3
    for key in sorted(set(m1) - {"explained_variance"}):
        a, b = float(m1[key]), float(m4[key])
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-6, f"metric {key}: slot {a} vs 4 microbatches {b}"
