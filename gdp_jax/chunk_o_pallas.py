"""Pallas kernel (Triton lowering) for the chunk-output stage of Gated DeltaProduct.

One program computes one (value block, chunk, batch*head) tile of SPEC's chunked form:

    o[t] = scale * ( [same(t, c0)] * 2^g[t] * q[t]·h[c]
                     + sum_{s in [c0, t], same(s, t)} sum_{m < M} 2^(g[t]-g[s]) (q[t]·k[s*M+m]) v_new[s*M+m] )

The query tile is loaded once and reused for the carried-state term and for all M Householder
copies. Where the K loop is on (``KernelConfig.block_k``, the default for 2-byte inputs at K >= 128),
q·h and every copy's q·k scores instead accumulate over K in block_k-wide steps, each q slice
read once, so that Triton can pipeline the loads (a second value tile re-reads q in its own loop).
With ``KernelConfig.value_step`` (the default at M = 3) the K loop makes only the scores, and a
second pipelined loop over value columns makes q·h and the score·v dots.

The M copies of k and v are read straight from the caller's [B, T*M, H, *] arrays: viewed as
[B, T, M*H, *] (a free reshape), copy m of head h is "head" m*H + h, so each copy is one strided
BlockSpec over the same buffer and nothing is transposed or copied in HBM.

Segments reach the kernel as one int32 per token, the row where its segment begins within its
chunk (``segments.segment_start_rows``), so each mask is a comparison with a per-row value.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gdp_jax._triton_warning import triton_backend_warning_filtered
from gdp_jax.segments import segment_start_rows

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters; chosen per shape by ``kernel_config``."""
    block_v: int                   # value columns of one h / v / o tile
    value_blocks_per_program: int  # value tiles one program loops over, reusing its q·k scores
    chunks_per_program: int        # consecutive chunks one program walks, so Triton can prefetch
    heads_fastest: bool            # launch order: neighbouring programs take neighbouring heads
    num_warps: int
    num_stages: int
    # Order of a chunk's work without a K loop (one value tile per program only): "scores_first"
    # makes every copy's q·k scores, then q·h and the score·v dots; "fused" takes q·h, then each
    # copy's score and its score·v dot in turn, so only one [BT, BT] score is live.
    copy_order: str = "scores_first"
    # Key columns per step of a loop over K that accumulates q·h and every copy's q·k scores
    # (None: all of K at once). Triton software-pipelines that loop: its loads become
    # asynchronous copies into shared memory, in flight while the previous step multiplies.
    block_k: int | None = None
    # With the K loop: value columns per step of a second loop, over the program's value columns,
    # that makes the state term q·h and the score·v dots (None: q·h accumulates in the K loop and
    # the v tiles are read after it). Triton pipelines that loop too, so the h and v loads become
    # asynchronous copies, and the K loop carries only the scores.
    value_step: int | None = None
    # With the K loop, no value_step and one value tile per program: load the v tiles before the
    # K loop, so their latency hides behind it. They are held through the loop (in the sm_90a
    # build, 32 KB more shared memory per program); the default at K = 256 with M = 2 only.
    prefetch_values: bool = False


def kernel_config(key_dim: int, value_dim: int, chunk_size: int, num_householder: int,
                  itemsize: int = 2, *,
                  block_v: int | None = None, value_blocks_per_program: int | None = None,
                  chunks_per_program: int | None = None, heads_fastest: bool | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  copy_order: str | None = None, block_k: int | None = None,
                  value_step: int | None = None,
                  prefetch_values: bool | None = None) -> KernelConfig:
    """Block and launch sizes for padded (power-of-two) K and V; keyword overrides are for tuning.

    ``itemsize`` is the widest of q's and h's element sizes in bytes. Override ``block_k=0`` to
    turn the K loop off where it is the default.

    Measured on an H200 (jax 0.11.2, bf16, chunk 64, benchmarks/tune_chunk_o.py; RESULTS.md has
    the tables), at B=8 T=4096 H=16 K=V=128 M=2 unless said otherwise:
    - the loop over K (block_k; eighth session): at K = 128 and 256 a program that loads all of K
      at once waits on each load group in turn (register-held loads, benchmarks/CODEGEN.md) and
      stayed at 80-87 % of the floor whatever else was tried below. Stepping through K lets Triton
      pipeline the q, k and h loads with cp.async. M = 1: 0.219 -> 0.192-0.197 ms (block_k 64);
      M = 2: 0.311 -> 0.275-0.281 (block_k 32, 4 stages; 64 with 2 stages 0.279-0.289); M = 3:
      0.394 -> 0.334-0.338 (block_k 64; 32 with 3-4 stages 0.355-0.362); K = V = 256, M = 2:
      0.772 -> 0.708 (block_k 32, 4 stages, two 128-wide value programs; 0.733 with both value
      tiles in one program). All copies' scores accumulate in the one loop: a loop per copy
      ("fused") was slower everywhere (M = 2 0.320-0.328, M = 3 0.370-0.416 ms); 8 warps too (0.475 at
      M = 2). At K = V = 64 the 4-chunk pipeline stays better (0.229 vs 0.266 ms). Not measured
      at M >= 4 or with 4-byte inputs, which keep the configs below; K = 256 at M = 1 or 3 and
      V = 256 at K = 128 take the K = V = 256, M = 2 choice without a measurement of their own.
    - ninth session: M = 2 at K = 128 with 5 stages of block_k 32 (0.280 -> 0.274 ms, packed rows
      0.277 -> 0.273; 3 stages 0.279-0.283). M = 3 with the second loop over value columns
      (value_step 64; offline, its spills drop from 400 bytes to 24): 0.338-0.342 -> 0.324-0.325
      ms. That loop did not help elsewhere: M = 1 0.196 -> 0.197, M = 2 at best 0.278 (block_k 64,
      2 stages; 0.293-0.410 otherwise), K = V = 256 0.777-1.689 (q's [64, 256] tile held through
      it). Making the score weights after the K loop rather than before it was slower everywhere
      (M = 2 0.287, K = 256 0.725 ms), though it spills less.
    - tenth session, K = V = 256, M = 2: the same 4-stage kernel ran at 0.695-0.725 ms from one
      process to the next (87-91 % of the floor), and configs alternated within one process
      ranked differently from one process to the next. 5 stages: 0.710 vs 0.723 ms on one card;
      0.691 vs 0.704, then 0.702 vs 0.697, on another card minutes apart. The scores' K loop
      apart from the state term's (64 keys a step, 3 stages): 0.691-0.703 vs 0.695-0.712, then
      0.744 vs 0.723. Nothing beat 4 stages by more than that spread, so it stays. Clearly
      slower: 3 stages (0.740 vs 0.704), 64 keys with 3 stages (0.852), 2 or 4 chunks per program
      (0.730-0.804), one 256-wide program of 8 warps (0.888-0.978).
    - eleventh session: that spread follows the machine (processes on one machine agree to
      0.3 %). K = V = 256's timing loops hit the H200's 700 W power cap, and the SM clock drops to
      840-1600 MHz (sampled on one machine; likely by different amounts on different cards).
      In one process per machine, v loaded before the K loop (prefetch_values): 0.695 -> 0.688
      and 0.720 -> 0.714 ms at K = V = 256, M = 2, slower everywhere else (see the rule below).
      Slower at K = 256: 8 warps (1.086), block_k 16 with 6-8 stages (0.771-0.783), 32 query rows
      per program (0.865-0.952); no gain from L2 eviction hints (0.697).
    - twelfth session, K = V = 256, M = 2: from a rested card (full clock) the default runs at
      0.674-0.676 ms, 93-94 % of the floor; back to back the power cap holds the clock at
      1590-1740 MHz, and 0.689-0.711 ms. Both value tiles in one program (the scores once, 20 %
      fewer FLOPs) ran cooler, 1860 against 1605 MHz, but slower: 0.721 against 0.711 ms.
    - thirteenth session, K = V = 256, M = 2: one program per chunk with the scores in a K loop
      of their own and q·h in a K loop per value step (q re-read; at step 64 no spill offline)
      ran cooler again and slower again: 0.725 (step 128) and 0.777 (step 64) against 0.718 ms.
    - 4 warps, not 8: 0.314 vs 0.508 ms. The kernel is memory-bound; smaller programs leave room for
      more of them per SM, so more loads are in flight.
    - neighbouring programs take neighbouring heads (heads_fastest): 0.307 vs 0.320 ms (0.229 vs
      0.244 at K = V = 64); together they read one contiguous [BT, H, K] slab of q instead of H
      strided ones.
    - without the K loop: all of V in one program (V <= 128: 0.307 ms, vs 0.352 ms with two value
      programs that each re-read q and k); V = 256 loops over two 128-wide value tiles inside one
      program, reusing the q·k scores (0.764 ms, vs 0.848 with two programs and 0.903 with 64-wide
      tiles).
    - several chunks per program only pays at K = V = 64 (software-pipelined over 4 chunks, 0.229
      ms at B=4 T=8192 H=32 M=2 vs 0.297 for one chunk); at K = 128 the pipelined buffers need a
      whole SM's shared memory and were no faster (M = 1 0.219-0.221 ms with 2 or 4 chunks).
    - not measured to help: 2 warps (0.55 ms), an evict-first L2 hint on the loads (0.313 ms),
      every tile's load written before the first dot (fifth session, removed: 0.320 vs 0.310 ms).
    - copy_order "fused" for M >= 3 without the K loop (seventh session): M = 3 0.401 -> 0.391 ms
      (its scores no longer all live at once); M = 2 and 1 keep "scores_first".
    """
    if copy_order not in (None, "scores_first", "fused"):
        raise ValueError(f"copy_order must be 'scores_first' or 'fused', got {copy_order!r}")
    small = key_dim <= 64 and value_dim <= 64
    # The measured regime of the K loop: 2-byte tiles, chunk 64, K of 128 or 256, M <= 3.
    k_loop = key_dim >= 128 and chunk_size == 64 and itemsize <= 2 and num_householder <= 3
    default_key_loop = block_k is None and k_loop
    if default_key_loop:
        block_k = 32 if num_householder == 2 or key_dim > 128 else 64
        num_stages = num_stages or (5 if key_dim == 128 and num_householder == 2
                                    else 4 if block_k == 32 else 2)
        if value_dim > 128 and block_v is None and value_blocks_per_program is None:
            block_v, value_blocks_per_program = 128, 1       # two value programs (K = 256: 0.708 ms)
        if (value_step is None and num_householder == 3 and key_dim == 128
                and (block_v or value_dim) == 128 and (value_blocks_per_program or 1) == 1):
            value_step = 64                                  # M = 3: 0.338 -> 0.325 ms
    block_k = block_k or None                                # an override of 0: no K loop
    if block_k is not None and (block_k < 16 or key_dim % block_k or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two >= 16 dividing key_dim={key_dim}, "
                         f"got {block_k}")
    if block_k is not None and copy_order == "fused":
        raise ValueError("block_k takes copy_order='scores_first': every copy's scores accumulate "
                         "in the one loop over K")
    if block_v is None:
        block_v = min(value_dim, 128)
    if value_blocks_per_program is None:
        value_blocks_per_program = value_dim // block_v
    if value_step is not None:
        program_width = block_v * value_blocks_per_program
        if block_k is None:
            raise ValueError("value_step needs the K loop (block_k)")
        if value_step < 16 or program_width % value_step or value_step & (value_step - 1):
            raise ValueError(f"value_step must be a power of two >= 16 dividing the "
                             f"{program_width} value columns of a program, got {value_step}")
    if prefetch_values is None:
        # K = 256, M = 2: 0.695 -> 0.688 and 0.720 -> 0.714 ms, on two machines. Slower
        # elsewhere: K = 128 M = 2 0.268 -> 0.343 (the held tiles' shared memory leaves one
        # program per SM), M = 1 0.191 -> 0.200; K = 256 M = 1 0.530 -> 0.559, M = 3 0.913 -> 1.042.
        prefetch_values = (default_key_loop and key_dim > 128 and num_householder == 2
                           and value_step is None and value_blocks_per_program == 1)
    if prefetch_values and block_k is None:
        raise ValueError("prefetch_values needs the K loop (block_k)")
    if prefetch_values and (value_step is not None or value_blocks_per_program != 1):
        raise ValueError("prefetch_values needs one value tile per program and no value_step")
    if copy_order is None:
        copy_order = "fused" if num_householder >= 3 and block_k is None else "scores_first"
    return KernelConfig(
        block_v=block_v,
        value_blocks_per_program=value_blocks_per_program,
        chunks_per_program=chunks_per_program or (4 if small and chunk_size <= 64 else 1),
        heads_fastest=True if heads_fastest is None else heads_fastest,
        num_warps=num_warps or 4,
        num_stages=num_stages or 2,
        copy_order=copy_order,
        block_k=block_k,
        value_step=value_step,
        prefetch_values=prefetch_values)


def _index(x):
    """An int32 scalar from pl.program_id in the dtype a Python int index takes (int64 under
    jax_enable_x64, else int32: a no-op). Pallas' interpreter slices with every index of a ref
    in one dynamic_slice, which refuses mixed int32 and int64, so a loop counter or index made
    from program ids must match the literal offsets beside it."""
    return jnp.asarray(x, dtype=int)


def _load_rows(ref, row_valid, other=0):
    """Masked load of a [rows, ...] tile; rows past the end of the sequence read ``other``."""
    mask = row_valid.reshape(row_valid.shape + (1,) * (len(ref.shape) - 1))
    return plgpu.load(ref, mask=mask, other=other)


def _chunk_o_kernel(*refs, num_householder: int, scale: float, chunk_size: int, tokens: int,
                    num_chunks: int, chunks_per_program: int, block_v: int,
                    value_blocks_per_program: int, chunk_axis: int, has_g: bool, has_segments: bool,
                    copy_order: str = "scores_first", block_k: int | None = None,
                    value_step: int | None = None,
                    prefetch_values: bool = False):
    q_ref, *refs = refs
    k_refs, refs = refs[:num_householder], refs[num_householder:]
    v_refs, refs = refs[:num_householder], refs[num_householder:]
    h_ref, *refs = refs
    g_ref = refs.pop(0) if has_g else None
    start_rows_ref = refs.pop(0) if has_segments else None
    (o_ref,) = refs

    first_chunk = pl.program_id(chunk_axis) * chunks_per_program
    t_in_chunk = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0)
    t_ids = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    s_ids = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    causal = s_ids <= t_ids                                         # s <= t, diagonal included

    def one_chunk(i, carry):
        chunk_rows = pl.ds(i * chunk_size, chunk_size)              # this chunk within the block
        row_valid = (first_chunk + i) * chunk_size + t_in_chunk < tokens   # last chunk may be partial

        load_rows = functools.partial(_load_rows, row_valid=row_valid)
        q = None if block_k else load_rows(q_ref.at[chunk_rows])   # [BT, K], read once
        pair_mask = causal
        row_weight = None                                           # weight of q[t]·h[c]
        if has_g:
            g = load_rows(g_ref.at[chunk_rows])                     # [BT] f32 log2 decays
            row_weight = jnp.exp2(g)
        if has_segments:
            start_row = load_rows(start_rows_ref.at[chunk_rows])    # [BT] where t's segment begins
            pair_mask &= s_ids >= start_row[:, None]                # same(s, t), given s <= t
            live_at_c0 = start_row == 0
            row_weight = (jnp.where(live_at_c0, row_weight, 0.0) if has_g
                          else live_at_c0.astype(jnp.float32))

        # Decayed, masked scores 2^(g[t]-g[s]) q[t]·k[s] of one Householder copy.
        if has_g:
            pair_weight = jnp.where(pair_mask, jnp.exp2(g[:, None] - g[None, :]), 0.0)

        def weigh(score):                                           # [BT, BT] f32 -> v's dtype
            score = score * pair_weight if has_g else jnp.where(pair_mask, score, 0.0)
            return score.astype(v_refs[0].dtype)

        def copy_score(k_ref):
            k = load_rows(k_ref.at[chunk_rows])                     # [BT, K]
            return weigh(plgpu.dot(q, k, trans_b=True))             # [BT, BT]

        def state_dot(q_cols, state):                               # [BT, k] @ [k, BV] -> f32
            dot_dtype = jnp.promote_types(q_cols.dtype, state.dtype)
            return plgpu.dot(q_cols.astype(dot_dtype), state.astype(dot_dtype))

        def weigh_rows(o):
            # Carried-state term [same(t, c0)] 2^g[t] q[t]·h[c]: the row weight, applied in f32.
            return o if row_weight is None else o * row_weight[:, None]

        def state_term(q, value_cols):                              # [BT, BV] f32
            return weigh_rows(state_dot(q, h_ref[i, :, value_cols]))

        def store(o, value_cols):
            plgpu.store(o_ref.at[chunk_rows, value_cols], (scale * o).astype(o_ref.dtype),
                        mask=row_valid[:, None])

        def load_value(v_ref, value_cols):                          # [BT, BV]
            return load_rows(v_ref.at[chunk_rows, value_cols])

        def finish(o, scores, value_cols, values=None):
            """Adds every copy's score·v (the intra-chunk term) to the state term o; stores.
            ``values``: the v tiles if already loaded, else each is loaded just before its dot."""
            for copy, (score, v_ref) in enumerate(zip(scores, v_refs)):
                v = values[copy] if values is not None else load_value(v_ref, value_cols)
                o += plgpu.dot(score, v)
            store(o, value_cols)

        if block_k is not None:
            # Scores and the state term accumulate over K in steps of block_k; Triton pipelines
            # each such loop, so step j+1's q, k and h tiles are in flight while step j multiplies.
            zeros = lambda n: jnp.zeros((chunk_size, n), jnp.float32)

            def key_loop(value_cols, copy_k_refs):
                """q·h[:, value_cols] (omitted where value_cols is None) and each copy's q·k^T,
                summed over K in block_k steps."""
                with_state = value_cols is not None
                def key_step(j, acc):
                    key_cols = pl.ds(j * block_k, block_k)
                    q_part = load_rows(q_ref.at[chunk_rows, key_cols])     # [BT, BK]
                    if with_state:
                        o_state = acc[0] + state_dot(q_part, h_ref[i, key_cols, value_cols])
                    scores = [score + plgpu.dot(q_part, load_rows(k_ref.at[chunk_rows, key_cols]),
                                                trans_b=True)               # [BT, BT]
                              for score, k_ref in zip(acc[with_state:], copy_k_refs)]
                    return (o_state, *scores) if with_state else tuple(scores)
                init = ((zeros(block_v),) if with_state else ()) + tuple(
                    zeros(chunk_size) for _ in copy_k_refs)
                return jax.lax.fori_loop(0, q_ref.shape[-1] // block_k, key_step, init)

            if value_step is not None:
                # The K loop makes only the scores; a second loop over value columns then makes
                # q·h and the score·v dots, its h and v tiles pipelined like the K loop's.
                scores = [weigh(score) for score in key_loop(None, k_refs)]

                q = load_rows(q_ref.at[chunk_rows])                 # [BT, K], L2-resident by now

                def value_step_body(j, carry):
                    value_cols = pl.ds(j * value_step, value_step)
                    finish(state_term(q, value_cols), scores, value_cols)
                    return carry
                jax.lax.fori_loop(0, block_v * value_blocks_per_program // value_step,
                                  value_step_body, None)
                return carry

            # One loop for the state term of value tile 0 and every copy's scores; further value
            # tiles run a state-only loop each and reuse the scores.
            value_cols = pl.ds(0, block_v)
            values = ([load_value(v_ref, value_cols) for v_ref in v_refs] if prefetch_values
                      else None)
            o_state, *scores = key_loop(value_cols, k_refs)
            scores = [weigh(score) for score in scores]
            finish(weigh_rows(o_state), scores, value_cols, values)
            for j in range(1, value_blocks_per_program):
                value_cols = pl.ds(j * block_v, block_v)
                (o_state,) = key_loop(value_cols, [])
                finish(weigh_rows(o_state), scores, value_cols)
            return carry

        if copy_order == "fused" and value_blocks_per_program == 1:
            value_cols = pl.ds(0, block_v)
            o = state_term(q, value_cols)
            for k_ref, v_ref in zip(k_refs, v_refs):                # one score live at a time
                o += plgpu.dot(copy_score(k_ref), load_rows(v_ref.at[chunk_rows, value_cols]))
            store(o, value_cols)
            return carry

        # Every copy's scores once, reused for every value tile.
        scores = [copy_score(k_ref) for k_ref in k_refs]
        for j in range(value_blocks_per_program):
            value_cols = pl.ds(j * block_v, block_v)
            finish(state_term(q, value_cols), scores, value_cols)
        return carry

    if chunks_per_program == 1:
        one_chunk(0, None)
    else:
        # The last program may own fewer chunks; a dynamic trip count keeps h reads in bounds.
        trip_count = _index(jnp.minimum(chunks_per_program, num_chunks - first_chunk))
        jax.lax.fori_loop(0, trip_count, one_chunk, None)


def chunk_o_pallas(q, k, v, h, g, runs, *, scale: float, chunk_size: int, num_householder: int,
                   interpret: bool = False, config: KernelConfig | None = None) -> jax.Array:
    """o [B, T, H, V] from validated inputs; K and V must be powers of two >= 16.

    q [B, T, H, K]; k [B, T*M, H, K]; v [B, T*M, H, V] (same dtype as q and k); h [B, NT, H, K, V];
    g [B, T, H] float32 or None; runs [B, T] int32 segment run numbers or None.
    """
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    m = num_householder
    num_chunks = h.shape[1]
    cfg = config or kernel_config(key_dim, value_dim, chunk_size, m,
                                  max(jnp.dtype(q.dtype).itemsize, jnp.dtype(h.dtype).itemsize))
    cpp, block_t = cfg.chunks_per_program, cfg.chunks_per_program * chunk_size
    block_v = cfg.block_v * cfg.value_blocks_per_program           # value columns of one program
    # Grid axes, first varying fastest in launch order: value splits, then chunks or heads.
    if cfg.heads_fastest:
        grid = (value_dim // block_v, heads, pl.cdiv(num_chunks, cpp), batch)
        tile_ids = lambda vb, hd, c, b: (vb, c, b, hd)
    else:
        grid = (value_dim // block_v, pl.cdiv(num_chunks, cpp), heads, batch)
        tile_ids = lambda vb, c, hd, b: (vb, c, b, hd)
    chunk_axis = 2 if cfg.heads_fastest else 1

    def token_spec(block_width, copy=0, blocked_width=True):
        # A [cpp*BT, block_width] tile of a [B, T, M*H, width] array: copy `copy` of head h is
        # "head" copy*H + h. Only value-width operands are split into value blocks.
        def index_map(*pids):
            vb, c, b, hd = tile_ids(*pids)
            return b, c, copy * heads + hd, vb if blocked_width else 0
        return pl.BlockSpec((None, block_t, None, block_width), index_map)

    def spec(block_shape, index_map):
        return pl.BlockSpec(block_shape, lambda *pids: index_map(*tile_ids(*pids)))

    k_copies = k.reshape(batch, tokens, m * heads, key_dim)
    v_copies = v.reshape(batch, tokens, m * heads, value_dim)
    operands = [q] + [k_copies] * m + [v_copies] * m + [h]
    in_specs = ([token_spec(key_dim, blocked_width=False)]
                + [token_spec(key_dim, i, blocked_width=False) for i in range(m)]
                + [token_spec(block_v, i) for i in range(m)]
                + [spec((None, cpp, None, key_dim, block_v), lambda vb, c, b, hd: (b, c, hd, 0, vb))])
    if g is not None:
        operands.append(g)
        in_specs.append(spec((None, block_t, None), lambda vb, c, b, hd: (b, c, hd)))
    if runs is not None:
        operands.append(segment_start_rows(runs, chunk_size))
        in_specs.append(spec((None, block_t), lambda vb, c, b, hd: (b, c)))

    kernel = functools.partial(
        _chunk_o_kernel, num_householder=m, scale=scale, chunk_size=chunk_size, tokens=tokens,
        num_chunks=num_chunks, chunks_per_program=cpp, block_v=cfg.block_v,
        value_blocks_per_program=cfg.value_blocks_per_program, chunk_axis=chunk_axis,
        has_g=g is not None, has_segments=runs is not None, copy_order=cfg.copy_order,
        block_k=cfg.block_k, value_step=cfg.value_step, prefetch_values=cfg.prefetch_values)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, tokens, heads, value_dim), v.dtype),
        grid=grid,
        in_specs=in_specs,
        out_specs=token_spec(block_v),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="gdp_chunk_o_fwd",
    )
    with triton_backend_warning_filtered():
        return call(*operands)
