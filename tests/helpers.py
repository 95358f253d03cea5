"""Shared test inputs: random problems pushed through the float64 recurrence (SPEC's identity)."""
from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp

from gdp_jax import reference


def random_segment_ids(rng, batch, tokens, chunk_size, kind="several"):
    """[B, T] int32 ids with several segments per row, packed differently in each row.

    "several" always includes a segment starting exactly on a chunk boundary and one of length 1.
    """
    rows = []
    for b in range(batch):
        starts = {0}
        if kind == "several":
            if tokens > chunk_size:
                starts.add(chunk_size)                      # starts exactly on a chunk boundary
            single = int(rng.integers(1, tokens - 1)) if tokens > 2 else None
            if single is not None:
                starts.update({single, single + 1})         # a segment of length 1
            starts.update(int(x) for x in rng.integers(1, tokens, size=2 + b))
        boundaries = np.zeros(tokens, np.int32)
        boundaries[sorted(s for s in starts if s < tokens)] = 1
        ids = np.cumsum(boundaries) - 1
        # Repeat an id non-adjacently: ids only define runs, not identity across runs.
        rows.append(np.where(ids % 3 == 2, 0, ids) if b % 2 else ids)
    return np.stack(rows).astype(np.int32)


def make_problem(seed, *, batch=2, tokens=77, heads=2, key_dim=32, value_dim=16, m=2, chunk_size=16,
                 gated=True, segments=True, dtype=np.float32, initial_state=True, segment_ids=None):
    """Random q, k, v, beta, g_raw (+ ids) and the float64 recurrence over them.

    ``segment_ids`` ([B, T] ints) replaces the random packing that ``segments=True`` would draw.
    Returns dict with chunk_o inputs (q, k, v_new, h, g in ``dtype``/float32) and ``o_ref`` float64.
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, tokens, heads, key_dim))
    k = rng.normal(size=(batch, tokens * m, heads, key_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(batch, tokens * m, heads, value_dim))
    beta = rng.uniform(0.05, 1.95, size=(batch, tokens * m, heads))
    g_raw = -rng.uniform(0.0, 0.25, size=(batch, tokens, heads)) if gated else None
    state0 = 0.5 * rng.normal(size=(batch, heads, key_dim, value_dim)) if initial_state else None
    if segment_ids is not None:
        seg = np.asarray(segment_ids, np.int32)
    else:
        seg = random_segment_ids(rng, batch, tokens, chunk_size) if segments else None
    # Round inputs to the test dtype first, so the reference sees exactly what the op sees.
    cast = lambda x: None if x is None else np.asarray(jnp.asarray(x, dtype), np.float64)
    q, k, v = cast(q), cast(k), cast(v)
    ref = reference.recurrence(q, k, v, g_raw, beta, initial_state=state0, segment_ids=seg,
                               chunk_size=chunk_size, dtype=jnp.float64)
    return dict(
        q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype),
        v=jnp.asarray(np.asarray(ref.v_new), dtype), h=jnp.asarray(np.asarray(ref.h), dtype),
        g=jnp.asarray(np.asarray(ref.g), jnp.float32) if gated else None,
        segment_ids=None if seg is None else jnp.asarray(seg),
        o_ref=np.asarray(ref.o), m=m, chunk_size=chunk_size)


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def segment_run_numbers(segment_ids, batch, tokens):
    """[B, T] run numbers in numpy (a new run wherever the id changes); zeros without ids."""
    if segment_ids is None:
        return np.zeros((batch, tokens), np.int64)
    ids = np.asarray(segment_ids)
    changes = np.concatenate([np.zeros((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    return np.cumsum(changes, axis=1)


def dense_chunked_form(q, k, v, h, g, segment_ids, *, scale, chunk_size):
    """SPEC's chunked form with one [T, T*M] weight matrix per row and head, no chunk reshapes.

    Weight of key position j (token s = j // M) for query t: nonzero iff s and t share a global
    chunk id, s <= t and s, t are in one segment; then 2^(g[t] - g[s]). The state term of t uses
    h[t // chunk_size], weighted by 2^g[t] iff t is in the segment live at its chunk's first token.
    """
    batch, tokens, heads, _ = q.shape
    m = k.shape[1] // tokens
    token = np.arange(tokens)
    source = np.arange(tokens * m) // m                              # token of each key position
    chunk_of = token // chunk_size
    run = segment_run_numbers(segment_ids, batch, tokens)
    mask = ((chunk_of[:, None] == chunk_of[source][None, :]) & (source[None, :] <= token[:, None]))
    mask = mask[None] & (run[:, :, None] == run[:, source][:, None, :])        # [B, T, T*M]
    live = run == run[:, chunk_of * chunk_size]                                  # [B, T]
    mask, live = jnp.asarray(mask)[:, None], jnp.asarray(live)                   # mask [B, 1, T, T*M]

    gt = jnp.zeros((batch, heads, tokens), q.dtype) if g is None else jnp.moveaxis(g, 1, 2)
    exponent = jnp.where(mask, gt[..., :, None] - gt[..., source][..., None, :], 0.0)
    weight = jnp.where(mask, jnp.exp2(exponent), 0.0)                           # [B, H, T, T*M]
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bthk,bjhk->bhtj", q, k, precision=hi)
    intra = jnp.einsum("bhtj,bjhv->bthv", scores * weight, v, precision=hi)
    state = jnp.einsum("bthk,bthkv->bthv", q, h[:, chunk_of], precision=hi)
    state_weight = live[:, :, None] * jnp.exp2(jnp.moveaxis(gt, 1, 2))          # [B, T, H]
    return scale * (intra + state_weight[..., None] * state)
