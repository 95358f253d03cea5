"""State tracking with Gated DeltaProduct: permutation word problems over M and negative eigenvalues.

    python examples/state_tracking.py --preset cpu --out /tmp/st        # S3 mini-grid on a CPU
    python examples/state_tracking.py --preset gpu --out DIR --budget-s 380   # the H200 grid
    python examples/state_tracking.py --group S3 --layers 1 --num-householder 2 --neg on --steps 300
    python examples/state_tracking.py --help

Task (``word_problems.py``): a row is BOS g_1 ... g_T with g_t uniform on a permutation group G;
the target at position t is the running product p_t = g_t ∘ p_{t-1} (p_0 = identity), one of |G|
classes. Training uses rows of length ``--train-length`` with the loss at every position (so every
length up to it); evaluation measures the per-position accuracy on rows ``--eval-factor`` (8) times
longer, once with the chunked forward and once by decoding token by token (``GatedDeltaProduct.step``),
and checks that both predict the same.

Why (DeltaProduct, Siems et al. 2025): on one-hot states a transposition (i j) is the Householder
reflection I - 2 k k^T with k = (e_i - e_j)/sqrt(2), beta = 2, and every element of S_n is a product
of at most n - 1 transpositions, so one layer with M = n - 1 Householder steps per token and beta in
(0, 2) (``allow_neg_eigval``) can apply any element of S_n in one token. With beta in (0, 1) every
step contracts, and no product of them is a non-trivial isometry: such a layer cannot track any
group over long rows. ``prediction`` spells out what the algebra predicts for each configuration.

Model: embedding (|G| element tokens + BOS), ``layers`` pre-norm blocks
(RMSNorm -> GatedDeltaProduct -> residual, RMSNorm -> MLP -> residual), final RMSNorm, a linear
head over the classes. The layer runs without forget gate and short convolutions by default
(``--forget-gate`` / ``--short-conv`` turn them on; the JSON records the layer's other defaults):
then token t's state transition depends on g_t alone, the setting the algebra is about. BOS lets
the first token write the initial state (from the zero state no reflection changes anything).
Trained with optax adamw under jax.jit, a ``lax.scan`` over ``--steps-per-call`` steps per call,
seeds batched with ``jax.vmap``.

Outputs under --out: state_tracking.json (every run: config, loss curves, per-position accuracy
per seed, decode agreement, times, the prediction), state_tracking.png (accuracy against position
per configuration) and state_tracking.md (a summary table with a sentence per row). All three are
rewritten after every configuration, so a run stopped by --budget-s (or killed) keeps its results.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import platform
import sys
import time
import traceback
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # word_problems, beside us
import word_problems as wp  # noqa: E402

from gdp_jax.nn import GatedDeltaProduct  # noqa: E402

# ------------------------------------------------------------------------------------------ model


class Block(nnx.Module):
    """Pre-norm block: x + GDP(RMSNorm(x)), then x + MLP(RMSNorm(x)). x: [B, T, D] (or [B, D] in
    ``step``)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, mlp_ratio: int = 4, **layer_kwargs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.mixer = GatedDeltaProduct(dim, rngs=rngs, **layer_kwargs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, mlp_ratio * dim, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * dim, dim, rngs=rngs)

    def _mlp(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x):
        return self._mlp(x + self.mixer(self.norm1(x)))

    def step(self, x_t, cache):
        y_t, cache = self.mixer.step(self.norm1(x_t), cache)
        return self._mlp(x_t + y_t), cache


class StateTracker(nnx.Module):
    """tokens [B, T] int (element indices, BOS = ``bos``) -> logits [B, T, num_classes] float32.

    ``layer_kwargs`` go to every GatedDeltaProduct (num_heads, head_dim, num_householder,
    allow_neg_eigval, use_forget_gate, use_short_conv, chunk_size, implementation)."""

    def __init__(self, num_classes: int, *, dim: int, layers: int, rngs: nnx.Rngs,
                 **layer_kwargs):
        self.num_classes, self.bos = num_classes, num_classes
        self.embed = nnx.Embed(num_classes + 1, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, rngs=rngs, **layer_kwargs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)

    def init_cache(self, batch: int):
        return [block.mixer.init_cache(batch) for block in self.blocks]

    def step(self, token_t, caches):
        """token_t [B] int, caches (one GDPCache per block) -> (logits [B, C], new caches)."""
        x = self.embed(token_t)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.step(x, cache)
            new.append(cache)
        return self.head(self.norm(x)).astype(jnp.float32), new


# ----------------------------------------------------------------------------------------- config


@dataclasses.dataclass
class Config:
    """One grid cell (``group``, ``layers``, ``num_householder``, ``allow_neg_eigval``) and the
    sizes shared by the whole grid. ``num_classes`` pads every group's classes to one width so
    groups of one grid share compiled functions (the classes a group lacks are masked out)."""
    group: str = "S3"
    layers: int = 1
    num_householder: int = 2
    allow_neg_eigval: bool = True
    dim: int = 32
    heads: int = 2
    head_dim: int = 16
    use_forget_gate: bool = False
    use_short_conv: bool = False
    chunk_size: int = 16
    implementation: Optional[str] = None
    train_length: int = 16
    eval_factor: int = 8
    steps: int = 300
    steps_per_call: int = 50
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    eval_batch: int = 256
    decode_batch: int = 32
    num_classes: int = 0           # 0: the group's order

    @property
    def eval_length(self) -> int:
        return self.train_length * self.eval_factor

    def name(self) -> str:
        return (f"{self.group} L={self.layers} M={self.num_householder} "
                f"neg={'on' if self.allow_neg_eigval else 'off'}")


def layer_kwargs(cfg: Config) -> dict:
    return dict(num_heads=cfg.heads, head_dim=cfg.head_dim, num_householder=cfg.num_householder,
                allow_neg_eigval=cfg.allow_neg_eigval, use_forget_gate=cfg.use_forget_gate,
                use_short_conv=cfg.use_short_conv, chunk_size=cfg.chunk_size,
                implementation=cfg.implementation,
                # Without short convolutions, linear q, k, v projections (no SiLU): a key must be
                # free to point anywhere, e.g. (e_i - e_j) / sqrt(2) for a transposition.
                no_conv_activation=None)


# ----------------------------------------------------------------------------- the algebra's call

# The fewest Householder steps per token with which ONE layer can apply every element of G (beta
# in (0, 2)): the largest, over elements, of the fewest reflections whose product is the element
# in an orthogonal representation, minimised over faithful representations.
#   Z2: the swap is one reflection.
#   S3 = D3: rotations of the triangle are two reflections, flips one (the 2-d representation).
#   S4, A4, A5: rotation groups of the cube, tetrahedron, icosahedron in SO(3); every rotation
#     of R^3 is a product of two reflections (the paper's remark on S4 and A5).
#   S5: in every faithful representation a 5-cycle has a fixed space of codimension 4 (its
#     eigenvalues include all four primitive 5th roots of unity), so 4 (= n - 1) are needed.
ONE_LAYER_M = {"Z2": 1, "S3": 2, "S4": 2, "A4": 2, "A5": 2, "S5": 4}


def prediction(group: str, layers: int, num_householder: int, allow_neg_eigval: bool) -> dict:
    """What the algebra says about a configuration: {"solvable": True / False / None (open),
    "ceiling": accuracy at long lengths if it is not (None when open or solvable), "why": str}.

    Asymptotically, for rows much longer than training (finite precision, exact tracking)."""
    order = wp.get_group(group).order
    need = ONE_LAYER_M.get(group)
    if not allow_neg_eigval:
        return dict(solvable=False, ceiling=1.0 / order,
                    why="beta in (0, 1): every step contracts along its key, so no product of "
                        "steps is a non-trivial isometry; not even the parity of the running "
                        "product is trackable over long rows (Grazzi et al. 2025, any number "
                        "of layers): chance, 1/|G|")
    if need is not None and num_householder >= need:
        return dict(solvable=True, ceiling=None,
                    why=f"M >= {need}: one layer can apply every element of {group} as a "
                        f"product of M reflections (beta -> 2)" +
                        (" (the second layer is not needed)" if layers > 1 else ""))
    if layers == 1:
        # What one layer tracks with fewer steps than ``need``: each head's state carries a
        # representation of G (on the orbit of its states) in which every element is a product of
        # M reflections. With M = 1 every element acts as an involution, so the image is abelian
        # of exponent 2: S_n -> its sign, A4 and A5 -> nothing. S5 with M = 2, 3: no faithful
        # representation (5-cycles need 4), and a non-faithful one kills A5: the sign again.
        ceiling = {"S3": 2, "S4": 2, "S5": 2, "A4": 1, "A5": 1}.get(group)
        if ceiling == 2:
            because = ("every element then acts as an involution" if num_householder == 1 else
                       "S5's 5-cycles need 4 in every faithful representation, and the kernel "
                       "of any other contains A5")
            return dict(solvable=False, ceiling=2.0 / order,
                        why=f"M = {num_householder} < {need} reflections per token: {because}, so "
                            f"each head tracks at most the sign (parity) of the running "
                            f"product: 2/|G|")
        if ceiling == 1:
            return dict(solvable=False, ceiling=1.0 / order,
                        why=f"{group} has no non-trivial quotient that {num_householder} "
                            f"reflection(s) per token can apply: chance")
        return dict(solvable=None, ceiling=None, why="not worked out for this group")
    if group == "S3":
        return dict(solvable=True, ceiling=None,
                    why="two layers, M = 1: S3 is the dihedral group D3 acting on the plane; "
                        "layer 1 tracks the sign b_t of the running product and the position "
                        "parity, and layer 2 keeps F^(t + b_t) p_t (F a fixed flip), whose "
                        "per-token update is always ONE reflection of the plane")
    return dict(solvable=None, ceiling=None,
                why=f"{layers} layers with M = {num_householder} < {need}: the one-layer "
                    f"argument does not apply and we know no construction; empirical")


# --------------------------------------------------------------------------------------- training


def _split_params(model):
    graphdef, state = nnx.split(model)
    return graphdef, state


def build(cfg: Config):
    """The jitted functions of one configuration (shared by every group of one padded width;
    ``table`` [C, C] and ``order`` |G| are arguments, C = cfg.num_classes).

    init(seeds) -> (params, opt_state), stacked over seeds (S of them);
    train_v(params, opt_state, keys [S], table, order) -> (params, opt_state, losses [S, n],
      accs [S, n]): n = steps_per_call adamw steps on fresh rows, a lax.scan;
    eval_v(params, tokens [B, T+1], targets [B, T], order) -> (per-position accuracy [S, T],
      predictions [S, B, T]), the chunked forward;
    decode_v(params, tokens, order) -> predictions [S, B, T], token by token with ``step``;
    train_s / eval_s / decode_s: the same for one seed (the fallback where vmap fails);
    sample(key, table, order, batch, length) -> (tokens with BOS, targets);
    betas(params) -> [S, C + 1, M*H] the first layer's step size per token."""
    num_classes = cfg.num_classes
    kwargs = layer_kwargs(cfg)

    def make(seed):
        return StateTracker(num_classes, dim=cfg.dim, layers=cfg.layers, rngs=nnx.Rngs(seed),
                            **kwargs)

    graphdef, _ = _split_params(make(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.warmup),
                                                  max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay))

    def logits_of(params, tokens, order):
        model = nnx.merge(graphdef, params)
        logits = model(tokens)[:, 1:]                        # drop the BOS position
        valid = jnp.arange(num_classes) < order
        return jnp.where(valid, logits, -1e9)

    def loss_fn(params, tokens, targets, order):
        logits = logits_of(params, tokens, order)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == targets)

    def with_bos(elements):
        bos = jnp.full((elements.shape[0], 1), num_classes, jnp.int32)
        return jnp.concatenate([bos, elements], axis=1)

    def sample(key, table, order, batch, length):
        elements = jax.random.randint(key, (batch, length), 0, order, dtype=jnp.int32)

        def step(prev, g):
            new = table[g, prev]
            return new, new

        _, targets = jax.lax.scan(step, jnp.zeros((batch,), jnp.int32), elements.T)
        return with_bos(elements), targets.T

    def train_one(params, opt_state, key, table, order):
        def body(carry, key):
            params, opt_state = carry
            tokens, targets = sample(key, table, order, cfg.batch, cfg.train_length)
            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, tokens, targets, order)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (loss, acc)

        keys = jax.random.split(key, cfg.steps_per_call)
        (params, opt_state), (losses, accs) = jax.lax.scan(body, (params, opt_state), keys)
        return params, opt_state, losses, accs

    def eval_one(params, tokens, targets, order):
        pred = jnp.argmax(logits_of(params, tokens, order), -1)
        return jnp.mean(pred == targets, axis=0), pred

    def decode_one(params, tokens, order):
        model = nnx.merge(graphdef, params)
        caches = model.init_cache(tokens.shape[0])

        def body(caches, token_t):
            logits, caches = model.step(token_t, caches)
            return caches, logits

        _, logits = jax.lax.scan(body, caches, tokens.T)      # [T, B, C]
        logits = jnp.where(jnp.arange(num_classes) < order, logits, -1e9)
        return jnp.argmax(logits, -1).T[:, 1:]

    def betas_one(params):
        """First layer's step sizes per token (it reads the token alone when there is no short
        convolution): [num_classes + 1, M * H], BOS last."""
        model = nnx.merge(graphdef, params)
        block = model.blocks[0]
        x = block.norm1(model.embed(jnp.arange(num_classes + 1)))
        return block.mixer._beta(x)

    def init(seeds: Sequence[int]):
        states = [_split_params(make(int(s)))[1] for s in seeds]
        params = jax.tree.map(lambda *x: jnp.stack(x), *states)
        opt_state = jax.vmap(tx.init)(params)
        return params, opt_state

    train_v = jax.jit(jax.vmap(train_one, in_axes=(0, 0, 0, None, None)), donate_argnums=(0, 1))
    eval_v = jax.jit(jax.vmap(eval_one, in_axes=(0, None, None, None)))
    decode_v = jax.jit(jax.vmap(decode_one, in_axes=(0, None, None)))
    # The same, one seed at a time (used where vmap over seeds fails to compile).
    train_s, eval_s, decode_s = jax.jit(train_one), jax.jit(eval_one), jax.jit(decode_one)
    return dict(init=init, train_v=train_v, eval_v=eval_v, decode_v=decode_v, train_s=train_s,
                eval_s=eval_s, decode_s=decode_s, sample=jax.jit(sample, static_argnums=(3, 4)),
                betas=jax.jit(jax.vmap(betas_one)))


_BUILD_CACHE: Dict[tuple, dict] = {}


def get_build(cfg: Config) -> dict:
    """build(cfg), cached on everything but the group (same shapes, same compiled functions)."""
    key = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "group")
    if key not in _BUILD_CACHE:
        _BUILD_CACHE[key] = build(cfg)
    return _BUILD_CACHE[key]


def _stack_seeds(fn, params, *args):
    """fn (single-seed) applied per seed, outputs stacked: the fallback to vmap."""
    outs = []
    for i in range(jax.tree.leaves(params)[0].shape[0]):
        outs.append(fn(jax.tree.map(lambda x: x[i], params), *args))
    return jax.tree.map(lambda *x: jnp.stack(x), *outs)


def run_config(cfg: Config, seeds: Sequence[int], *, log=print, vmap_seeds: bool = True,
               eval_seed: int = 12345) -> dict:
    """Trains one configuration for every seed and evaluates it; returns the run record."""
    group = wp.get_group(cfg.group)
    if cfg.num_classes == 0:
        cfg = dataclasses.replace(cfg, num_classes=group.order)
    if cfg.num_classes < group.order:
        raise ValueError(f"num_classes={cfg.num_classes} < |{cfg.group}| = {group.order}")
    if cfg.steps % cfg.steps_per_call:
        raise ValueError(f"steps={cfg.steps} must be a multiple of steps_per_call="
                         f"{cfg.steps_per_call}")
    fns = get_build(cfg)
    table = np.zeros((cfg.num_classes, cfg.num_classes), np.int32)
    table[:group.order, :group.order] = group.table
    table, order = jnp.asarray(table), jnp.asarray(group.order, jnp.int32)
    seeds = list(seeds)
    times = {}
    start = time.perf_counter()
    params, opt_state = fns["init"](seeds)
    # Seed s's training rows: fold_in(key(s), call), whichever seeds run beside it.
    seed_keys = [jax.random.key(1_000_003 + s) for s in seeds]
    losses, accs = [], []
    calls = cfg.steps // cfg.steps_per_call
    mode = "vmap" if vmap_seeds else "loop"
    for call in range(calls):
        keys = jnp.stack([jax.random.fold_in(k, call) for k in seed_keys])
        t0 = time.perf_counter()
        if mode == "vmap":
            try:
                params, opt_state, loss, acc = fns["train_v"](params, opt_state, keys, table, order)
            except Exception as exc:   # noqa: BLE001 -- reported, then the loop over seeds
                if call:
                    raise
                log(f"  vmap over seeds failed ({type(exc).__name__}: {str(exc)[:300]}); "
                    f"looping over seeds instead")
                mode = "loop"
                params, opt_state = fns["init"](seeds)
        if mode == "loop":
            outs = [fns["train_s"](jax.tree.map(lambda x: x[i], params),
                                   jax.tree.map(lambda x: x[i], opt_state), keys[i], table, order)
                    for i in range(len(seeds))]
            params, opt_state, loss, acc = jax.tree.map(lambda *x: jnp.stack(x), *outs)
        loss, acc = np.asarray(loss), np.asarray(acc)            # [S, steps_per_call]
        if not np.all(np.isfinite(loss)):
            raise FloatingPointError(f"{cfg.name()}: non-finite loss at call {call}")
        losses.append(loss)
        accs.append(acc)
        if call == 0:
            times["first_call_s"] = time.perf_counter() - t0     # compile + steps_per_call steps
        done = (call + 1) * cfg.steps_per_call
        if call == 0 or call == calls - 1 or (call + 1) % max(1, calls // 4) == 0:
            log(f"  step {done:5d}/{cfg.steps}  loss {np.mean(loss[:, -10:]):.4f}  "
                f"train acc {np.mean(acc[:, -10:]):.3f}  (per seed "
                + " ".join(f"{a:.2f}" for a in acc[:, -10:].mean(1)) + ")")
    times["train_s"] = time.perf_counter() - start
    losses, accs = np.concatenate(losses, 1), np.concatenate(accs, 1)

    # Evaluation: the chunked forward on rows eval_factor x longer, then decoding a few of them.
    t0 = time.perf_counter()
    tokens, targets = fns["sample"](jax.random.key(eval_seed), table, order, cfg.eval_batch,
                                    cfg.eval_length)
    if mode == "vmap":
        per_pos, pred = fns["eval_v"](params, tokens, targets, order)
    else:
        per_pos, pred = _stack_seeds(fns["eval_s"], params, tokens, targets, order)
    per_pos = np.asarray(per_pos)                                # [S, T_eval]
    times["eval_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    nd = min(cfg.decode_batch, cfg.eval_batch)
    if mode == "vmap":
        dec = fns["decode_v"](params, tokens[:nd], order)
    else:
        dec = _stack_seeds(fns["decode_s"], params, tokens[:nd], order)
    dec = np.asarray(dec)
    agree = np.mean(dec == np.asarray(pred)[:, :nd], axis=(1, 2))
    dec_acc = np.mean(dec == np.asarray(targets)[None, :nd], axis=(1, 2))
    times["decode_s"] = time.perf_counter() - t0
    betas = None
    if not cfg.use_short_conv:
        try:      # the layer's private _beta: skipped, not fatal, should the layer change
            b = np.asarray(fns["betas"](params))[:, :group.order]   # [S, |G|, M*H]
            betas = dict(max=np.round(b.max(axis=(1, 2)), 4).tolist(),
                         frac_above_1=np.round((b > 1).mean(axis=(1, 2)), 4).tolist(),
                         frac_above_1_9=np.round((b > 1.9).mean(axis=(1, 2)), 4).tolist(),
                         per_element=np.round(b, 3).tolist())
        except Exception as exc:   # noqa: BLE001
            log(f"  (no betas: {type(exc).__name__}: {exc})")
    return dict(config=dataclasses.asdict(cfg), seeds=seeds, status="ok", seed_mode=mode,
                order=group.order, loss=_curve(losses), train_acc=_curve(accs),
                per_position_acc=np.round(per_pos, 4).tolist(),
                decode=dict(rows=nd, agree=np.round(agree, 5).tolist(),
                            acc=np.round(dec_acc, 4).tolist()),
                betas_layer1=betas,
                summary=summarize(per_pos, cfg.train_length, group.order),
                prediction=prediction(cfg.group, cfg.layers, cfg.num_householder,
                                      cfg.allow_neg_eigval),
                times={k: round(v, 2) for k, v in times.items()})


def _curve(x: np.ndarray, points: int = 100) -> dict:
    """[S, steps] -> means over windows of steps (a short curve per seed)."""
    steps = x.shape[1]
    width = max(1, steps // points)
    n = steps // width
    windows = x[:, :n * width].reshape(x.shape[0], n, width).mean(-1)
    return dict(every=width, values=np.round(windows, 4).tolist())


def summarize(per_pos: np.ndarray, train_length: int, order: int) -> dict:
    """Per-seed accuracies on position ranges: 1..L (trained), L+1..2L, the last quarter (6L..8L]."""
    length = per_pos.shape[1]
    ranges = {"train": (0, train_length), "2x": (train_length, min(length, 2 * train_length)),
              "last_quarter": (length - length // 4, length)}
    out = {k: np.round(per_pos[:, a:b].mean(1), 4).tolist() for k, (a, b) in ranges.items() if b > a}
    out["chance"] = round(1.0 / order, 4)
    return out


# ------------------------------------------------------------------------------------------- grid

PRESETS = {
    # tests/test_state_tracking.py's size: S3, rows of 8, a one-layer M=2 model of width 16.
    "ci": dict(groups=["S3"], layers=[1], num_householder=[2], neg=[True], seeds=[0],
               dim=16, heads=1, head_dim=8, train_length=8, eval_factor=2, steps=40,
               steps_per_call=20, batch=32, lr=1e-2, warmup=5, eval_batch=64, decode_batch=8,
               chunk_size=16),
    # A CPU mini-grid (S3 only): 1-2 layers, M = 1..4, neg on/off, 2 seeds, rows of 8 (eval 64).
    "cpu": dict(groups=["S3"], layers=[1, 2], num_householder=[1, 2, 3, 4], neg=[True, False],
                seeds=[0, 1], dim=32, heads=4, head_dim=8, train_length=8, eval_factor=8,
                steps=1500, steps_per_call=100, batch=64, lr=1e-2, warmup=50, eval_batch=256,
                decode_batch=16, chunk_size=16),
    # The H200 grid: S3 and S5, 1-2 layers, M = 1..4, neg on/off, 3 seeds (vmapped), rows of 16
    # (eval 128). On CPU, one S3 M=2 cell of this size (batch 64) fit every position <= 16 by
    # step 400 for both seeds tried.
    "gpu": dict(groups=["S3", "S5"], layers=[1, 2], num_householder=[1, 2, 3, 4],
                neg=[True, False], seeds=[0, 1, 2], dim=64, heads=8, head_dim=8,
                train_length=16, eval_factor=8, steps=1000, steps_per_call=250, batch=256,
                lr=1e-2, warmup=50, eval_batch=512, decode_batch=32, chunk_size=16,
                implementation="pallas"),
}


def grid_configs(groups, layers, num_householder, neg, **sizes) -> List[Config]:
    """The grid, most informative first (what a budget cuts is the end of this list): layers in
    the order given (one layer first), then M, then neg, then groups, so that the groups of one
    (layers, M, neg) run back to back and share compiled functions (classes padded to the
    largest group)."""
    pad = max(wp.get_group(g).order for g in groups)
    return [Config(group=g, layers=nl, num_householder=m, allow_neg_eigval=n, num_classes=pad,
                   **sizes)
            for nl in layers for m in num_householder for n in neg for g in groups]


def run_grid(configs: List[Config], seeds: Sequence[int], out: Optional[pathlib.Path], *,
             budget_s: Optional[float] = None, meta: Optional[dict] = None, log=print,
             vmap_seeds: bool = True, plot: bool = True) -> dict:
    """Runs every configuration (all seeds at once), writing results after each one. With
    budget_s, a configuration that would likely end past the budget (its estimate: the latest
    finished run with the same number of layers, else the slowest so far) is skipped and
    recorded as such; later, cheaper ones may still run."""
    results = dict(meta=dict(meta or {}), runs=[])
    results["meta"].update(started=datetime.datetime.now().isoformat(timespec="seconds"),
                           budget_s=budget_s, seeds=list(seeds))
    start = time.perf_counter()
    cost: Dict[int, float] = {}
    for i, cfg in enumerate(configs):
        elapsed = time.perf_counter() - start
        estimate = cost.get(cfg.layers, max(cost.values(), default=0.0))
        if budget_s is not None and elapsed + estimate > budget_s:
            log(f"[{i + 1}/{len(configs)}] {cfg.name()}: skipped (elapsed {elapsed:.0f} s + "
                f"estimate {estimate:.0f} s > budget {budget_s:.0f} s)")
            results["runs"].append(dict(config=dataclasses.asdict(cfg), seeds=list(seeds),
                                        status="skipped (budget)"))
            if out is not None:
                write_outputs(results, out, plot=plot)
            continue
        log(f"[{i + 1}/{len(configs)}] {cfg.name()}  (elapsed {elapsed:.0f} s)")
        t0 = time.perf_counter()
        try:
            run = run_config(cfg, seeds, log=log, vmap_seeds=vmap_seeds)
        except Exception as exc:   # noqa: BLE001 -- recorded, printed, and the grid exits non-zero
            log(f"  FAILED: {type(exc).__name__}: {exc}")
            log(traceback.format_exc())
            run = dict(config=dataclasses.asdict(cfg), seeds=list(seeds), status="error",
                       error=f"{type(exc).__name__}: {exc}"[:2000])
        took = time.perf_counter() - t0
        run["wall_s"] = round(took, 2)
        cost[cfg.layers] = took
        if run["status"] == "ok":
            s = run["summary"]
            log(f"  done in {took:.1f} s: acc 1..L {np.mean(s['train']):.3f}, last quarter "
                f"{np.mean(s['last_quarter']):.3f} (per seed "
                + " ".join(f"{a:.2f}" for a in s["last_quarter"]) + f", chance {s['chance']}); "
                f"decode agrees {min(run['decode']['agree']):.4f}")
        results["runs"].append(run)
        results["meta"]["elapsed_s"] = round(time.perf_counter() - start, 1)
        if out is not None:
            write_outputs(results, out, plot=plot)
    return results


def write_outputs(results: dict, out: pathlib.Path, *, plot: bool = True):
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "state_tracking.json.tmp"
    tmp.write_text(json.dumps(results, separators=(",", ":")))
    tmp.replace(out / "state_tracking.json")
    (out / "state_tracking.md").write_text(markdown_table(results))
    if plot:
        try:
            import matplotlib
        except ImportError:
            print("matplotlib is missing: no PNG (make it later with --replot "
                  f"{out / 'state_tracking.json'})", flush=True)
            return
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plot_results(results)
        if fig is not None:
            fig.savefig(out / "state_tracking.png", dpi=110, bbox_inches="tight")
            plt.close(fig)


# ---------------------------------------------------------------------------------------- reports


def verdict(run: dict, solved: float = 0.9) -> str:
    """A sentence on whether a finished run agrees with the algebra's prediction."""
    pred, s = run["prediction"], run["summary"]
    last, first = float(np.mean(s["last_quarter"])), float(np.mean(s["train"]))
    per_seed = s["last_quarter"]
    n_solved = sum(a >= solved for a in per_seed)
    chance = s["chance"]
    if pred["solvable"] is True:
        n = len(per_seed)
        fits = sum(t >= 0.99 and a < solved for t, a in zip(s["train"], per_seed))
        rest = n - n_solved - fits
        if n_solved == n:
            return (f"agrees: solvable, and every seed keeps >= {solved} out to 6-8x the "
                    f"training length ({last:.2f}).")
        parts = []
        if fits:
            parts.append(f"{fits} fit every training length (>= 0.99) but drift beyond it "
                         f"(approximate, not exact, group actions)")
        if rest:
            parts.append(f"{rest} did not fit the training lengths in this budget")
        head = (f"agrees in part: solvable, {n_solved}/{n} seeds keep >= {solved} to 6-8x; "
                if n_solved else f"solvable, but no seed keeps >= {solved} to 6-8x ({last:.2f}); ")
        return head + "; ".join(parts) + " (optimisation, not expressivity)."
    if pred["solvable"] is False:
        ceil = pred["ceiling"]
        if last <= max(ceil * 1.5, ceil + 0.1):
            return (f"agrees: not solvable; {first:.2f} within the training lengths (short-range "
                    f"memory), {last:.2f} at 6-8x (the predicted ceiling is {ceil:.3f}, chance "
                    f"{chance}).")
        return (f"DISAGREES: predicted not solvable (ceiling {ceil:.3f}) but reaches {last:.2f} at "
                f"6-8x; check the eval length (is 8x long enough for the decay to show?).")
    return (f"open by our argument: reaches {last:.2f} at 6-8x "
            f"({n_solved}/{len(per_seed)} seeds >= {solved}).")


def markdown_table(results: dict) -> str:
    lines = ["| group | layers | M | neg | acc 1..L | acc L..2L | acc 6L..8L (per seed) | "
             "predicted | max beta, layer 1 | decode = forward | train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for run in results["runs"]:
        c = run["config"]
        head = (f"| {c['group']} | {c['layers']} | {c['num_householder']} | "
                f"{'on' if c['allow_neg_eigval'] else 'off'} |")
        if run["status"] != "ok":
            lines.append(head + f" {run['status']} | | | | | | |")
            continue
        s, p = run["summary"], run["prediction"]
        betas = run.get("betas_layer1")
        beta = "-" if not betas else f"{np.mean(betas['max']):.3f}"
        pred = ("solvable" if p["solvable"] else "open" if p["solvable"] is None
                else f"no (≤ {p['ceiling']:.3f})")
        lines.append(head + f" {np.mean(s['train']):.3f} | {np.mean(s.get('2x', [np.nan])):.3f} | "
                     f"{np.mean(s['last_quarter']):.3f} ("
                     + ", ".join(f"{a:.2f}" for a in s["last_quarter"]) + f") | {pred} | "
                     f"{beta} | {min(run['decode']['agree']):.4f} | "
                     f"{run['times']['train_s']:.0f} |")
        notes.append(f"- {c['group']}, {c['layers']} layer(s), M = {c['num_householder']}, neg "
                     f"{'on' if c['allow_neg_eigval'] else 'off'}: {verdict(run)} "
                     f"Algebra: {p['why']}.")
    meta = results.get("meta", {})
    header = (f"State tracking: per-position accuracy (mean over seeds; 6L..8L also per seed), "
              f"train length L = {meta.get('train_length', '?')}, eval to "
              f"{meta.get('eval_length', '?')}; backend {meta.get('backend', '?')} "
              f"({meta.get('device', '?')}), implementation {meta.get('implementation', '?')}.\n\n")
    return header + "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def plot_results(results: dict, smooth: int = 4):
    """Accuracy against position (= length of the prefix) per configuration: one panel per
    (group, layers), a line per (M, neg) (colour M, solid neg on, dashed off), the mean over seeds
    with its min-max band; chance and sign-only ceilings dotted, the training length dashed."""
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["status"] == "ok"]
    if not runs:
        return None
    panels = sorted({(r["config"]["group"], r["config"]["layers"]) for r in runs},
                    key=lambda p: (wp.get_group(p[0]).order, p[1]))
    groups = sorted({p[0] for p in panels}, key=lambda g: wp.get_group(g).order)
    layer_counts = sorted({p[1] for p in panels})
    fig, axes = plt.subplots(len(groups), len(layer_counts), squeeze=False,
                             figsize=(5.2 * len(layer_counts), 3.6 * len(groups)))
    colours = {1: "C0", 2: "C1", 3: "C2", 4: "C3"}
    for gi, g in enumerate(groups):
        for li, nl in enumerate(layer_counts):
            ax = axes[gi][li]
            order = wp.get_group(g).order
            train_length, lines = None, 0
            for r in runs:
                c = r["config"]
                if (c["group"], c["layers"]) != (g, nl):
                    continue
                acc = np.asarray(r["per_position_acc"])          # [S, T]
                if smooth > 1:
                    kernel = np.ones(smooth) / smooth
                    acc = np.stack([np.convolve(a, kernel, mode="valid") for a in acc])
                x = np.arange(acc.shape[1]) + (smooth + 1) / 2
                m = c["num_householder"]
                style = "-" if c["allow_neg_eigval"] else "--"
                label = f"M={m} neg {'on' if c['allow_neg_eigval'] else 'off'}"
                ax.plot(x, acc.mean(0), style, color=colours.get(m, f"C{m}"), label=label, lw=1.4)
                if acc.shape[0] > 1:
                    ax.fill_between(x, acc.min(0), acc.max(0), color=colours.get(m, f"C{m}"),
                                    alpha=0.12, lw=0)
                train_length, lines = c["train_length"], lines + 1
            ax.axhline(1 / order, color="gray", ls=":", lw=1)
            if g != "Z2":
                ax.axhline(2 / order, color="gray", ls=":", lw=1)
            if train_length:
                ax.axvline(train_length, color="k", ls="--", lw=0.8)
            ax.set(title=f"{g} (|G| = {order}), {nl} layer{'s' if nl > 1 else ''}",
                   xlabel="position t (prefix length)", ylabel="accuracy", ylim=(-0.02, 1.02))
            if not lines:
                ax.text(0.5, 0.5, "no finished runs", ha="center", transform=ax.transAxes)
    fig.suptitle("Word problems: per-position accuracy (mean over seeds, band min-max)\n"
                 "dashed vertical: training length; dotted: chance 1/|G| and sign-only 2/|G|",
                 fontsize=9)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    order = sorted(handles, key=lambda l: (int(l.split()[0][2:]), "off" in l))
    fig.tight_layout(rect=(0, 0.07 if handles else 0, 1, 1))
    if handles:
        fig.legend([handles[l] for l in order], order, loc="lower center", fontsize=8,
                   ncol=min(8, len(order)), frameon=False)
    return fig


# ------------------------------------------------------------------------------------------- main


def _git_describe() -> Optional[str]:
    """HEAD's commit and whether the tree differs from it (None without git)."""
    import subprocess
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except Exception:   # noqa: BLE001 -- no git, not a checkout: not recorded
        return None
    return head + (" (uncommitted changes)" if dirty else "")


def _list(kind):
    def parse(text):
        return [kind(x) for x in text.split(",") if x]
    return parse


def _onoff(text):
    values = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
    return [values[x.lower()] for x in text.split(",") if x]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Presets (every value can be overridden):\n" +
                                     "\n".join(f"  {k}: {v}" for k, v in PRESETS.items()))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--group", dest="groups", type=_list(str), help="e.g. S3,S5 (also Z2, S4, A4, A5)")
    parser.add_argument("--layers", type=_list(int), help="e.g. 1,2")
    parser.add_argument("--num-householder", type=_list(int), help="M values, e.g. 1,2,3,4")
    parser.add_argument("--neg", type=_onoff, help="allow_neg_eigval values: on,off")
    parser.add_argument("--seeds", type=_list(int), help="e.g. 0,1,2 (batched with vmap)")
    for name in ("dim", "heads", "head_dim", "train_length", "eval_factor", "steps",
                 "steps_per_call", "batch", "warmup", "eval_batch", "decode_batch", "chunk_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--implementation", choices=["pallas", "xla", "interpret"],
                        help="GatedDeltaProduct implementation (default: the preset's, else "
                             "pallas on a GPU, xla elsewhere)")
    parser.add_argument("--forget-gate", action="store_true", help="use_forget_gate=True")
    parser.add_argument("--short-conv", action="store_true", help="use_short_conv=True")
    parser.add_argument("--no-vmap", action="store_true", help="loop over seeds instead of vmap")
    parser.add_argument("--out", type=pathlib.Path, help="directory for the JSON, PNG and MD")
    parser.add_argument("--budget-s", type=float,
                        help="wall-clock budget: configurations that would end past it are skipped")
    parser.add_argument("--require-gpu", action="store_true", help="fail unless jax has a GPU")
    parser.add_argument("--replot", type=pathlib.Path, metavar="JSON",
                        help="only rewrite the PNG and MD of a results JSON (into --out, else "
                             "beside it) and exit")
    args = parser.parse_args(argv)
    if args.replot:
        results = json.loads(args.replot.read_text())
        for run in results["runs"]:      # the predictions are this code's, not measurements
            c = run["config"]
            run["prediction"] = prediction(c["group"], c["layers"], c["num_householder"],
                                           c["allow_neg_eigval"])
        out = args.out or args.replot.parent
        write_outputs(results, out)
        print(markdown_table(results))
        return

    p = dict(PRESETS[args.preset])
    for k in ("groups", "layers", "num_householder", "neg", "seeds", "dim", "heads", "head_dim",
              "train_length", "eval_factor", "steps", "steps_per_call", "batch", "warmup",
              "eval_batch", "decode_batch", "chunk_size", "lr", "implementation"):
        if getattr(args, k, None) is not None:
            p[k] = getattr(args, k)
    if "steps_per_call" in p and p["steps"] % p["steps_per_call"]:
        p["steps_per_call"] = math.gcd(p["steps"], p["steps_per_call"])
    backend = jax.default_backend()
    if args.require_gpu and backend != "gpu":
        parser.error(f"--require-gpu: jax has backend {backend!r}")
    p.setdefault("implementation", None)
    if p["implementation"] is None:
        p["implementation"] = "pallas" if backend == "gpu" else "xla"
    if p["implementation"] == "pallas" and backend != "gpu":
        parser.error(f"implementation pallas needs a GPU backend, jax has {backend!r}")
    groups, layers, ms, negs, seeds = (p.pop(k) for k in
                                       ("groups", "layers", "num_householder", "neg", "seeds"))
    for g in groups:
        wp.get_group(g)
    sizes = dict(p, use_forget_gate=args.forget_gate, use_short_conv=args.short_conv)
    configs = grid_configs(groups, layers, ms, negs, **sizes)
    device = str(jax.devices()[0].device_kind) if jax.devices() else "?"
    import inspect
    layer_defaults = {k: repr(v.default) for k, v in
                      inspect.signature(GatedDeltaProduct.__init__).parameters.items()
                      if v.default is not inspect.Parameter.empty}
    meta = dict(preset=args.preset, backend=backend, device=device, jax=jax.__version__,
                python=platform.python_version(), argv=sys.argv[1:] if argv is None else argv,
                train_length=p["train_length"], eval_length=p["train_length"] * p["eval_factor"],
                implementation=p["implementation"], groups=groups, layers=layers,
                num_householder=ms, neg=negs, sizes=sizes, layer_defaults=layer_defaults,
                git=_git_describe())
    print(f"backend {backend} ({device}), jax {jax.__version__}, implementation "
          f"{p['implementation']}; {len(configs)} configurations x {len(seeds)} seeds; "
          + " ".join(f"{k}={v}" for k, v in sizes.items() if k != "implementation"), flush=True)
    log = lambda msg: print(msg, flush=True)
    start = time.perf_counter()
    results = run_grid(configs, seeds, args.out, budget_s=args.budget_s, meta=meta, log=log,
                       vmap_seeds=not args.no_vmap)
    failed = [r for r in results["runs"] if r["status"] == "error"]
    skipped = [r for r in results["runs"] if r["status"].startswith("skipped")]
    print(f"grid done in {time.perf_counter() - start:.0f} s: "
          f"{len(results['runs']) - len(failed) - len(skipped)} ok, {len(skipped)} skipped, "
          f"{len(failed)} failed" + (f"; results in {args.out}" if args.out else ""))
    print(markdown_table(results))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
