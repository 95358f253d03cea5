"""The ops over a device mesh: batch (data parallel), heads (tensor parallel), tokens (context parallel).

A Pallas call is opaque to XLA's SPMD partitioner: inside ``jax.jit`` with sharded inputs, XLA
cannot split it, so it all-gathers every operand onto every device and runs the whole problem
everywhere. The two wrappers here fix that with ``jax.shard_map``: each device runs the op (Pallas
kernels, jnp path or interpreter, and their custom_vjps) on its own block of rows, heads and
tokens, and the operands keep the layout they already have (``b`` = ``batch_axis``, ``hd`` =
``head_axis``, ``tok`` = ``token_axis``; each may be None).

``sharded_chunk_gdp_fwd_o`` (the output stage, ``chunk_gdp_fwd_o``)::

    q [B, T, H, K]      P(b, tok, hd, None)
    k [B, T*M, H, K]    P(b, tok, hd, None)     (the M copies interleave on axis 1)
    v [B, T*M, H, V]    P(b, tok, hd, None)
    h [B, NT, H, K, V]  P(b, tok, hd, None, None)
    g [B, T, H]         P(b, tok, hd)
    segment_ids [B, T]  P(b, tok)               (replicated over head_axis)
    o [B, T, H, V]      P(b, tok, hd, None)

``sharded_chunk_gated_delta_product`` (the full op, ``chunk_gated_delta_product``)::

    q [B, T, H, K]                P(b, tok, hd, None)
    k [B, T*M, H, K]              P(b, tok, hd, None)
    v [B, T*M, H, V]              P(b, tok, hd, None)
    g [B, T, H]                   P(b, tok, hd)             (natural-log gate, or None)
    beta [B, T*M, H]              P(b, tok, hd)
    segment_ids [B, T]            P(b, tok)                 (replicated over head_axis)
    initial_state [B, H, K, V]    P(b, hd, None, None)      (replicated over token_axis)
    o [B, T, H, V]                P(b, tok, hd, None)
    final_state [B, H, K, V]      P(b, hd, None, None)      (None unless output_final_state)

Both ops are embarrassingly parallel over B and H (every row and head has its own state and its own
scan over T), so over ``batch_axis`` and ``head_axis`` the body needs no collective at all: when the
inputs already carry these shardings (the usual case inside a jitted, Flax-sharded model), the
compiled program has no all-gather, all-to-all or all-reduce around the op, forward or backward
(``tests/test_sharding.py`` checks the compiled HLO).

The token axis (context parallelism). With ``token_axis`` set, each of its n devices holds one
contiguous block of T/n tokens (with the matching T*M/n positions and NT/n chunk states), and
T/n must be a whole number of chunks (T a multiple of n * chunk_size; ``ValueError`` otherwise),
so the blocks cut the global chunk grid at chunk boundaries:

* ``sharded_chunk_gdp_fwd_o`` needs no communication at all: h is given per chunk, and every term
  of a chunk's output lies in the chunk.
* ``sharded_chunk_gated_delta_product`` runs ``gdp_jax.context_parallel``: one local pass of the
  WY and walk stages per block gives the block's zero-start states and the linear map of its
  entering state (an affine summary S_out = A S_in + S0, A [K, K]); the devices exchange only these
  summaries (an all_gather of B*H*K*(K+V) float32 per device, plus one int32 pair per row for
  segments that start exactly on a block edge), combine them in order, and finish their blocks
  from the true entering states without a second walk (the output stage runs once on the local
  pass' outputs, which it is linear in). Segments may cross or touch block edges;
  initial_state enters the first block and final_state leaves the last. The backward is context
  parallel too (the all_gather transposes to a reduce-scatter of the summaries' cotangents). No
  collective of the compiled program, forward or backward, moves an operand of size O(T)
  (``tests/test_context_parallel.py`` checks every collective's operand in the HLO).

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
  The one cost is that the caller names the mesh axes (``batch_axis``, ``head_axis``,
  ``token_axis``); with
  logical axis rules, translate them with ``flax.linen.logical_to_mesh_axes``.

Without ``token_axis``, T is whole on each device: inputs that arrive sharded over T
(sequence-parallel activations) are resharded by XLA at the shard_map boundary, an all-gather over
T moving (n-1)/n of each operand's per-device bytes on an n-way T sharding; name that mesh axis in
``token_axis`` instead. Mesh axes named in none of ``batch_axis``, ``head_axis`` and ``token_axis``
see the operands replicated and compute the same result on each device (correct, not faster).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from gdp_jax._src import dispatch
from gdp_jax._src import validation as val
from gdp_jax.context_parallel import context_parallel_gdp
from gdp_jax.ops.chunk_o import chunk_gdp_fwd_o
from gdp_jax.ops.gated_delta_product import chunk_gated_delta_product

AxisSpec = Union[None, str, Sequence[str]]

# check_vma=False: pallas_call's out_shape carries no varying-mesh-axes annotation, which
# check_vma=True demands; correctness does not rest on it, because every output block is computed
# from the matching input blocks only and out_specs says exactly that. The one exception is the
# context-parallel final_state, replicated over token_axis: every device computes the same value
# from the all-gathered summaries, and without vma shard_map's transpose divides its cotangent by
# the axis size and psums the cotangents of inputs replicated over the axis (initial_state), which
# is exactly right for a value computed identically on every device (the tests check the gradients).
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
    """``chunk_gdp_fwd_o`` with B sharded over ``batch_axis``, H over ``head_axis`` and T over
    ``token_axis`` of ``mesh``.

    Equal to ``chunk_gdp_fwd_o(q, k, v, h, g, segment_ids=segment_ids, **op_kwargs)`` (the same
    numbers: each device runs the op on its rows, heads and chunks, with no communication),
    differentiable the same way, and usable inside or outside ``jax.jit``. See the module
    docstring for the layouts.

    Args:
      q, k, v, h, g, segment_ids: as for ``chunk_gdp_fwd_o`` (global shapes).
      mesh: a ``jax.sharding.Mesh``; None uses the mesh set with ``jax.set_mesh``.
      batch_axis: mesh axis name (or tuple of names, or None) to shard B over; B must divide evenly.
      head_axis: mesh axis name (or tuple, or None) to shard H over; H must divide evenly.
      token_axis: mesh axis name (or tuple, or None) to shard T over in contiguous blocks (and
        T*M, and h's NT, alike); T must be a multiple of chunk_size times its shard count, so that
        each block is a whole number of chunks.
      **op_kwargs: ``scale``, ``chunk_size``, ``num_householder``, ``implementation``, passed on.

    Returns:
      o [B, T, H, V], sharded ``P(batch_axis, token_axis, head_axis, None)`` over ``mesh``.
    """
    def op_with(kwargs):
        return lambda q_, k_, v_, h_, g_, seg_: chunk_gdp_fwd_o(q_, k_, v_, h_, g_,
                                                                segment_ids=seg_, **kwargs)

    mesh, b, hd, tok, names = _prepare(
        "chunk_gdp_fwd_o", op_with, (q, k, v, h, g, segment_ids), mesh, batch_axis, head_axis,
        token_axis, op_kwargs, {"scale", "chunk_size", "num_householder", "implementation"})
    op = op_with(op_kwargs)
    if not names:  # nothing to shard over: the plain op, replicated by XLA
        return op(q, k, v, h, g, segment_ids)
    # Token blocks are whole chunks (checked in _prepare): every term of a chunk's output lies in
    # the chunk, so the plain op on each block is the block of the result.
    specs = (P(b, tok, hd, None), P(b, tok, hd, None), P(b, tok, hd, None),
             P(b, tok, hd, None, None), P(b, tok, hd), P(b, tok))
    return _map_shards(op, (q, k, v, h, g, segment_ids), specs, P(b, tok, hd, None), mesh, names)


def sharded_chunk_gated_delta_product(q: jax.Array, k: jax.Array, v: jax.Array,
                                      g: Optional[jax.Array], beta: jax.Array, *, mesh: Any = None,
                                      batch_axis: AxisSpec = "data", head_axis: AxisSpec = None,
                                      token_axis: AxisSpec = None,
                                      segment_ids: Optional[jax.Array] = None,
                                      initial_state: Optional[jax.Array] = None,
                                      output_final_state: bool = False, **op_kwargs):
    """``chunk_gated_delta_product`` with B sharded over ``batch_axis``, H over ``head_axis`` and
    T over ``token_axis`` (context parallelism).

    Equal to ``chunk_gated_delta_product(q, k, v, g, beta, segment_ids=segment_ids,
    initial_state=initial_state, output_final_state=output_final_state, **op_kwargs)``,
    differentiable in q, k, v, g, beta and initial_state the same way, and usable inside or outside
    ``jax.jit``. Over B and H each device runs the full op (every stage and its custom_vjps) on its
    rows and heads; over T each device runs ``gdp_jax.context_parallel.context_parallel_gdp`` on its
    block, exchanging only per-block state summaries (module docstring). See the module docstring
    for the layouts.

    Args:
      q, k, v, g, beta, segment_ids, initial_state, output_final_state: as for
        ``chunk_gated_delta_product`` (global shapes). Segments may cross and start on block
        edges; initial_state is the state before each row's first token (block 0).
      mesh, batch_axis, head_axis, token_axis: as for ``sharded_chunk_gdp_fwd_o`` (T a multiple of
        chunk_size times the shard count of token_axis).
      **op_kwargs: ``num_householder``, ``scale``, ``use_qk_l2norm``, ``chunk_size``,
        ``implementation``, passed on.

    Returns:
      (o, final_state): o [B, T, H, V] sharded ``P(batch_axis, token_axis, head_axis, None)``;
      final_state [B, H, K, V] float32 sharded ``P(batch_axis, head_axis, None, None)``
      (replicated over token_axis), or None unless ``output_final_state``.
    """
    def op_with(kwargs):
        def op(q_, k_, v_, g_, beta_, seg_, state_):
            return chunk_gated_delta_product(q_, k_, v_, g_, beta_, segment_ids=seg_,
                                             initial_state=state_,
                                             output_final_state=output_final_state, **kwargs)
        return op

    operands = (q, k, v, g, beta, segment_ids, initial_state)
    mesh, b, hd, tok, names = _prepare(
        "chunk_gated_delta_product", op_with, operands, mesh, batch_axis, head_axis, token_axis,
        op_kwargs, {"num_householder", "scale", "use_qk_l2norm", "chunk_size", "implementation"})
    if tok is None:
        op = op_with(op_kwargs)
    else:
        op = _context_parallel_op(q, k, _axis_names("token_axis", token_axis, mesh),
                                  output_final_state, op_kwargs)
    if not names:  # nothing to shard over: the plain op, replicated by XLA
        return op(*operands)
    specs = (P(b, tok, hd, None), P(b, tok, hd, None), P(b, tok, hd, None), P(b, tok, hd),
             P(b, tok, hd), P(b, tok), P(b, hd, None, None))
    o_spec, state_spec = P(b, tok, hd, None), P(b, hd, None, None)
    if output_final_state:  # a bool: eval_shape in _prepare ran the op's check_bool
        return _map_shards(op, operands, specs, (o_spec, state_spec), mesh, names)
    # No final state: map the output alone (shard_map's out_specs cannot describe a None leaf).
    o = _map_shards(lambda *a: op(*a)[0], operands, specs, o_spec, mesh, names)
    return o, None


def _context_parallel_op(q, k, token_names, output_final_state, op_kwargs):
    """The per-device body over a token axis: ``context_parallel_gdp`` with the op's keyword
    arguments resolved as the op resolves them (already checked by _prepare on global shapes)."""
    tokens, key_dim = np.shape(q)[1], np.shape(q)[3]
    kwargs = dict(
        token_axis=token_names, output_final_state=output_final_state,
        scale=val.check_scale(op_kwargs.get("scale"), key_dim),
        chunk_size=int(op_kwargs.get("chunk_size", 64)),
        num_householder=np.shape(k)[1] // tokens,
        use_qk_l2norm=bool(op_kwargs.get("use_qk_l2norm", False)),
        implementation=dispatch.resolve_implementation(op_kwargs.get("implementation")))

    def op(q_, k_, v_, g_, beta_, seg_, state_):
        return context_parallel_gdp(q_, k_, v_, g_, beta_, seg_, state_, **kwargs)
    return op


def _prepare(op_name: str, op_with, operands, mesh, batch_axis, head_axis, token_axis, op_kwargs,
             allowed):
    """The wrappers' shared argument handling, in order: keyword names, mesh and axis names, then
    the op's own checks on the GLOBAL shapes (so errors name the caller's shapes, not a shard's),
    then B, H and T divisibility. ``op_with(kwargs)`` is the op with its keyword arguments bound,
    taking ``operands``. Returns (mesh, batch spec entry, head spec entry, token spec entry,
    manual mesh axis names)."""
    unknown = set(op_kwargs) - set(allowed)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)} for {op_name}")
    mesh = _resolve_mesh(mesh)
    axes = {"batch_axis": batch_axis, "head_axis": head_axis, "token_axis": token_axis}
    named = {arg: _axis_names(arg, axis, mesh) for arg, axis in axes.items()}
    args = list(named)
    for i, first in enumerate(args):
        for second in args[i + 1:]:
            both = set(named[first]) & set(named[second])
            if both:
                raise ValueError(
                    f"mesh axes {sorted(both)} are named in both {first}={axes[first]!r} and "
                    f"{second}={axes[second]!r}; a mesh axis can shard only one array axis")
    # eval_shape traces the jnp path abstractly (no compute, no kernel), running every check of the
    # op; the implementation name is checked separately since the trace forces "xla".
    dispatch.resolve_implementation(op_kwargs.get("implementation"))
    jax.eval_shape(op_with({**op_kwargs, "implementation": "xla"}), *operands)
    batch, tokens, heads = (np.shape(operands[0])[i] for i in (0, 1, 2))
    _check_divides("B", batch, "batch_axis", named["batch_axis"], mesh)
    _check_divides("H", heads, "head_axis", named["head_axis"], mesh)
    if named["token_axis"]:
        chunk_size = int(op_kwargs.get("chunk_size", 64))     # checked by the op above
        shards = int(np.prod([mesh.shape[n] for n in named["token_axis"]]))
        if tokens % (shards * chunk_size):
            raise ValueError(
                f"T = {tokens} must be a multiple of chunk_size * (shards of token_axis="
                f"{token_axis!r}) = {chunk_size} * {shards} = {chunk_size * shards}: each device "
                "holds a contiguous block of T, a whole number of chunks (pad T, e.g. with one more "
                "segment, or use a smaller chunk_size)")
    names = named["batch_axis"] + named["head_axis"] + named["token_axis"]
    return (mesh, _spec_entry(named["batch_axis"]), _spec_entry(named["head_axis"]),
            _spec_entry(named["token_axis"]), names)


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
    try:
        names = (axis,) if isinstance(axis, str) else tuple(axis)
    except TypeError:
        names = (axis,)                     # not a name nor a sequence of names: refused below
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
