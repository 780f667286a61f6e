"""How a ViT is spread over devices: activation checkpointing, per-block compile, FSDP2 sharding.

The one module of vit/ that imports torch.distributed. `parallelize` applies the three steps in
this order, which is also the order for calling them by hand:

    model = create_model("vit_h14", device="meta")
    apply_activation_checkpointing(model)  # 1. each block recomputes its activations in backward
    apply_compile(model)                   # 2. each (checkpointed) block is compiled as one graph
    apply_fsdp(model, mesh)                # 3. each block, then the root, is sharded (HSDP on a
                                           #    2-D mesh from hsdp_mesh; one unit on one device)
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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vit.model import VisionTransformer

AC_MODES = ("full", "alternate", "ops")

# With mode "ops": what backward keeps instead of recomputing. Matmuls and attention are where a
# block's FLOPs are; recomputing only the norms, GELU, residual adds and casts between them costs
# little compute but still frees their (B, T, 4D) elementwise outputs.
_SAVED_OPS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """Recompute block activations in backward instead of storing them.

    ``mode``: ``"full"`` stores only each block's input and recomputes the whole block (the least
    memory: a ViT block's activations are dominated by the MLP's (T, 4D) hidden layer and the
    attention inputs); ``"alternate"`` does that for every other block (blocks 0, 2, 4, ...),
    trading half the saving for half the recomputation; ``"ops"`` checkpoints every block but keeps
    the outputs of its matmuls and attention, so backward recomputes only cheap elementwise work.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    for i, block in enumerate(model.blocks):
        if mode == "alternate" and i % 2:
            continue
        block.forward = _checkpointed(block.forward, selective=mode == "ops")
    return model


def _checkpointed(forward: Callable, selective: bool = False) -> Callable:
    def run(*args, **kwargs):
        # Non-reentrant: the supported variant, which works with torch.compile and FSDP2.
        if selective:
            kwargs["context_fn"] = _save_matmuls
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _save_matmuls():
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


COMPILE_SCOPES = ("blocks", "model")


def apply_compile(
    model: nn.Module, *, backend: str | Callable = "inductor", fullgraph: bool = True, scope: str = "blocks"
) -> nn.Module:
    """``scope="blocks"``: compile each block separately; all blocks share one graph (one compilation,
    reused depth times, whatever the depth: the blocks are inputs of the graph, not constants of it).
    fullgraph: a block has no data-dependent control flow, so any graph break is a bug to surface.

    ``scope="model"``: compile the whole forward, so the patch embedding, [CLS] and position
    embeddings, final norm and head are fused too. Under FSDP2 the graph breaks at every block's
    all-gather hooks (which run eagerly) and the blocks again share one graph; ``fullgraph`` is
    therefore ignored here.
    """
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {', '.join(COMPILE_SCOPES)}, got {scope!r}")
    if scope == "model":
        model.forward = torch.compile(model.forward, backend=backend)
        return model
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
    per_block: bool | None = None,
) -> VisionTransformer:
    """Shard the model with FSDP2 ``fully_shard``: each block is one all-gather unit, then the root.
    ``per_block=None`` (the default) makes the whole model one unit on a single device instead (see
    below); True or False forces either.

    ``param_dtype=None`` keeps parameters in their own dtype (fp32 training on CPU). ``mesh=None``
    shards over the whole default process group; a 2-D mesh from `hsdp_mesh` shards within groups
    and replicates across them.
    """
    # Parameters are all-gathered in param_dtype for compute; gradients are reduced in fp32 so that
    # summing over many ranks does not lose precision. Sharded parameters and optimizer state stay fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if per_block is None:
        per_block = (mesh.size() if mesh is not None else torch.distributed.get_world_size()) > 1
    if not per_block:
        # On one device there is nothing to shard and no communication to overlap: per-block units would
        # only add their hooks, about 1 ms of host time per block in forward and 2 in backward, which
        # left an H100 idle for a quarter of a ViT-H/14 step. One unit casts the parameters once per
        # step (kept for backward) and reduces the gradients once, and a whole-model compile
        # (`apply_compile(scope="model")`) sees one graph.
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
        return model
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
    # (FSDP keeps the root gathered from forward to backward only when reshard_after_forward is left
    # unset; an explicit True, as here by default, reshards it and gathers it again for backward.)
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
    ac_mode: str = "full",
    compile_scope: str = "blocks",
    per_block: bool | None = None,
) -> VisionTransformer:
    """Apply activation checkpointing, compile and FSDP2, in that order (each optional but FSDP)."""
    if activation_checkpointing:
        apply_activation_checkpointing(model, ac_mode)
    if compile:
        apply_compile(model, scope=compile_scope)
    return apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype, per_block=per_block)
