#!/usr/bin/env python3
"""Prove that Hugging Face transformers loads a model directory as-is and
computes the logits recorded next to it.

Usage: python3 tools/reference/check_export.py MODEL_DIR FIXTURE.safetensors

MODEL_DIR is what `hypertrain export` wrote (config.json + model.safetensors,
or a sharded index). FIXTURE holds "inputs" I32 (B, T) and "logits" F32
(B, T, V). The check passes when max |logits - fixture| / max |fixture| is at
most 1e-5 (float32, eager attention). Exit status: 0 pass, 1 mismatch,
2 bad arguments or files.
"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TOL = 1e-5


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    model_dir, fixture_path = argv[1], argv[2]
    fx = load_file(fixture_path)
    for key in ("inputs", "logits"):
        if key not in fx:
            print(f"check_export: {fixture_path} has no tensor '{key}'", file=sys.stderr)
            return 2
    inputs = fx["inputs"].long()  # (B, T)
    want = fx["logits"].float()  # (B, T, V)

    torch.set_num_threads(1)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # A missing weight would be filled with random init and merely show up as
    # a logit mismatch; name it instead.
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        print(f"check_export: FAIL {model_dir} does not load cleanly: {bad}")
        return 1
    model.eval()
    with torch.no_grad():
        got = model(input_ids=inputs, use_cache=False).logits.float()

    if got.shape != want.shape:
        print(f"check_export: FAIL shape {tuple(got.shape)} != fixture {tuple(want.shape)}")
        return 1
    if not torch.isfinite(got).all():
        print("check_export: FAIL transformers produced non-finite logits")
        return 1
    scale = want.abs().max().item()
    abs_err = (got - want).abs().max().item()
    rel_err = abs_err / scale if scale > 0 else abs_err
    ok = rel_err <= TOL
    print(f"check_export: {'PASS' if ok else 'FAIL'} {model_dir} "
          f"({type(model).__name__}): max abs err {abs_err:.3e}, "
          f"max |logits| {scale:.4f}, relative {rel_err:.3e} (tol {TOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
