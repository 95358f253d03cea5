"""fla's tiny GatedDeltaProduct checkpoint for tests/data/fla_tiny/, and our model against fla on a GPU.

Run from the repository root on the H200 (fla installed from the carried wheels):
    PYTHONPATH=/tmp/site:. python tests/data/make_fla_tiny.py --out $OUT

1. Builds fla's GatedDeltaProductForCausalLM from a tiny gated config (3 layers, hidden 64, vocab
   256, M = 2 Householder steps, allow_neg_eigval, short convolutions; torch seed 0), casts it to
   bfloat16 (fla's chunked op refuses float32), saves it with fla's save_pretrained into
   OUT/fla_tiny/ (config.json + model.safetensors; the
   generation_config.json Hugging Face adds is removed, we never read it), runs fla's forward on
   a fixed prompt (batch 2: 80 tokens and 53 tokens left-padded to 80, with attention_mask) and
   stores fla_logits.npy ([2, 80, 256] float32), then fla's greedy ``generate`` of 16 tokens:
   fla_greedy.json (prompt, mask, tokens, arguments, versions) and fla_greedy_logits.npy
   ([2, 16, 256], the logits each greedy token was chosen from). Copy OUT/fla_tiny/ to
   tests/data/fla_tiny/.
2. Loads that directory with our from_pretrained and prints the relative logits difference to
   fla's bf16 logits: ours in float32 compute (Pallas, and the jnp path at highest precision) and
   ours in bfloat16; our greedy tokens vs fla's, and the reverse trip (our save_pretrained -> fla's
   from_pretrained -> the same logits).
3. With --grads: one training step's gradients on an ungated config (use_forget_gate=False:
   fla's gated backward refuses on Triton 3.6 / Hopper), bf16: cross-entropy on a batch, fla's
   loss.backward() against our jax.grad, parameter by parameter (fla's names).
   tests/test_models_gpu.py checks the same.

fla's float32 Triton dots (its bf16 kernels accumulate in float32) run in IEEE float32
(TRITON_F32_DEFAULT=ieee, set before triton is imported) and torch's matmuls without TF32;
--tf32 leaves Triton's default instead. Fails loudly: any exception or check
over its bound exits 1, after the table (printed last) and OUT/report.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

PARSER = argparse.ArgumentParser(description=__doc__.split("\n")[0])
PARSER.add_argument("--out", default=os.environ.get("OUT", "out_fla_ckpt"))
PARSER.add_argument("--tf32", action="store_true", help="let Triton use TF32 for float32 dots")
PARSER.add_argument("--new-tokens", type=int, default=16)
PARSER.add_argument("--grads", action="store_true", help="also part 3 (fla's backward autotunes)")
ARGS = PARSER.parse_args()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX and torch share the GPU
if not ARGS.tf32:
    os.environ["TRITON_F32_DEFAULT"] = "ieee"

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

import fla  # noqa: E402
import transformers  # noqa: E402
import triton  # noqa: E402
from fla.models import GatedDeltaProductConfig as FlaConfig  # noqa: E402
from fla.models import GatedDeltaProductForCausalLM as FlaLM  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gdp_jax.models import fla_name, from_pretrained, generate  # noqa: E402
from gdp_jax.models.convert import to_fla_layout  # noqa: E402

DEV = "cuda"
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=32,
            expand_v=2.0, intermediate_size=128, num_householder=2, use_forget_gate=True,
            allow_neg_eigval=True, use_short_conv=True, conv_size=4, use_output_gate=True,
            norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, fuse_cross_entropy=False)
UNGATED = dict(TINY, use_forget_gate=False)
T_LONG, T_SHORT = 80, 53           # > 64: fla's prefill takes its chunk path (varlen)
BF16_TOL, GRAD_TOL = 5e-2, 5e-2   # bf16 noise on this checkpoint: 3-4 % (tests/test_models_fla_checkpoint.py)

ROWS = []          # (check, value, bound or None, ok)
REPORT = {}


def log(*a):
    print(*a, flush=True)


def check(name, value, bound=None, ok=None):
    if ok is None:
        ok = bound is None or (np.isfinite(value) and value <= bound)
    ROWS.append((name, value, bound, bool(ok)))
    bound_text = "" if bound is None else f" (<= {bound})"
    log(f"  {'ok ' if ok else 'FAIL'} {name}: {value}{bound_text}")
    REPORT.setdefault("checks", {})[name] = {"value": value if not isinstance(value, float)
                                             else float(value), "bound": bound, "ok": bool(ok)}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def build_fla(config: dict, seed: int, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model = FlaLM(FlaConfig(**config))
    return model.to(DEV, dtype=dtype)


def prompt():
    g = np.random.default_rng(1234)
    ids = np.zeros((2, T_LONG), np.int64)
    mask = np.zeros((2, T_LONG), np.int64)
    ids[0] = g.integers(3, TINY["vocab_size"], T_LONG)
    ids[1, T_LONG - T_SHORT:] = g.integers(3, TINY["vocab_size"], T_SHORT)
    mask[0] = 1
    mask[1, T_LONG - T_SHORT:] = 1
    return ids, mask


def fla_logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, device=DEV),
                    attention_mask=torch.as_tensor(mask, device=DEV), use_cache=False)
    return out.logits.float().cpu().numpy()


def from_pretrained_torch(directory, dtype):
    try:
        return FlaLM.from_pretrained(directory, dtype=dtype).to(DEV)
    except TypeError:
        return FlaLM.from_pretrained(directory, torch_dtype=dtype).to(DEV)


@nnx.jit
def our_logits(model, ids, mask):
    return model(ids, attention_mask=mask)


def part1_checkpoint(out_dir: pathlib.Path):
    log("== 1. fla's tiny checkpoint")
    model = build_fla(TINY, seed=0).eval()
    n_params = sum(p.numel() for p in model.parameters())
    ckpt = out_dir / "fla_tiny"
    model.save_pretrained(ckpt)
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    size = (ckpt / "model.safetensors").stat().st_size
    log(f"  {n_params} parameters, model.safetensors {size} bytes: {sorted(os.listdir(ckpt))}")
    check("safetensors bytes", size, 2_000_000)
    ids, mask = prompt()
    logits = fla_logits(model, ids, mask)
    np.save(ckpt / "fla_logits.npy", logits.astype(np.float32))
    # fla's varlen path must give the padded row what the row gives alone
    alone = fla_logits(model, ids[1:, T_LONG - T_SHORT:], mask[1:, T_LONG - T_SHORT:])
    check("fla: padded row vs alone (rel)", rel(logits[1, T_LONG - T_SHORT:], alone[0]), BF16_TOL)
    n = ARGS.new_tokens
    with torch.no_grad():
        gen = model.generate(input_ids=torch.as_tensor(ids, device=DEV),
                             attention_mask=torch.as_tensor(mask, device=DEV),
                             max_new_tokens=n, do_sample=False, use_cache=True,
                             pad_token_id=TINY["pad_token_id"], eos_token_id=TINY["eos_token_id"],
                             return_dict_in_generate=True, output_logits=True)
    new = gen.sequences[:, T_LONG:].cpu().numpy()
    steps = np.stack([s.float().cpu().numpy() for s in gen.logits], axis=1)   # [B, n', V]
    greedy = np.full((2, n), TINY["pad_token_id"], np.int64)
    greedy[:, :new.shape[1]] = new
    step_logits = np.zeros((2, n, TINY["vocab_size"]), np.float32)
    step_logits[:, :steps.shape[1]] = steps
    np.save(ckpt / "fla_greedy_logits.npy", step_logits)
    meta = dict(input_ids=ids.tolist(), attention_mask=mask.tolist(), max_new_tokens=n,
                eos_token_id=TINY["eos_token_id"], pad_token_id=TINY["pad_token_id"],
                greedy=greedy.tolist(), generated=int(new.shape[1]), dtype="bfloat16",
                triton_f32=("tf32" if ARGS.tf32 else "ieee"), seed=0,
                versions=dict(fla=fla.__version__, torch=torch.__version__,
                              triton=triton.__version__, transformers=transformers.__version__),
                note="fla_logits.npy: fla's forward(input_ids, attention_mask) logits [B, T, V]; "
                     "fla_greedy_logits.npy: generate(output_logits=True) [B, N, V], zero "
                     "after the loop stopped")
    (ckpt / "fla_greedy.json").write_text(json.dumps(meta, indent=1))
    log(f"  fla greedy: {greedy.tolist()}")
    REPORT["fla_greedy"] = greedy.tolist()
    return model, ckpt, ids, mask, logits, greedy


def part2_parity(fla_model, ckpt, ids, mask, fla16, greedy):
    log("== 2. our model on the same weights")
    real = mask == 1
    ours = from_pretrained(ckpt, param_dtype=jnp.float32)     # float32 compute, Pallas
    o32 = np.asarray(our_logits(ours, jnp.asarray(ids), jnp.asarray(mask)))
    check("ours float32 (pallas) vs fla bf16 (rel)", rel(o32[real], fla16[real]), BF16_TOL)
    ours_xla = from_pretrained(ckpt, param_dtype=jnp.float32, implementation="xla")
    with jax.default_matmul_precision("highest"):
        ox = np.asarray(our_logits(ours_xla, jnp.asarray(ids), jnp.asarray(mask)))
    check("ours float32 (xla, highest) vs fla bf16 (rel)", rel(ox[real], fla16[real]), BF16_TOL)
    check("ours float32: pallas vs xla (rel)", rel(o32[real], ox[real]))
    per_pos = np.abs(o32 - fla16).max(-1)
    REPORT["max_abs_diff_per_position"] = per_pos.tolist()
    ours16 = from_pretrained(ckpt, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    o16 = np.asarray(our_logits(ours16, jnp.asarray(ids), jnp.asarray(mask)), np.float32)
    check("ours bf16 vs fla bf16 (rel)", rel(o16[real], fla16[real]), BF16_TOL)
    check("ours bf16 vs ours float32 (rel, bf16 noise)", rel(o16[real], o32[real]))
    # greedy (ours in float32 compute, as the CPU test runs it; a near-tie may part)
    gen = generate(ours, jnp.asarray(ids), ARGS.new_tokens, attention_mask=jnp.asarray(mask),
                   eos_token_id=TINY["eos_token_id"], pad_token_id=TINY["pad_token_id"])
    tokens = np.asarray(gen.tokens)
    REPORT["our_greedy"] = tokens.tolist()
    same = int((tokens == greedy).sum())
    check("greedy tokens equal to fla's (the CPU test judges near-ties)",
          f"{same}/{tokens.size}", None, True)
    # the reverse trip: our save_pretrained -> fla's from_pretrained
    with tempfile.TemporaryDirectory() as d:
        ours16.save_pretrained(d)
        back = from_pretrained_torch(d, torch.bfloat16).eval()
        sd_a, sd_b = fla_model.state_dict(), back.state_dict()
        worst = max(float((sd_a[k].float() - sd_b[k].float()).abs().max()) for k in sd_a)
        check("our save -> fla load: max |param diff|", worst, 0.0)
        check("our save -> fla load: logits (rel)", rel(fla_logits(back, ids, mask)[real],
                                                        fla16[real]), 1e-6)


def part3_gradients():
    log("== 3. one training step's gradients, ungated config")
    model = build_fla(UNGATED, seed=1).train()      # bf16
    g = np.random.default_rng(7)
    ids = g.integers(3, UNGATED["vocab_size"], (2, 96))
    ids[:, ::17] = UNGATED["pad_token_id"]    # padding_idx rows: no embedding gradient in fla
    t_ids = torch.as_tensor(ids, device=DEV)
    out = model(input_ids=t_ids, labels=t_ids, use_cache=False)
    out.loss.backward()
    fla_grads = {k: p.grad.float().cpu().numpy() for k, p in model.named_parameters()
                 if p.grad is not None}
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        ours = from_pretrained(d, param_dtype=jnp.float32)

    def loss_fn(m):
        logits = m(jnp.asarray(ids)).astype(jnp.float32)[:, :-1]
        labels = jnp.asarray(ids)[:, 1:]
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - picked)

    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(ours)
    check("loss: ours vs fla (abs)", abs(float(loss) - float(out.loss)), 2e-2)
    ours_g = {fla_name(p): to_fla_layout(p, np.asarray(v.get_value(), np.float32))
              for p, v in nnx.to_flat_state(grads)}
    missing = sorted(set(fla_grads) ^ set(ours_g))
    check("gradient names: symmetric difference", len(missing), 0)
    if missing:
        log("  names only on one side:", missing)
    errs = {k: rel(ours_g[k], fla_grads[k]) if np.linalg.norm(fla_grads[k]) > 0
            else float(np.abs(ours_g[k]).max()) for k in fla_grads if k in ours_g}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:6]
    for k, e in worst:
        log(f"    {k}: {e:.3e}")
    REPORT["grad_rel_errors"] = errs
    check("gradients: worst relative error", max(errs.values()), GRAD_TOL)
    emb_pad = float(np.abs(ours_g["model.embeddings.weight"][UNGATED["pad_token_id"]]).max())
    check("embedding gradient of pad_token_id row (fla: 0)", emb_pad, 0.0)


def main():
    out_dir = pathlib.Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    REPORT["versions"] = dict(fla=fla.__version__, torch=torch.__version__,
                              triton=triton.__version__, transformers=transformers.__version__,
                              jax=jax.__version__, device=str(jax.devices()[0]),
                              triton_f32=("tf32" if ARGS.tf32 else "ieee"))
    log(REPORT["versions"])
    failed = False
    for part in ("1", "2", "3") if ARGS.grads else ("1", "2"):
        try:
            if part == "1":
                state = part1_checkpoint(out_dir)
            elif part == "2":
                fla_model, ckpt, ids, mask, logits, greedy = state
                part2_parity(fla_model, ckpt, ids, mask, logits, greedy)
            else:
                part3_gradients()
        except Exception:  # noqa: BLE001 - report every part, then fail
            failed = True
            log(f"!! part {part} raised:\n{traceback.format_exc()}")
            REPORT.setdefault("errors", {})[part] = traceback.format_exc()
            if part == "1":
                break
    REPORT["seconds"] = time.time() - t0
    (out_dir / "report.json").write_text(json.dumps(REPORT, indent=1, default=str))
    log("\n| check | value | bound | ok |\n|---|---|---|---|")
    for name, value, bound, ok in ROWS:
        v = f"{value:.3e}" if isinstance(value, float) else str(value)
        log(f"| {name} | {v} | {'' if bound is None else bound} | {'yes' if ok else 'NO'} |")
    failed = failed or not all(ok for *_, ok in ROWS)
    log("FAILED" if failed else "ALL OK", f"({REPORT['seconds']:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
