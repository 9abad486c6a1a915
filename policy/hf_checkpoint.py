"""Loading a Hugging Face checkpoint (`model.hf_checkpoint`) into a levanter model, streamed onto a device mesh.

A checkpoint is a local folder or any fsspec URL (gs://…). A remote one is never copied whole to local disk: its
config, tokenizer and generation-config files come from `policy.families.hf_metadata_folder`, and its weights are
read from the URL by levanter's HF converter (`load_hf_model` states how, and how much of the model one host holds).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.lm_model import LmHeadModel

from pipeline.config import ModelSpec
from policy.families import FAMILIES, hf_metadata_folder, is_remote

if TYPE_CHECKING:
    from policy.mesh import LearnerMesh

logger = logging.getLogger(__name__)


def hf_converter(spec: ModelSpec, ref: str, tokenizer: Any = None) -> Any:
    """levanter's HF converter for `spec.family` with `ref` (a local folder) as its reference checkpoint; the
    tokenizer is `spec.tokenizer` unless given."""
    import transformers
    from levanter.compat.hf_checkpoints import HFCheckpointConverter

    family = FAMILIES[spec.family]
    if tokenizer is None:
        from pipeline.environments.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer)
    return HFCheckpointConverter(
        family.config_class,
        reference_checkpoint=ref,
        HfConfigClass=getattr(transformers, family.hf_config),
        tokenizer=tokenizer,
    )


def host_mesh() -> Any:
    """A one-axis mesh over the local devices (levanter's HF converter requires a mesh in context)."""
    from jax.sharding import Mesh

    return jax.set_mesh(Mesh(np.array(jax.devices()), ("data",)))


def load_hf_model(spec: ModelSpec, config: Any, vocab_size: int, mesh: LearnerMesh | None = None) -> LmHeadModel:
    """`spec.hf_checkpoint` as a levanter model of `config` with float32 parameters and `vocab_size` classes.

    The parameters hold the checkpoint's values whatever the mesh (bfloat16 ones upcast exactly); a vocabulary that
    differs is resized (rows cut, or added from the existing rows' mean and standard deviation with
    `PRNGKey(spec.seed)`; those sums run in a mesh-dependent order, so added rows can differ in the last bit between
    meshes). The model lands on `mesh` laid out by its parameter mapping (FSDP over "embed", tensor parallel over
    heads and mlp) when given, else on a one-axis mesh over this process's devices.

    Weights are read by levanter's converter through fsspec, from the folder or straight from the URL: the
    `*.safetensors` files one after another (in the order of `model.safetensors.index.json` when there is one), each
    in byte ranges of at most `$LEVANTER_FSSPEC_CHUNK_BYTES` (default 2 GiB; a larger tensor is one range of its
    own), at most `$LEVANTER_FSSPEC_MAX_CONCURRENT_CHUNKS` (default 4) at a time. Every tensor goes from its range
    straight to this process's devices, cut into the mesh's slices (its last dimension divisible by the size of the
    mesh's "data" axis is split over that axis; a tensor with none is replicated), and the loaded tensors are then
    rearranged on the devices (layers stacked for the scanned transformer) into the parameter layout. So at its peak
    one host holds the bytes of at most one checkpoint file, and of at most 4 x 2 GiB of it by default (a typical
    4-5 GB shard file is held whole, read in 3 ranges), plus a float32 copy of one float16 tensor (bfloat16 tensors
    are placed as stored and upcast on the devices), besides its own devices' slices. Every learner process reads
    every range and keeps only its own devices' slices. `pytorch_model*.bin` checkpoints are not streamed: levanter
    downloads each such file to a local temporary file first.
    """
    ref = str(spec.hf_checkpoint)
    weights = ref.rstrip("/") if is_remote(ref) else hf_metadata_folder(ref)  # levanter streams a URL itself
    converter = hf_converter(spec, hf_metadata_folder(ref))
    load = dict(config=config, resize_vocab_to_match_tokenizer=False, dtype=jnp.float32)
    if mesh is None:
        with host_mesh():
            model = converter.load_pretrained(config.model_type, ref=weights, **load)
    else:
        # the concrete mesh in context decides where each streamed tensor lands (sliced over its "data" axis);
        # the mapping, how the loaded model is laid out
        with hax.partitioning.set_mesh(mesh.mesh), hax.axis_mapping(mesh.param_mapping):
            model = converter.load_pretrained(config.model_type, ref=weights, axis_mapping=mesh.param_mapping, **load)
    # levanter's `dtype` leaves bfloat16 tensors as stored (not a numpy floating type): upcast them (exact), where
    # they are
    model = jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) and x.dtype != jnp.float32 else x, model
    )
    if model.Vocab.size != vocab_size:
        logger.info("resizing HF model vocab %d -> %d", model.Vocab.size, vocab_size)
        if mesh is None:
            return model.resize_vocab(vocab_size, key=jax.random.PRNGKey(spec.seed))
        from policy.mesh import shard_params

        with mesh.active():
            model = model.resize_vocab(vocab_size, key=jax.random.PRNGKey(spec.seed))
        model = shard_params(model, mesh)
    return model
