"""How a ViT is spread over devices: activation checkpointing, per-block compile, FSDP2 sharding.

The one module of vit/ that imports torch.distributed. `parallelize` applies the three steps in
this order, which is also the order for calling them by hand:

    model = create_model("vit_h14", device="meta")
    apply_activation_checkpointing(model)  # 1. each block recomputes its activations in backward
    apply_compile(model)                   # 2. each (checkpointed) block is compiled as one graph
    apply_fsdp(model, mesh)                # 3. each block, then the root, is sharded (HSDP on a
                                           #    2-D mesh from hsdp_mesh)
    model.to_empty(device="cuda")
    model.init_weights()

Compile comes after checkpointing so that it traces the recomputation region as part of the block's
graph, and FSDP comes last so that its all-gather / reduce-scatter hooks run eagerly around the
compiled block rather than inside it. AC and compile replace the block's ``forward`` on the
instance instead of wrapping the block in another module, so parameter names (state dicts,
optimizer groups, checkpoints) are the same whichever steps were applied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from vit.model import VisionTransformer


def apply_activation_checkpointing(model: VisionTransformer) -> VisionTransformer:
    """Store only each block's input in forward; recompute the rest of the block in backward.

    Per block (not selective per op): a ViT block's activations are dominated by the MLP's
    (T, 4D) hidden layer and the attention inputs, which is what full recomputation saves.
    """
    for block in model.blocks:
        block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        # Non-reentrant: the supported variant, which works with torch.compile and FSDP2.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_compile(
    model: VisionTransformer, *, backend: str = "inductor", fullgraph: bool = True
) -> VisionTransformer:
    """Compile each block separately: all blocks share one graph (one compilation, reused depth times).

    fullgraph: a block has no data-dependent control flow, so any graph break is a bug to surface.
    """
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph)
    return model


def apply_fsdp(
    model: VisionTransformer,
    mesh: DeviceMesh | None = None,
    *,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> VisionTransformer:
    """Shard the model with FSDP2 ``fully_shard``: each block is one all-gather unit, then the root.

    ``param_dtype=None`` keeps parameters in their own dtype (fp32 training on CPU). ``mesh=None``
    shards over the whole default process group; a 2-D mesh from `hsdp_mesh` shards within groups
    and replicates across them.
    """
    # Parameters are all-gathered in param_dtype for compute; gradients are reduced in fp32 so that
    # summing over many ranks does not lose precision. Sharded parameters and optimizer state stay fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp_policy,
            # Not for the last block: backward starts with it, so FSDP would all-gather it again at once.
            reshard_after_forward=reshard_after_forward and i < last,
        )
    # The root holds what is left: patch embedding, [CLS], position embeddings, final norm, head.
    # (FSDP keeps the root unsharded between forward and backward in any case.)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return model


def hsdp_mesh(device_type: str, world_size: int, shard_group_size: int) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ``(world_size,)`` when one shard group holds every rank, else
    2-D ``(replicate, shard) = (world_size // shard_group_size, shard_group_size)``, which makes
    ``fully_shard`` hybrid (HSDP).

    Shard groups are runs of consecutive ranks (ranks ``0..g-1`` are the first), so with one group per
    node each block's all-gather and reduce-scatter stays on the node's own links, and per step only
    one all-reduce of each rank's gradient shard, over the replicate dimension, crosses nodes.
    Memory: parameters, gradients and optimizer state are divided by the group size, not the world.
    """
    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(f"a shard group of {shard_group_size} does not divide {world_size} ranks")
    if shard_group_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type,
        (world_size // shard_group_size, shard_group_size),
        mesh_dim_names=("replicate", "shard"),
    )


def parallelize(
    model: VisionTransformer,
    mesh: DeviceMesh | None = None,
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> VisionTransformer:
    """Apply activation checkpointing, compile and FSDP2, in that order (each optional but FSDP)."""
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    return apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
