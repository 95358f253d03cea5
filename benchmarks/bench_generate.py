"""Prefill and decode tokens/s of a ~150M GatedDeltaProduct LM: fla's ``generate`` vs our ``generate``.

Run from the repository root on the H200 (fla installed from the carried wheels):
    PYTHONPATH=/tmp/site:. python benchmarks/bench_generate.py --out $OUT [--budget-s 300]

Model: fla's GatedDeltaProductForCausalLM, vocab 32000, hidden 768, 12 layers, 6 heads of
K = V = 128, M = 2 Householder steps, forget gate, allow_neg_eigval, short convolutions, SwiGLU
MLP 2048, untied head (~156M parameters), random init (torch seed 0), bfloat16. Ours is loaded
from fla's save_pretrained of that model in a temporary directory (same weights, bf16 params and
compute, Pallas kernels).

For each batch B in --batches (default 1 16 128), prompt T = --prompt (512) random tokens, no
padding, greedy, N = --new-tokens (128) tokens with eos disabled:
  gen(N)       fla: model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False,
               use_cache=True); ours: gdp_jax.models.generate(model, ids, N, eos_token_id=None)
  gen(1)       the same with one new token: the prefill (the prompt's forward) and one sampling
  prefill tok/s  B*T / gen(1)   (fla also: B*T / its bare forward, use_cache, logits_to_keep=1)
  decode tok/s   B*(N-1) / (gen(N) - gen(1))   (the N-1 tokens after the first)
Each time is the median of --reps (3) timed calls after one warm-up (fla autotunes, ours
compiles there). Wall clock around the call, torch.cuda.synchronize / block_until_ready.
The whole run stops measuring when --budget-s (300) is spent: rows not reached say "skipped".
Also prints how many of the first 32 greedy tokens at B = 1 agree (bf16: a near-tie may differ).

Prints a table (last) and writes OUT/lm_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

PARSER = argparse.ArgumentParser(description=__doc__.split("\n")[0])
PARSER.add_argument("--out", default=os.environ.get("OUT", "out_lm_speed"))
PARSER.add_argument("--budget-s", type=float, default=300.0)
PARSER.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
PARSER.add_argument("--prompt", type=int, default=512)
PARSER.add_argument("--new-tokens", type=int, default=128)
PARSER.add_argument("--reps", type=int, default=3)
PARSER.add_argument("--layers", type=int, default=12)
ARGS = PARSER.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX and torch share the GPU

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fla  # noqa: E402
import transformers  # noqa: E402
import triton  # noqa: E402
from fla.models import GatedDeltaProductConfig as FlaConfig  # noqa: E402
from fla.models import GatedDeltaProductForCausalLM as FlaLM  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gdp_jax.models import from_pretrained, generate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LM_CONFIG  # noqa: E402

DEV = "cuda"
CONFIG = dict(LM_CONFIG, num_hidden_layers=ARGS.layers)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def over_budget() -> bool:
    return time.time() - T0 > ARGS.budget_s


def timed(fn, sync, reps):
    fn()
    sync()                                   # warm-up: fla autotunes, ours compiles
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    out_dir = pathlib.Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(config=CONFIG, prompt=ARGS.prompt, new_tokens=ARGS.new_tokens, reps=ARGS.reps,
                budget_s=ARGS.budget_s,
                versions=dict(fla=fla.__version__, torch=torch.__version__,
                              triton=triton.__version__, transformers=transformers.__version__,
                              jax=jax.__version__, device=str(jax.devices()[0]),
                              gpu=torch.cuda.get_device_name()))
    log(meta["versions"])
    torch.manual_seed(0)
    fla_model = FlaLM(FlaConfig(**CONFIG)).to(DEV, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in fla_model.parameters())
    meta["parameters"] = n_params
    log(f"{n_params / 1e6:.1f}M parameters")
    with tempfile.TemporaryDirectory() as d:
        fla_model.save_pretrained(d)
        ours = from_pretrained(d)            # bf16 params and compute, Pallas on the GPU
    log("ours loaded:", ours.model.embeddings.embedding.get_value().dtype)

    rows = []
    n, t_prompt = ARGS.new_tokens, ARGS.prompt
    rng = np.random.default_rng(0)
    cuda_sync = torch.cuda.synchronize
    agreement = None
    for batch in ARGS.batches:
        ids = rng.integers(3, CONFIG["vocab_size"], (batch, t_prompt))
        t_ids = torch.as_tensor(ids, device=DEV)
        j_ids = jnp.asarray(ids, jnp.int32)
        for who in ("fla", "ours"):
            row = dict(who=who, batch=batch)
            rows.append(row)
            if over_budget():
                row["skipped"] = "budget"
                log(f"{who} B={batch}: skipped (budget)")
                continue
            try:
                if who == "fla":
                    def gen(k):
                        with torch.no_grad():
                            return fla_model.generate(
                                input_ids=t_ids, max_new_tokens=k, min_new_tokens=k,
                                do_sample=False, use_cache=True, pad_token_id=0)

                    def fwd():
                        with torch.no_grad():
                            return fla_model(input_ids=t_ids, use_cache=True, logits_to_keep=1)
                    row["forward_s"] = timed(fwd, cuda_sync, ARGS.reps)
                    sync = cuda_sync
                else:
                    def gen(k):
                        return generate(ours, j_ids, k, eos_token_id=None, pad_token_id=0)

                    def sync():
                        pass
                    gen_block = gen
                    gen = lambda k: jax.block_until_ready(gen_block(k))  # noqa: E731
                row["gen1_s"] = timed(lambda: gen(1), sync, ARGS.reps)
                if over_budget():
                    row["skipped"] = "budget (after gen(1))"
                    continue
                row["genN_s"] = timed(lambda: gen(n), sync, ARGS.reps)
                row["prefill_tok_s"] = batch * t_prompt / row["gen1_s"]
                if "forward_s" in row:
                    row["forward_tok_s"] = batch * t_prompt / row["forward_s"]
                row["decode_tok_s"] = batch * (n - 1) / (row["genN_s"] - row["gen1_s"])
                row["decode_ms_per_step"] = 1e3 * (row["genN_s"] - row["gen1_s"]) / (n - 1)
                log(f"{who} B={batch}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))
                if batch == 1 and who == "ours" and agreement is None:
                    k = min(32, n)
                    a = np.asarray(generate(ours, j_ids, k, eos_token_id=None).tokens)[0]
                    with torch.no_grad():
                        b = fla_model.generate(input_ids=t_ids, max_new_tokens=k,
                                               min_new_tokens=k, do_sample=False,
                                               pad_token_id=0)[0, t_prompt:].cpu().numpy()
                    first = int(np.argmax(a != b)) if np.any(a != b) else k
                    agreement = dict(tokens=k, equal=int((a == b).sum()), first_difference=first)
                    log("greedy agreement at B=1:", agreement)
            except Exception:  # noqa: BLE001 - keep the other rows
                row["error"] = traceback.format_exc(limit=3)
                log(f"{who} B={batch} raised:\n{traceback.format_exc()}")
            torch.cuda.empty_cache()
    meta["greedy_agreement_b1"] = agreement
    meta["rows"] = rows
    (out_dir / "lm_speed.json").write_text(json.dumps(meta, indent=1))

    def f(row, key, fmt="{:,.0f}"):
        return fmt.format(row[key]) if key in row else row.get("skipped", "error" if "error" in
                                                               row else "-")
    print(f"\n{n_params / 1e6:.0f}M params, bf16, prompt {t_prompt}, {n} new tokens, "
          f"{meta['versions']['gpu']}")
    print("| B | who | prefill tok/s (gen(1)) | fla forward tok/s | decode tok/s | decode ms/step |"
          "\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['who']} | {f(row, 'prefill_tok_s')} | "
              f"{f(row, 'forward_tok_s') if row['who'] == 'fla' else ''} | "
              f"{f(row, 'decode_tok_s')} | {f(row, 'decode_ms_per_step', '{:.2f}')} |")
    by = {(r["who"], r["batch"]): r for r in rows}
    for batch in ARGS.batches:
        a, b = by.get(("ours", batch), {}), by.get(("fla", batch), {})
        if "decode_tok_s" in a and "decode_tok_s" in b:
            print(f"B={batch}: decode ours/fla {a['decode_tok_s'] / b['decode_tok_s']:.2f}x, "
                  f"prefill ours/fla {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x "
                  f"(vs fla's bare forward {a['prefill_tok_s'] / b['forward_tok_s']:.2f}x)")
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
