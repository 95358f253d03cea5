"""Check: dg_t = sum_{s >= t, same segment} (q_s.dq_s - sum_m v_{s,m}.dv_{s,m}) + [last segment] <S_T, dfinal>."""
import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from gdp_jax import reference

def problem(B=2, T=300, H=2, K=16, V=24, M=2, seed=0, gate_lo=-0.5, nseg=4, init=True):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, H, K)); k = r.normal(size=(B, T*M, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.normal(size=(B, T*M, H, V)); beta = r.uniform(0, 2, size=(B, T*M, H))
    g = r.uniform(gate_lo, 0, size=(B, T, H))
    seg = np.sort(r.integers(0, nseg, size=(B, T)), axis=1)
    h0 = r.normal(size=(B, H, K, V)) if init else None
    return q, k, v, g, beta, h0, seg

def gradients(**kw):
    """The problem, float64 dq, dv, dg of sum(o do) + sum(final dfinal), the final-state term
    <S_T, dfinal> [B, H], per-token terms q.dq - sum_m v.dv as a function, and the noise source."""
    q, k, v, g, beta, h0, seg = problem(**kw)
    r = np.random.default_rng(1)
    out = reference.recurrence(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
    do = r.normal(size=out.o.shape); dfinal = r.normal(size=out.final_state.shape)
    def loss(q, v, g):
        o = reference.recurrence(q, k, v, g, beta, initial_state=h0, segment_ids=seg)
        return jnp.sum(o.o * do) + jnp.sum(o.final_state * dfinal)
    dq, dv, dg = [np.asarray(x) for x in jax.grad(loss, argnums=(0, 1, 2))(q, v, g)]
    B, T, H, K = q.shape; M = v.shape[1] // T
    term = lambda dq, dv: np.sum(q * dq, -1) - np.sum((v * dv).reshape(B, T, M, H, -1), axis=(2, 4))
    fin = np.sum(np.asarray(out.final_state) * dfinal, axis=(2, 3))
    noisy = lambda x: x * (1 + 4e-3 * r.standard_normal(x.shape))   # bf16-like, relative 4e-3
    return seg, dq, dv, dg, fin, term, noisy

def suffix_sums(term, seg, fin):
    """Per segment, sums from each token to the segment's end; the row's last segment adds fin."""
    B, T, H = term.shape
    ident = np.zeros_like(term)
    for b in range(B):
        acc = fin[b].copy()
        for t in range(T - 1, -1, -1):
            if t < T - 1 and seg[b, t + 1] != seg[b, t]:
                acc = np.zeros(H)
            acc = acc + term[b, t]
            ident[b, t] = acc
    return ident

rel = lambda x, ref: np.linalg.norm(x - ref) / np.linalg.norm(ref)

def check(**kw):
    seg, dq, dv, dg, fin, term, noisy = gradients(**kw)
    exact = rel(suffix_sums(term(dq, dv), seg, fin), dg)
    with_noise = rel(suffix_sums(term(noisy(dq), noisy(dv)), seg, fin), dg)
    print(kw, f"identity rel err {exact:.2e}; with 4e-3 noise on dq, dv: {with_noise:.2e}; |dg| {np.linalg.norm(dg):.3g}")

check()
check(init=False, nseg=1)
check(M=3, gate_lo=-5.0)
check(M=1, gate_lo=-0.01, T=1000, nseg=1)

def check_local(C=64, **kw):
    """Chunk-local form: suffix sums inside each C-token chunk, plus <S_end, dS_end> (exact here,
    taken as dg of the chunk's last token minus its own term) for the segment reaching the chunk end."""
    seg, dq, dv, dg, fin, term, noisy = gradients(**kw)
    exact = term(dq, dv)
    tn = term(noisy(dq), noisy(dv))
    B, T, H = exact.shape
    ident = np.zeros_like(exact)
    for b in range(B):
        for t in range(T - 1, -1, -1):
            end_of_chunk = (t % C == C - 1) or t == T - 1
            seg_ends = t == T - 1 or seg[b, t + 1] != seg[b, t]
            if end_of_chunk:   # the boundary term: exact dg of this token minus its own term
                acc = (dg[b, t] - exact[b, t]) if not seg_ends or t == T - 1 else np.zeros(H)
            elif seg_ends:
                acc = np.zeros(H)
            acc = acc + tn[b, t]; ident[b, t] = acc
    print("local", C, kw, f"with 4e-3 noise on dq, dv: {rel(ident, dg):.2e}")

check_local()
check_local(M=3, gate_lo=-5.0)
check_local(C=16)
