"""The ops over a device mesh: batch (data parallel) and heads (tensor parallel), no gathers.

A Pallas call is opaque to XLA's SPMD partitioner: inside ``jax.jit`` with sharded inputs, XLA
cannot split it, so it all-gathers every operand onto every device and runs the whole problem
everywhere. The two wrappers here fix that with ``jax.shard_map``: each device runs the op (Pallas
kernels, jnp path or interpreter, and their custom_vjps) on its own block of rows and heads, and the
operands keep the layout they already have (``b`` = ``batch_axis``, ``hd`` = ``head_axis``).

``sharded_chunk_gdp_fwd_o`` (the output stage, ``chunk_gdp_fwd_o``)::

    q [B, T, H, K]      P(b, None, hd, None)
    k [B, T*M, H, K]    P(b, None, hd, None)    (the M copies interleave on axis 1)
    v [B, T*M, H, V]    P(b, None, hd, None)
    h [B, NT, H, K, V]  P(b, None, hd, None, None)
    g [B, T, H]         P(b, None, hd)
    segment_ids [B, T]  P(b, None)              (replicated over head_axis)
    o [B, T, H, V]      P(b, None, hd, None)

``sharded_chunk_gated_delta_product`` (the full op, ``chunk_gated_delta_product``)::

    q [B, T, H, K]                P(b, None, hd, None)
    k [B, T*M, H, K]              P(b, None, hd, None)
    v [B, T*M, H, V]              P(b, None, hd, None)
    g [B, T, H]                   P(b, None, hd)            (natural-log gate, or None)
    beta [B, T*M, H]              P(b, None, hd)
    segment_ids [B, T]            P(b, None)                (replicated over head_axis)
    initial_state [B, H, K, V]    P(b, hd, None, None)
    o [B, T, H, V]                P(b, None, hd, None)
    final_state [B, H, K, V]      P(b, hd, None, None)      (None unless output_final_state)

Both ops are embarrassingly parallel over B and H (every row and head has its own state and its own
scan over T), so the body needs no collective at all: when the inputs already carry these shardings
(the usual case inside a jitted, Flax-sharded model), the compiled program has no all-gather,
all-to-all or all-reduce around the op, forward or backward (``tests/test_sharding.py`` checks the
compiled HLO).

Why shard_map and not ``jax.experimental.custom_partitioning``:

* Gradients. ``custom_partitioning`` has no differentiation rule (``jax.grad`` raises
  ``NotImplementedError: Differentiation rule for 'custom_partitioning' not implemented``), so it
  would need a second custom_vjp around two separately partitioned primitives (forward and the
  fused backward), each with GSPMD callbacks *and* a Shardy ``sharding_rule``. ``shard_map`` is
  differentiable as is: its transpose maps our existing custom_vjps over the same shards.
* Robustness. ``custom_partitioning`` runs Python callbacks inside XLA's partitioner and needs
  two rule sets that have changed across the JAX versions we support (GSPMD callbacks, then a
  Shardy ``sharding_rule``). ``jax.shard_map`` is the stable public API in both (0.10 and 0.11; older JAX gets
  ``jax.experimental.shard_map``).
* Flax. Flax's sharding annotations (``nn.with_partitioning``, ``nn.with_logical_constraint``) put
  NamedShardings on parameters and activations; shard_map consumes exactly those layouts inside
  ``jit``, and composes with ``jit``, ``grad`` and ``remat`` like any jnp function.
  The one cost is that the caller names the mesh axes (``batch_axis``, ``head_axis``); with
  logical axis rules, translate them with ``flax.linen.logical_to_mesh_axes``.

The token axis T is never sharded: the chunk-boundary states h come from a sequential scan over T in
the full operator, and these wrappers keep T whole on each device. Asking for it (``token_axis=...``)
raises ``ValueError``. If the inputs arrive sharded over T anyway (sequence-parallel activations),
XLA reshards them at the shard_map boundary to the layouts above: an all-gather over the T axis,
moving (n-1)/n of each operand's per-device bytes on an n-way T sharding. Mesh axes named in neither
``batch_axis`` nor ``head_axis`` see the operands replicated and compute the same result on each
device (correct, not faster).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from gdp_jax._src import dispatch
from gdp_jax._src import validation as val
from gdp_jax.ops.chunk_o import chunk_gdp_fwd_o
from gdp_jax.ops.gated_delta_product import chunk_gated_delta_product

AxisSpec = Union[None, str, Sequence[str]]

# check_vma=False: pallas_call's out_shape carries no varying-mesh-axes annotation, which
# check_vma=True demands; correctness does not rest on it, because every output block is computed
# from the matching input blocks only and out_specs says exactly that.
# axis_names: only the axes we shard over are manual. Mesh axes the op is replicated over stay
# automatic, so XLA keeps them replicated in the backward too; with every axis manual (and no vma
# tracking) shard_map's transpose would all-reduce the input cotangents over them instead.
if hasattr(jax, "shard_map"):                     # jax >= 0.7 (0.10.2 here, 0.11.2 on the GPU box)
    def _shard_map(f, mesh, in_specs, out_specs, axis_names):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(axis_names), check_vma=False)
else:  # older jax: the experimental spelling, fully manual (an extra cotangent all-reduce over
       # mesh axes named in neither batch_axis nor head_axis; values are still right)
    from jax.experimental.shard_map import shard_map as _experimental_shard_map

    def _shard_map(f, mesh, in_specs, out_specs, axis_names):
        return _experimental_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                       check_rep=False)


def sharded_chunk_gdp_fwd_o(q: jax.Array, k: jax.Array, v: jax.Array, h: jax.Array,
                            g: Optional[jax.Array] = None, *, mesh: Any = None,
                            batch_axis: AxisSpec = "data", head_axis: AxisSpec = None,
                            token_axis: AxisSpec = None, segment_ids: Optional[jax.Array] = None,
                            **op_kwargs) -> jax.Array:
    """``chunk_gdp_fwd_o`` with B sharded over ``batch_axis`` and H over ``head_axis`` of ``mesh``.

    Equal to ``chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=segment_ids, **op_kwargs)`` (the same
    numbers: each device runs the op on its rows and heads), differentiable the same way, and
    usable inside or outside ``jax.jit``. See the module docstring for the layouts.

    Args:
      q, k, v, h, g, segment_ids: as for ``chunk_gdp_fwd_o`` (global shapes).
      mesh: a ``jax.sharding.Mesh``; None uses the mesh set with ``jax.set_mesh``.
      batch_axis: mesh axis name (or tuple of names, or None) to shard B over; B must divide evenly.
      head_axis: mesh axis name (or tuple, or None) to shard H over; H must divide evenly.
      token_axis: must be None; T is never sharded (``ValueError`` otherwise, see module docstring).
      **op_kwargs: ``scale``, ``chunk_size``, ``num_householder``, ``implementation``, passed on.

    Returns:
      o [B, T, H, V], sharded ``P(batch_axis, None, head_axis, None)`` over ``mesh``.
    """
    def op_with(kwargs):
        return lambda q_, k_, v_, h_, g_, seg_: chunk_gdp_fwd_o(q_, k_, v_, h_, g_,
                                                                segment_ids=seg_, **kwargs)

    mesh, b, hd, names = _prepare("chunk_gdp_fwd_o", op_with, (q, k, v, h, g, segment_ids), mesh,
                                  batch_axis, head_axis, token_axis, op_kwargs,
                                  {"scale", "chunk_size", "num_householder", "implementation"})
    op = op_with(op_kwargs)
    if not names:  # nothing to shard over: the plain op, replicated by XLA
        return op(q, k, v, h, g, segment_ids)
    specs = (P(b, None, hd, None), P(b, None, hd, None), P(b, None, hd, None),
             P(b, None, hd, None, None), P(b, None, hd), P(b, None))
    return _map_shards(op, (q, k, v, h, g, segment_ids), specs, P(b, None, hd, None), mesh, names)


def sharded_chunk_gated_delta_product(q: jax.Array, k: jax.Array, v: jax.Array,
                                      g: Optional[jax.Array], beta: jax.Array, *, mesh: Any = None,
                                      batch_axis: AxisSpec = "data", head_axis: AxisSpec = None,
                                      token_axis: AxisSpec = None,
                                      segment_ids: Optional[jax.Array] = None,
                                      initial_state: Optional[jax.Array] = None,
                                      output_final_state: bool = False, **op_kwargs):
    """``chunk_gated_delta_product`` with B sharded over ``batch_axis`` and H over ``head_axis``.

    Equal to ``chunk_gated_delta_product(q, k, v, g, beta, segment_ids=segment_ids,
    initial_state=initial_state, output_final_state=output_final_state, **op_kwargs)`` (each device
    runs the full op, every stage and its custom_vjps, on its rows and heads), differentiable in q,
    k, v, g, beta and initial_state the same way, and usable inside or outside ``jax.jit``. See the
    module docstring for the layouts.

    Args:
      q, k, v, g, beta, segment_ids, initial_state, output_final_state: as for
        ``chunk_gated_delta_product`` (global shapes).
      mesh, batch_axis, head_axis, token_axis: as for ``sharded_chunk_gdp_fwd_o``.
      **op_kwargs: ``num_householder``, ``scale``, ``use_qk_l2norm``, ``chunk_size``,
        ``implementation``, passed on.

    Returns:
      (o, final_state): o [B, T, H, V] sharded ``P(batch_axis, None, head_axis, None)``;
      final_state [B, H, K, V] float32 sharded ``P(batch_axis, head_axis, None, None)``, or None
      unless ``output_final_state``.
    """
    def op_with(kwargs):
        def op(q_, k_, v_, g_, beta_, seg_, state_):
            return chunk_gated_delta_product(q_, k_, v_, g_, beta_, segment_ids=seg_,
                                             initial_state=state_,
                                             output_final_state=output_final_state, **kwargs)
        return op

    operands = (q, k, v, g, beta, segment_ids, initial_state)
    mesh, b, hd, names = _prepare(
        "chunk_gated_delta_product", op_with, operands, mesh, batch_axis, head_axis, token_axis,
        op_kwargs, {"num_householder", "scale", "use_qk_l2norm", "chunk_size", "implementation"})
    op = op_with(op_kwargs)
    if not names:  # nothing to shard over: the plain op, replicated by XLA
        return op(*operands)
    specs = (P(b, None, hd, None), P(b, None, hd, None), P(b, None, hd, None), P(b, None, hd),
             P(b, None, hd), P(b, None), P(b, hd, None, None))
    o_spec, state_spec = P(b, None, hd, None), P(b, hd, None, None)
    if output_final_state:  # a bool: eval_shape in _prepare ran the op's check_bool
        return _map_shards(op, operands, specs, (o_spec, state_spec), mesh, names)
    # No final state: map the output alone (shard_map's out_specs cannot describe a None leaf).
    o = _map_shards(lambda *a: op(*a)[0], operands, specs, o_spec, mesh, names)
    return o, None


def _prepare(op_name: str, op_with, operands, mesh, batch_axis, head_axis, token_axis, op_kwargs,
             allowed):
    """The wrappers' shared argument handling, in order: token_axis, keyword names, mesh and axis
    names, then the op's own checks on the GLOBAL shapes (so errors name the caller's shapes, not a
    shard's), then B and H divisibility. ``op_with(kwargs)`` is the op with its keyword arguments
    bound, taking ``operands``. Returns (mesh, batch spec entry, head spec entry, manual mesh axis
    names)."""
    if token_axis is not None:
        raise ValueError(
            f"token_axis={token_axis!r}: gdp_jax does not shard the token axis T. The chunk states h "
            "come from a sequential scan over T, so each device must hold whole sequences; shard B "
            "(batch_axis) and/or H (head_axis) instead. Inputs that arrive sharded over T are "
            "all-gathered over T by XLA at the call (see gdp_jax.sharding's docstring for the cost).")
    unknown = set(op_kwargs) - set(allowed)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)} for {op_name}")
    mesh = _resolve_mesh(mesh)
    batch_names = _axis_names("batch_axis", batch_axis, mesh)
    head_names = _axis_names("head_axis", head_axis, mesh)
    both = set(batch_names) & set(head_names)
    if both:
        raise ValueError(f"mesh axes {sorted(both)} are named in both batch_axis={batch_axis!r} and "
                         f"head_axis={head_axis!r}; a mesh axis can shard only one array axis")
    # eval_shape traces the jnp path abstractly (no compute, no kernel), running every check of the
    # op; the implementation name is checked separately since the trace forces "xla".
    dispatch.resolve_implementation(op_kwargs.get("implementation"))
    jax.eval_shape(op_with({**op_kwargs, "implementation": "xla"}), *operands)
    batch, heads = np.shape(operands[0])[0], np.shape(operands[0])[2]
    _check_divides("B", batch, "batch_axis", batch_names, mesh)
    _check_divides("H", heads, "head_axis", head_names, mesh)
    return mesh, _spec_entry(batch_names), _spec_entry(head_names), batch_names + head_names


def _map_shards(op, operands, specs, out_specs, mesh, names):
    """shard_map of ``op(*operands)``: None operands stay None (closed over, not mapped), the others
    are split with the matching entry of ``specs``."""
    present = [i for i, x in enumerate(operands) if x is not None]

    def local(*arrays):
        full = [None] * len(operands)
        for i, x in zip(present, arrays):
            full[i] = x
        return op(*full)

    mapped = _shard_map(local, mesh, tuple(specs[i] for i in present), out_specs, names)
    return mapped(*[operands[i] for i in present])


def _resolve_mesh(mesh):
    if mesh is not None:
        if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
            raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
        return mesh
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    context = get_abstract_mesh() if get_abstract_mesh is not None else None
    if context is None or not getattr(context, "axis_names", ()):
        raise ValueError("no mesh: pass mesh=jax.sharding.Mesh(...) or call inside "
                         "`with jax.set_mesh(mesh):`")
    return context


def _axis_names(arg: str, axis: AxisSpec, mesh) -> tuple[str, ...]:
    if axis is None:
        return ()
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{arg} must be a mesh axis name, a tuple of names or None; got {axis!r}")
        if name not in mesh.axis_names:
            raise ValueError(f"{arg}={axis!r}: mesh has no axis {name!r}; its axes are "
                             f"{tuple(mesh.axis_names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{arg}={axis!r} names a mesh axis twice")
    return names


def _check_divides(dim: str, size: int, arg: str, names: tuple[str, ...], mesh) -> None:
    shards = int(np.prod([mesh.shape[n] for n in names])) if names else 1
    if size % shards:
        raise ValueError(f"{dim} = {size} must be a multiple of the {shards} shards of {arg}="
                         f"{names if len(names) != 1 else names[0]!r} (mesh axes {dict(mesh.shape)})")


def _spec_entry(names: tuple[str, ...]):
    if not names:
        return None
    return names[0] if len(names) == 1 else names
