"""Split variants of the chunk-output backward: the fused kernel's work divided among programs.

Same math, masks and outputs as the fused kernel in ``chunk_o_bwd_pallas`` (whose module docstring
has the derivation and the padding / segment / NaN rules, followed here line for line); only the
division of work differs. ``chunk_o_bwd_pallas`` dispatches here on ``BwdKernelConfig.variant``.

Why. Compiled offline for sm_90 (Triton 3.9 on the IR that Pallas emits; bf16, K = V = 128, M = 2,
chunk 64), the fused kernel needs 255 registers and spills (208 B of stack at 8 warps, 768 B at 4),
so one 8-warp program runs per SM. Most of that is not the dot tiles but what a loop keeps live:
around the copy loop the compiler hoists every loop-invariant address tensor ([BT, 128] pointers and
offsets for q, do, k and v) and the [BT, BT] P tile, next to the carried dq accumulator. Straight-line
code without the loop (M = 1, or one copy per program) needs ~180 registers for the same work. So the
variants divide the work among programs that each hold little across a loop, and put the programs of
one chunk side by side in launch order so that their common inputs come from L2, not HBM.

The work of one (head, chunk, batch row) is three tasks:

    "dh"   dh = scale * (w ⊙ q)^T @ do                                         reads q, do
    "dq"   dq = scale * w ⊙ (do @ h^T) + sum_m dA_m @ k_m,  dg += q·(state term) reads q, k, v, h, do
    "dkv"  dv_m = scale * S_m^T @ do,  dk_m = dA_m^T @ q,  dg += rowsum(Z) - colsum(Z)
                                                                               reads q, k, v, do
with S_m = P ⊙ (q @ k_m^T), dpv_m = do @ v_m^T, dA_m = scale * P ⊙ dpv_m, Z = sum_m S_m ⊙ scale dpv_m
strictly below the diagonal ("dq" and "dkv" each form dpv_m and dA_m when they run apart).

A *role* is the set of tasks one program runs. ``roles`` strings read "dh|dq|dkv/m": '+' joins tasks
run by one program, '|' separates roles, and the suffix '/m' on dkv alone makes one role per copy m
(M programs, each straight-line code for its copy: dk_m and dv_m need nothing from other copies, and
each copy's part of dg goes to its own slot). One pallas_call launches one program per (role, head,
chunk, batch row), the role varying fastest, so the M + 2 programs of a chunk run side by side and
re-read q, do, k and v from L2: HBM traffic stays that of the fused kernel. Roles are pl.when
branches of one kernel (its registers are the heaviest role's). When several roles contribute to dg,
each writes its part to its own slot of a [slots, B, T, H] float32 array that the caller sums (2 MB
per slot at the headline shape). Offline (same setting): "dh|dq|dkv/m" needs 231 registers and no
spill at 4 warps for M = 1, 2, 3 (175 at K = V = 64), so two 4-warp programs fit per SM, as for the
forward kernel; "dh+dq|dkv" spills 112 B at 4 warps (the dkv copy loop), "dh+dq|dkv/m" 112 B.

Variants (``BwdKernelConfig.variant``):

``"roles"``: the one call above; ``roles`` names all three tasks (default "dh|dq|dkv/m").

``"split"``: two calls. A = dh alone, one program per (key block, value block, head, chunk, batch
    row) of ``dh_block_k`` x ``dh_block_v``; B = the roles kernel over dq and dkv (``roles`` without
    dh, default "dq|dkv/m"). q and do are read from HBM by both calls (+13 % traffic at K = V = 128,
    M = 2), in exchange for a kernel B with one role less. This is idea (a) of issue 3.

``"split_state"``: two calls. A = everything that touches h: dh and the state term
    dqs = scale * w ⊙ (do @ h^T), written as float32 [B, T, H, K], one program per (key block, head,
    chunk, batch row); B = the roles kernel over dq and dkv, seeding dq from dqs (it reads no h).
    Extra traffic: q and do read again, dqs written and read in float32 (+40 %); the other form of
    idea (a), kept to be measured.

Loop bodies, compared with the fused kernel (same sums in the same float32, up to summation order;
all only shorten live ranges): Z is not carried as a [BT, BT] tile but as its row and column sums
(two [BT] vectors), reduced as soon as S_m and dpv_m exist; every tile is loaded where it is used
(k_m again for the dq update, q and do again per dot, from L1/L2).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdp_jax._triton_warning import triton_backend_warning_filtered
from gdp_jax.chunk_o_pallas import _index, _load_rows

_LN2 = math.log(2.0)
TASKS = ("dh", "dq", "dkv")


class Role(NamedTuple):
    """The tasks of one program; ``copy`` is None (all copies, a loop) or the one copy it runs."""
    tasks: tuple[str, ...]
    copy: Optional[int] = None


def parse_roles(roles: str, num_householder: int) -> tuple[Role, ...]:
    """'dh+dq|dkv/m' -> (Role(('dh', 'dq')), Role(('dkv',), 0), ..., Role(('dkv',), M - 1)).

    Tasks joined by '+' run in one program, '|' separates programs; every task at most once. The
    suffix '/m' on a role of dkv alone gives it one program per copy m (no copy loop). Roles whose
    programs write no dg (dh alone) are moved first, so the dg slots are the last roles.
    """
    parsed = []
    for text in roles.split("|"):
        per_copy = text.strip().endswith("/m")
        tasks = tuple(t.strip() for t in text.strip().removesuffix("/m").split("+"))
        if per_copy and tasks != ("dkv",):
            raise ValueError(f"only dkv alone runs one program per copy ('dkv/m'); got {text!r}")
        parsed += ([Role(tasks, i) for i in range(num_householder)] if per_copy else [Role(tasks)])
    seen = [t for text in roles.split("|") for t in text.strip().removesuffix("/m").split("+")]
    seen = [t.strip() for t in seen]
    if any(t not in TASKS for t in seen) or len(seen) != len(set(seen)):
        raise ValueError(f"roles must be tasks {TASKS} joined by '+' (same program) and '|' "
                         f"(different programs), each at most once; got {roles!r}")
    return tuple(sorted(parsed, key=_writes_dg))


def _writes_dg(role: Role) -> bool:
    return bool({"dq", "dkv"} & set(role.tasks))


def _row_valid(chunk, chunk_size, tokens):
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)
    return chunk * chunk_size + t_in_chunk < tokens


def _row_weight(g_ref, start_rows_ref, row_valid):
    """w[t] = [same(t, c0)] 2^g[t] as [BT] float32, or None when it is all ones."""
    row_weight = None
    if g_ref is not None:
        row_weight = jnp.exp2(_load_rows(g_ref, row_valid))
    if start_rows_ref is not None:
        live_at_c0 = _load_rows(start_rows_ref, row_valid) == 0      # t's segment began by row 0
        row_weight = (jnp.where(live_at_c0, row_weight, 0.0) if row_weight is not None
                      else live_at_c0.astype(jnp.float32))
    return row_weight


def _pair_masks(g_ref, start_rows_ref, row_valid, chunk_size):
    """(strictly_lower, apply_p) of one chunk, as the fused kernel forms them.

    apply_p(x) = P ⊙ x for a [BT, BT] tile, P[t, s] = [s <= t, t real, same(s, t)] 2^(g[t] - g[s])
    (the mask alone without g). The exponent is masked before exp2, so padding rows never form
    2^(0 - g[s]).
    """
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    pair_mask = (cols <= rows) & row_valid[:, None]
    if start_rows_ref is not None:                                   # same(s, t), given s <= t
        pair_mask &= cols >= _load_rows(start_rows_ref, row_valid)[:, None]
    if g_ref is None:
        return cols < rows, lambda x: jnp.where(pair_mask, x, 0.0)
    g = _load_rows(g_ref, row_valid)
    exponent = jnp.where(pair_mask, g[:, None] - g[None, :], 0.0)
    pair_weight = jnp.where(pair_mask, jnp.exp2(exponent), 0.0)
    return cols < rows, lambda x: x * pair_weight


def _weighted(x, row_weight, scale):
    """scale * w[:, None] * x, float32."""
    return scale * x if row_weight is None else (scale * row_weight)[:, None] * x


# ------------------------------------------------------------------------- kernel A of split variants
def _dh_kernel(*refs, scale: float, chunk_size: int, tokens: int, block_v: int, with_dq_state: bool,
               has_g: bool, has_segments: bool):
    """dh (and, for split_state, dqs) of one (block, head, chunk, batch) program.

    q_ref is the program's [BT, BK] key block, do_ref its [BT, BV'] value block (BV' = V for
    split_state), h_ref the [BK, V] rows of h (split_state only); block_v walks do_ref.
    """
    q_ref, do_ref, *refs = refs
    h_ref = refs.pop(0) if with_dq_state else None
    g_ref = refs.pop(0) if has_g else None
    start_rows_ref = refs.pop(0) if has_segments else None
    dh_ref, *refs = refs
    dqs_ref = refs.pop(0) if with_dq_state else None
    assert not refs

    row_valid = _row_valid(pl.program_id(2), chunk_size, tokens)    # grid (block, H, NT, B)
    row_weight = _row_weight(g_ref, start_rows_ref, row_valid)
    q = _load_rows(q_ref, row_valid)                                 # [BT, BK]
    dtype = q.dtype
    wq = q if row_weight is None else (q * row_weight[:, None]).astype(dtype)
    dqs = None
    for start in range(0, do_ref.shape[-1], block_v):
        vb = pl.ds(start, block_v)
        do = _load_rows(do_ref.at[:, vb], row_valid)                 # [BT, BV]
        dh = scale * plgpu.dot(wq, do, trans_a=True)                 # [BK, BV]
        plgpu.store(dh_ref.at[:, vb], dh.astype(dh_ref.dtype))
        if with_dq_state:
            state_dtype = jnp.promote_types(dtype, h_ref.dtype)
            term = plgpu.dot(do.astype(state_dtype), h_ref[:, vb].astype(state_dtype), trans_b=True)
            dqs = term if dqs is None else dqs + term                # [BT, BK] f32
    if with_dq_state:
        plgpu.store(dqs_ref, _weighted(dqs, row_weight, scale), mask=row_valid[:, None])


# --------------------------------------------------------------------------------- the roles kernel
def _roles_kernel(*refs, roles, num_householder: int, scale: float, chunk_size: int, tokens: int,
                  block_k: int, block_v: int, dh_block_k: int, dh_block_v: int, state_source: str,
                  has_g: bool, has_segments: bool):
    """One (role, head, chunk, batch) program, or (head, chunk, batch) with a single role.

    Operands, each present only when a task of the call needs it (see ``_roles_call``):
    q, k, v, state (h [K, V] or, state_source "dqs", float32 [BT, K]), g, start_rows, do;
    outputs dq, dk, dv, dh, dg ([BT]: this program's slot when several roles write dg).
    """
    tasks = {t for role in roles for t in role.tasks}
    refs = list(refs)
    take = lambda cond: refs.pop(0) if cond else None
    q_ref = take(True)
    k_ref, v_ref = take(tasks & {"dq", "dkv"}), take(tasks & {"dq", "dkv"})
    state_ref = take("dq" in tasks)
    g_ref, start_rows_ref, do_ref = take(has_g), take(has_segments), take(True)
    dq_ref = take("dq" in tasks)
    dk_ref, dv_ref = take("dkv" in tasks), take("dkv" in tasks)
    dh_ref = take("dh" in tasks)
    dg_ref = take(has_g and tasks & {"dq", "dkv"})
    assert not refs

    multi = len(roles) > 1
    row_valid = _row_valid(pl.program_id(2 if multi else 1), chunk_size, tokens)
    traced_zero = _index(0 * pl.program_id(0))                       # formed outside any branch
    key_dim, value_dim = q_ref.shape[-1], do_ref.shape[-1]
    key_blocks = [pl.ds(start, block_k) for start in range(0, key_dim, block_k)]
    value_blocks = [pl.ds(start, block_v) for start in range(0, value_dim, block_v)]
    load_q = lambda kb: _load_rows(q_ref.at[:, kb], row_valid)
    load_do = lambda vb: _load_rows(do_ref.at[:, vb], row_valid)
    dtype = q_ref.dtype                                              # q, k, v and do share it
    row_mask = row_valid[:, None]

    def dh_task(row_weight):
        for k_start in range(0, key_dim, dh_block_k):
            kb = pl.ds(k_start, dh_block_k)
            q = load_q(kb)
            wq = q if row_weight is None else (q * row_weight[:, None]).astype(dtype)
            for v_start in range(0, value_dim, dh_block_v):
                vb = pl.ds(v_start, dh_block_v)
                dh = scale * plgpu.dot(wq, load_do(vb), trans_a=True)     # [BK, BV]
                plgpu.store(dh_ref.at[kb, vb], dh.astype(dh_ref.dtype))

    def state_term(row_weight):
        """[BT, BK] float32 blocks of scale * w ⊙ (do @ h^T), and its dg term q·(...) or None."""
        if state_source == "dqs":
            dqs = [_load_rows(state_ref.at[:, kb], row_valid) for kb in key_blocks]
        else:
            state_dtype = jnp.promote_types(dtype, state_ref.dtype)
            dqs = [None] * len(key_blocks)
            for vb in value_blocks:
                do = load_do(vb).astype(state_dtype)
                for j, kb in enumerate(key_blocks):
                    term = plgpu.dot(do, state_ref[kb, vb].astype(state_dtype), trans_b=True)
                    dqs[j] = term if dqs[j] is None else dqs[j] + term
            dqs = [_weighted(dq, row_weight, scale) for dq in dqs]
        dg = None
        if has_g:
            dg = sum(jnp.sum(load_q(kb).astype(jnp.float32) * dq, axis=1)
                     for kb, dq in zip(key_blocks, dqs))
        return dqs, dg

    def copy_loop(do_dq, do_dkv, dqs, apply_p, strictly_lower, copy):
        """The loop over copies m (or copy ``copy`` alone); returns (dq blocks, Z row sums, Z column
        sums)."""
        with_z = do_dkv and has_g

        def one_copy(i, carry):
            dqs, z_row, z_col = carry
            load_k = lambda kb: _load_rows(k_ref.at[:, i, kb], row_valid)
            dpv = None                                               # do @ v_m^T [BT, BT] f32
            for vb in value_blocks:
                term = plgpu.dot(load_do(vb), _load_rows(v_ref.at[:, i, vb], row_valid), trans_b=True)
                dpv = term if dpv is None else dpv + term
            if do_dkv:
                scores = sum(plgpu.dot(load_q(kb), load_k(kb), trans_b=True) for kb in key_blocks)
                scores = apply_p(scores)                             # S_m
                if with_z:                                           # Z_m, strictly below the diagonal
                    z = jnp.where(strictly_lower, scores * (scale * dpv), 0.0)
                    z_row = z_row + jnp.sum(z, axis=1)
                    z_col = z_col + jnp.sum(z, axis=0)
                scores_lo = scores.astype(dtype)
            d_scores_lo = (scale * apply_p(dpv)).astype(dtype)       # dA_m
            if do_dkv:
                for vb in value_blocks:
                    dv = scale * plgpu.dot(scores_lo, load_do(vb), trans_a=True)    # [BT, BV]
                    plgpu.store(dv_ref.at[:, i, vb], dv.astype(dv_ref.dtype), mask=row_mask)
                for kb in key_blocks:
                    dk = plgpu.dot(d_scores_lo, load_q(kb), trans_a=True)           # [BT, BK]
                    plgpu.store(dk_ref.at[:, i, kb], dk.astype(dk_ref.dtype), mask=row_mask)
            if do_dq:
                dqs = tuple(dq + plgpu.dot(d_scores_lo, load_k(kb)) for kb, dq in zip(key_blocks, dqs))
            return dqs, z_row, z_col

        zeros = jnp.zeros((chunk_size,), jnp.float32) if with_z else None
        carry = (tuple(dqs) if do_dq else (), zeros, zeros)
        if copy is not None or num_householder == 1:
            # A static copy index, as a traced scalar: a literal index inside a pl.when branch trips
            # the interpreter (jax 0.10); on the GPU the zero folds away.
            return one_copy(traced_zero + (copy or 0), carry)
        return jax.lax.fori_loop(0, num_householder, one_copy, carry)

    def run_role(role):
        row_weight = (_row_weight(g_ref, start_rows_ref, row_valid)
                      if {"dh", "dq"} & set(role.tasks) else None)
        if "dh" in role.tasks:
            dh_task(row_weight)
        do_dq, do_dkv = "dq" in role.tasks, "dkv" in role.tasks
        dg = None
        if do_dq or do_dkv:
            dqs, dg = state_term(row_weight) if do_dq else (None, None)
            strictly_lower, apply_p = _pair_masks(g_ref, start_rows_ref, row_valid, chunk_size)
            dqs, z_row, z_col = copy_loop(do_dq, do_dkv, dqs, apply_p, strictly_lower, role.copy)
            if do_dq:
                for kb, dq in zip(key_blocks, dqs):
                    plgpu.store(dq_ref.at[:, kb], dq.astype(dq_ref.dtype), mask=row_mask)
            if z_row is not None:
                dg = z_row - z_col if dg is None else dg + z_row - z_col
        if dg_ref is not None and _writes_dg(role):
            plgpu.store(dg_ref, _LN2 * dg, mask=row_valid)

    if multi:
        role_id = pl.program_id(0)
        for r, role in enumerate(roles):
            pl.when(role_id == r)(functools.partial(run_role, role))
    else:
        run_role(roles[0])


def _roles_call(q, k, v, state, g, start_rows, do, *, roles, scale, chunk_size, num_householder,
                block_k, block_v, dh_block_k, dh_block_v, num_warps, num_stages, interpret, name):
    """One pallas_call of the roles kernel; returns dict of its outputs (dg summed over slots)."""
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = -(-tokens // chunk_size)
    tasks = {t for role in roles for t in role.tasks}
    multi = len(roles) > 1
    dg_roles = [r for r, role in enumerate(roles) if _writes_dg(role)]   # the last ones (parse_roles)
    has_g = g is not None
    dg_slots = has_g and len(dg_roles) > 1
    state_source = "h" if state is not None and state.ndim == 5 else "dqs"

    # Grid ([R,] H, NT, B), role fastest; every block index ignores the role.
    grid = ((len(roles),) if multi else ()) + (heads, num_chunks, batch)
    ids = (lambda r, hd, c, b: (hd, c, b)) if multi else (lambda hd, c, b: (hd, c, b))

    def spec(block_shape, index_map):
        return pl.BlockSpec(block_shape, lambda *pids: index_map(*ids(*pids)))

    token_spec = lambda width: spec((None, chunk_size, None, width), lambda hd, c, b: (b, c, hd, 0))
    copies_spec = lambda width: spec((None, chunk_size, m, None, width),
                                     lambda hd, c, b: (b, c, 0, hd, 0))
    state_spec = spec((None, None, None, key_dim, value_dim), lambda hd, c, b: (b, c, hd, 0, 0))
    per_token_spec = spec((None, chunk_size, None), lambda hd, c, b: (b, c, hd))

    operands, in_specs = [q], [token_spec(key_dim)]
    if tasks & {"dq", "dkv"}:
        operands += [k.reshape(batch, tokens, m, heads, key_dim),
                     v.reshape(batch, tokens, m, heads, value_dim)]
        in_specs += [copies_spec(key_dim), copies_spec(value_dim)]
    if "dq" in tasks:
        operands.append(state)
        in_specs.append(state_spec if state_source == "h" else token_spec(key_dim))
    if has_g:
        operands.append(g)
        in_specs.append(per_token_spec)
    if start_rows is not None:
        operands.append(start_rows)
        in_specs.append(spec((None, chunk_size), lambda hd, c, b: (b, c)))
    operands.append(do)
    in_specs.append(token_spec(value_dim))

    names, out_shape, out_specs = [], [], []
    def out(name_, shape, dtype, spec_):
        names.append(name_)
        out_shape.append(jax.ShapeDtypeStruct(shape, dtype))
        out_specs.append(spec_)
    if "dq" in tasks:
        out("dq", q.shape, q.dtype, token_spec(key_dim))
    if "dkv" in tasks:
        out("dk", (batch, tokens, m, heads, key_dim), k.dtype, copies_spec(key_dim))
        out("dv", (batch, tokens, m, heads, value_dim), v.dtype, copies_spec(value_dim))
    if "dh" in tasks:
        out("dh", state.shape, state.dtype, state_spec)            # h's shape and dtype
    if has_g and dg_roles:
        if dg_slots:
            # Roles writing no dg come first; they map onto slot 0 and store nothing there.
            first = dg_roles[0]
            out("dg", (len(dg_roles), batch, tokens, heads), jnp.float32,
                pl.BlockSpec((None, None, chunk_size, None),
                             lambda r, hd, c, b: (jnp.maximum(r - first, 0), b, c, hd)))
        else:
            out("dg", (batch, tokens, heads), jnp.float32, per_token_spec)

    kernel = functools.partial(
        _roles_kernel, roles=roles, num_householder=m, scale=scale, chunk_size=chunk_size,
        tokens=tokens, block_k=block_k, block_v=block_v, dh_block_k=dh_block_k,
        dh_block_v=dh_block_v, state_source=state_source, has_g=has_g,
        has_segments=start_rows is not None)
    call = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name)
    outs = dict(zip(names, call(*operands)))
    if dg_slots:
        outs["dg"] = jnp.sum(outs["dg"], axis=0)
    return outs


def chunk_o_bwd_split(q, k, v, h, g, start_rows, do, *, scale: float, chunk_size: int,
                      num_householder: int, interpret: bool, variant: str, roles: str,
                      block_k: int, block_v: int, num_warps: int, num_stages: int,
                      dh_block_k: int, dh_block_v: int, dh_num_warps: int, dh_num_stages: int):
    """(dq, dk, dv, dh, dg) as ``chunk_o_bwd_pallas``, by the kernels of ``variant``.

    Inputs validated and block sizes checked by the caller; do already in v's dtype; segments as
    start_rows [B, T] int32 (``segments.segment_start_rows``) or None.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    has_g = g is not None
    parsed = parse_roles(roles, m)
    tasks = {t for role in parsed for t in role.tasks}
    common = dict(scale=scale, chunk_size=chunk_size, num_householder=m, block_k=block_k,
                  block_v=block_v, dh_block_k=dh_block_k, dh_block_v=dh_block_v,
                  num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    with triton_backend_warning_filtered():
        if variant == "roles":
            if tasks != set(TASKS):
                raise ValueError(f"variant 'roles' needs roles over all of {TASKS}; got {roles!r}")
            outs = _roles_call(q, k, v, h, g, start_rows, do, roles=parsed,
                               name="gdp_chunk_o_bwd_roles", **common)
            dh = outs["dh"]
        else:
            if tasks != {"dq", "dkv"}:
                raise ValueError(f"variant {variant!r} runs dh apart; roles must cover dq and dkv "
                                 f"only; got {roles!r}")
            dh, dqs = _dh_call(q, h, g, start_rows, do, chunk_size=chunk_size, scale=scale,
                               block_k=dh_block_k, block_v=dh_block_v,
                               with_dq_state=variant == "split_state", num_warps=dh_num_warps,
                               num_stages=dh_num_stages, interpret=interpret)
            outs = _roles_call(q, k, v, h if dqs is None else dqs, g, start_rows, do, roles=parsed,
                               name="gdp_chunk_o_bwd_intra", **common)
    dg = outs.get("dg") if has_g else None
    return (outs["dq"], outs["dk"].reshape(batch, tokens * m, heads, key_dim),
            outs["dv"].reshape(batch, tokens * m, heads, value_dim), dh, dg)


def _dh_call(q, h, g, start_rows, do, *, chunk_size, scale, block_k, block_v, with_dq_state, num_warps,
             num_stages, interpret):
    """Kernel A of split / split_state: (dh, dqs or None)."""
    batch, tokens, heads, key_dim = q.shape
    value_dim = do.shape[-1]
    num_chunks = h.shape[1]
    if with_dq_state:
        block_v_grid = value_dim                                     # dqs needs all of V per program
    else:
        block_v_grid = block_v
    n_vb = value_dim // block_v_grid
    grid = (key_dim // block_k * n_vb, heads, num_chunks, batch)     # block axis fastest
    kb_of, vb_of = (lambda blk: blk // n_vb), (lambda blk: blk % n_vb)
    in_specs = [
        pl.BlockSpec((None, chunk_size, None, block_k), lambda blk, hd, c, b: (b, c, hd, kb_of(blk))),
        pl.BlockSpec((None, chunk_size, None, block_v_grid),
                     lambda blk, hd, c, b: (b, c, hd, vb_of(blk))),
    ]
    operands = [q, do]
    if with_dq_state:
        operands.append(h)
        in_specs.append(pl.BlockSpec((None, None, None, block_k, value_dim),
                                     lambda blk, hd, c, b: (b, c, hd, blk, 0)))
    if g is not None:
        operands.append(g)
        in_specs.append(pl.BlockSpec((None, chunk_size, None), lambda blk, hd, c, b: (b, c, hd)))
    if start_rows is not None:
        operands.append(start_rows)
        in_specs.append(pl.BlockSpec((None, chunk_size), lambda blk, hd, c, b: (b, c)))
    out_shape = [jax.ShapeDtypeStruct(h.shape, h.dtype)]
    out_specs = [pl.BlockSpec((None, None, None, block_k, block_v_grid),
                              lambda blk, hd, c, b: (b, c, hd, kb_of(blk), vb_of(blk)))]
    if with_dq_state:
        out_shape.append(jax.ShapeDtypeStruct(q.shape, jnp.float32))
        out_specs.append(pl.BlockSpec((None, chunk_size, None, block_k),
                                      lambda blk, hd, c, b: (b, c, hd, blk)))
    kernel = functools.partial(_dh_kernel, scale=scale, chunk_size=chunk_size, tokens=tokens,
                               block_v=min(block_v, block_v_grid), with_dq_state=with_dq_state,
                               has_g=g is not None, has_segments=start_rows is not None)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="gdp_chunk_o_bwd_dh")(*operands)
    return outs[0], (outs[1] if with_dq_state else None)
