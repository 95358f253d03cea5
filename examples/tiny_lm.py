"""A tiny Gated DeltaProduct language model trained on synthetic associative recall.

    python examples/tiny_lm.py                   # CPU: a few hundred small steps (~15 s)
    python examples/tiny_lm.py --gpu             # GPU: a bigger model, implementation="pallas"
    python examples/tiny_lm.py --help            # every size can be overridden

Task: a row is ``k1 v1 k2 v2 ... kn vn q`` where the k are distinct key tokens, the v value tokens
and q one of the keys; the model must predict q's value after reading q. Loss and accuracy are on
that last position only. Model: token embedding, ``depth`` pre-norm blocks
(RMSNorm -> GatedDeltaProduct -> residual, RMSNorm -> MLP -> residual), final RMSNorm, untied head.
Trained with optax.adamw under nnx.jit.
"""
from __future__ import annotations

import argparse
import time
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gdp_jax.nn import GatedDeltaProduct


class Block(nnx.Module):
    """Pre-norm block: x + GDP(RMSNorm(x)), then x + MLP(RMSNorm(x)). x: [B, T, D]."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, num_householder: int,
                 rngs: nnx.Rngs, **layer_kwargs):
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.mixer = GatedDeltaProduct(dim, num_heads=heads, head_dim=head_dim,
                                       num_householder=num_householder, rngs=rngs,
                                       **layer_kwargs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        x = x + self.mixer(self.norm1(x), segment_ids=segment_ids)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    """tokens [B, T] int -> logits [B, T, vocab] float32. ``layer_kwargs`` go to every
    GatedDeltaProduct (chunk_size, implementation, use_short_conv, ...)."""

    def __init__(self, vocab: int, dim: int = 64, depth: int = 2, heads: int = 2,
                 head_dim: int = 32, num_householder: int = 2, *, rngs: nnx.Rngs,
                 **layer_kwargs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads=heads, head_dim=head_dim,
                                      num_householder=num_householder, rngs=rngs,
                                      **layer_kwargs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, segment_ids=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids)
        return self.head(self.norm(x)).astype(jnp.float32)


def recall_batch(key, batch: int, pairs: int, num_keys: int, num_values: int):
    """Associative-recall rows: tokens [B, 2*pairs+1] (keys 0..num_keys-1, values num_keys..),
    target [B] (the value token paired with the final query key)."""
    kk, kv, kq = jax.random.split(key, 3)
    keys = jax.vmap(lambda k: jax.random.permutation(k, num_keys)[:pairs])(
        jax.random.split(kk, batch))
    values = num_keys + jax.random.randint(kv, (batch, pairs), 0, num_values)
    which = jax.random.randint(kq, (batch,), 0, pairs)
    seq = jnp.stack([keys, values], axis=-1).reshape(batch, 2 * pairs)
    query = jnp.take_along_axis(keys, which[:, None], axis=1)
    target = jnp.take_along_axis(values, which[:, None], axis=1)[:, 0]
    return jnp.concatenate([seq, query], axis=1).astype(jnp.int32), target.astype(jnp.int32)


def loss_and_acc(model, tokens, target):
    logits = model(tokens)[:, -1]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == target)


def train(steps: int = 200, *, batch: int = 16, pairs: int = 4, num_keys: int = 16,
          num_values: int = 8, dim: int = 32, depth: int = 1, heads: int = 2, head_dim: int = 32,
          num_householder: int = 2, chunk_size: int = 16, implementation: Optional[str] = None,
          lr: float = 3e-3, seed: int = 0, log_every: int = 0, **layer_kwargs):
    """Trains TinyLM on fresh recall batches; returns (model, per-step losses, per-step accuracies).

    implementation: passed to every GatedDeltaProduct (None: Pallas on a GPU, jnp elsewhere).
    """
    if pairs > num_keys:
        raise ValueError(f"pairs={pairs} needs at least as many keys, got num_keys={num_keys}")
    model = TinyLM(num_keys + num_values, dim=dim, depth=depth, heads=heads, head_dim=head_dim,
                   num_householder=num_householder, rngs=nnx.Rngs(seed), chunk_size=chunk_size,
                   implementation=implementation, **layer_kwargs)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens, target):
        (loss, acc), grads = nnx.value_and_grad(loss_and_acc, has_aux=True)(model, tokens, target)
        optimizer.update(model, grads)
        return loss, acc

    key = jax.random.key(seed + 1)
    losses, accs = [], []
    start = time.perf_counter()
    for step in range(steps):
        key, sub = jax.random.split(key)
        tokens, target = recall_batch(sub, batch, pairs, num_keys, num_values)
        loss, acc = train_step(model, optimizer, tokens, target)
        losses.append(float(loss))
        accs.append(float(acc))
        if step == 0:
            first = time.perf_counter() - start
            start = time.perf_counter()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.4f}  acc {accs[-1]:.3f}", flush=True)
    if log_every and steps > 1:
        per_step = (time.perf_counter() - start) / (steps - 1)
        print(f"first step (compile) {first:.1f} s, then {1e3 * per_step:.1f} ms/step")
    return model, losses, accs


# Sizes of the two presets; every one can be overridden on the command line.
CPU_PRESET = dict(steps=300, batch=16, pairs=4, num_keys=16, num_values=8, dim=32, depth=1,
                  heads=2, head_dim=32, num_householder=2, chunk_size=16, lr=3e-3)
GPU_PRESET = dict(steps=2000, batch=64, pairs=64, num_keys=256, num_values=64, dim=256, depth=4,
                  heads=4, head_dim=64, num_householder=2, chunk_size=64, lr=1e-3)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Sizes default to the CPU preset, or the GPU one with --gpu: "
               + ", ".join(f"{k}={CPU_PRESET[k]}/{GPU_PRESET[k]}" for k in CPU_PRESET) + ".")
    parser.add_argument("--gpu", action="store_true",
                        help='bigger preset with implementation="pallas"; needs a GPU backend')
    parser.add_argument("--implementation", choices=["pallas", "xla", "interpret"],
                        help='GatedDeltaProduct implementation (default: "pallas" with --gpu, '
                             'else "xla")')
    for name, value in CPU_PRESET.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    args = parser.parse_args(argv)
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in (GPU_PRESET if args.gpu else CPU_PRESET).items()}
    implementation = args.implementation or ("pallas" if args.gpu else "xla")

    backend = jax.default_backend()
    if args.gpu and backend != "gpu":
        parser.error(f"--gpu needs a GPU backend, jax has {backend!r}")
    print(f"backend {backend}, implementation {implementation}; "
          + " ".join(f"{k}={v}" for k, v in sizes.items()))
    steps = sizes.pop("steps")
    start = time.perf_counter()
    _, losses, accs = train(steps, implementation=implementation,
                            log_every=max(1, steps // 20), **sizes)
    tail = max(1, min(20, steps // 10))
    print(f"{steps} steps in {time.perf_counter() - start:.1f} s; loss {losses[0]:.3f} -> "
          f"{sum(losses[-tail:]) / tail:.3f} (mean of the last {tail}), "
          f"accuracy of the last {tail}: {sum(accs[-tail:]) / tail:.3f}")


if __name__ == "__main__":
    main()
