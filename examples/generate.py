"""Load a fla GatedDeltaProduct checkpoint (Hugging Face directory: config.json + safetensors) and generate.

    python examples/generate.py tests/data/fla_tiny --ids "5 6 7 8" --ids "9 10 11" -n 16
    python examples/generate.py CKPT --text "Once upon a time" -n 64 --temperature 0.8 --top-k 40
    python examples/generate.py --random-init -n 8          # no checkpoint: a tiny random model

Prompts come as token ids (--ids, one flag per prompt; prompts of different lengths are batched,
left-padded) or as text (--text, one flag per prompt), which needs the checkpoint's
tokenizer.json and the ``tokenizers`` package. Greedy unless --temperature > 0. Prints each
prompt's new tokens (and text), the prefill and decode times and tokens/s (the first call of a
shape includes compilation: --repeat 2 shows the compiled speed; benchmarks belong to the
script benchmarks/bench_generate.py).
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.models import GatedDeltaProductConfig, from_pretrained, generate, init_model

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=32,
            expand_v=2.0, intermediate_size=128, num_householder=2, use_forget_gate=True,
            allow_neg_eigval=True, initializer_range=0.1, pad_token_id=0)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (fla's save_pretrained)")
    p.add_argument("--random-init", action="store_true",
                   help="no checkpoint: a tiny random model (saved and reloaded by the converter)")
    p.add_argument("--ids", action="append", default=[], help='a prompt as token ids, "5 6 7"')
    p.add_argument("--text", action="append", default=[], help="a prompt as text (tokenizer.json)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos", default="config", help='eos token id, "config" or "none"')
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter and compute dtype (default: the checkpoint's)")
    p.add_argument("--implementation", choices=["pallas", "xla", "interpret"], default=None)
    p.add_argument("--repeat", type=int, default=1, help="run the generation this many times")
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (not args.random_init):
        p.error("give a checkpoint directory or --random-init (one of them)")
    return args


def load(args):
    dtype = DTYPES[args.dtype] if args.dtype else None
    kw = dict(param_dtype=dtype, dtype=dtype, implementation=args.implementation)
    if args.checkpoint:
        return from_pretrained(args.checkpoint, **kw), pathlib.Path(args.checkpoint)
    model = init_model(GatedDeltaProductConfig(**TINY), seed=args.seed,
                       implementation=args.implementation)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return from_pretrained(d, **kw), None


def tokenizer_for(directory):
    if directory is None or not (directory / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def main(argv=None):
    args = parse_args(argv)
    model, directory = load(args)
    config = model.config
    tok = tokenizer_for(directory)
    prompts = [[int(t) for t in s.replace(",", " ").split()] for s in args.ids]
    if args.text:
        if tok is None:
            raise SystemExit("--text needs tokenizer.json in the checkpoint and the `tokenizers` "
                             "package")
        prompts += [tok.encode(t).ids for t in args.text]
    if not prompts:
        prompts = [[config.bos_token_id or 1] + list(range(3, 10)), [config.bos_token_id or 1, 5]]
    eos = {"config": config.eos_token_id, "none": None}.get(args.eos)
    if eos is None and args.eos not in ("config", "none"):
        eos = int(args.eos)
    kw = dict(eos_token_id=eos, temperature=args.temperature, top_k=args.top_k,
              rng=args.seed if args.temperature > 0 else None)
    n_params = sum(np.size(x) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    print(f"{n_params:,} parameters, {config.num_hidden_layers} layers, vocab "
          f"{config.vocab_size}, {len(prompts)} prompt(s), backend {jax.default_backend()}")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        first = generate(model, prompts, 1, **kw)
        jax.block_until_ready(first)
        t1 = time.perf_counter()
        out = generate(model, prompts, args.max_new_tokens, **kw)
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        batch, n = out.tokens.shape
        print(f"prefill + 1 token: {1e3 * (t1 - t0):.1f} ms; prefill + {n} tokens: "
              f"{1e3 * (t2 - t1):.1f} ms ({batch * n / (t2 - t1):,.1f} new tokens/s overall)")
    for b, p in enumerate(prompts):
        new = np.asarray(out.tokens[b, :int(out.lengths[b])]).tolist()
        print(f"[{b}] prompt {p} -> {new}")
        if tok is not None:
            print(f"    {tok.decode(p)!r} -> {tok.decode(new)!r}")
    return out


if __name__ == "__main__":
    main()
