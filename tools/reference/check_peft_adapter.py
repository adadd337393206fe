#!/usr/bin/env python3
"""Prove that Hugging Face PEFT loads a LoRA adapter directory as-is and,
on top of its base model, computes the logits recorded in a fixture.

Usage: python3 tools/reference/check_peft_adapter.py BASE_DIR ADAPTER_DIR FIXTURE.safetensors

BASE_DIR is a transformers model directory (config.json + model.safetensors).
ADAPTER_DIR is what PeftModel.save_pretrained writes (adapter_config.json +
adapter_model.safetensors), for example an adapter written by hypertrain.
FIXTURE holds "inputs" I32 (B, T) and "logits" F32 (B, T, V), as in
tests/fixtures/lora/<case>/fixture.safetensors. The base is loaded with
AutoModelForCausalLM.from_pretrained (float32, eager), the adapter with
PeftModel.from_pretrained. The check passes when both load cleanly (no
missing or unexpected base weights; the adapter file holds exactly the
tensors PEFT expects for its adapter_config.json) and
max |logits - fixture| / max |fixture| is at most 1e-5.
Exit status: 0 pass, 1 mismatch or PEFT refuses the adapter, 2 bad arguments
or files.
"""

import os
import sys

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TOL = 1e-5


def main(argv):
    if len(argv) != 4:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    base_dir, adapter_dir, fixture_path = argv[1], argv[2], argv[3]
    adapter_file = os.path.join(adapter_dir, "adapter_model.safetensors")
    for path in (os.path.join(base_dir, "config.json"),
                 os.path.join(adapter_dir, "adapter_config.json"), adapter_file, fixture_path):
        if not os.path.isfile(path):
            print(f"check_peft_adapter: no such file {path}", file=sys.stderr)
            return 2
    fx = load_file(fixture_path)
    for key in ("inputs", "logits"):
        if key not in fx:
            print(f"check_peft_adapter: {fixture_path} has no tensor '{key}'", file=sys.stderr)
            return 2
    inputs = fx["inputs"].long()  # (B, T)
    want = fx["logits"].float()  # (B, T, V)

    torch.set_num_threads(1)
    base, info = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        print(f"check_peft_adapter: {base_dir} does not load cleanly: {bad}", file=sys.stderr)
        return 2
    try:
        model = PeftModel.from_pretrained(base, adapter_dir)
    except Exception as e:  # size mismatch, bad config field, unreadable file, ...
        print(f"check_peft_adapter: FAIL PEFT cannot load {adapter_dir}: "
              f"{type(e).__name__}: {e}")
        return 1
    # PEFT only warns about adapter tensors it expected but did not find (they
    # keep their init, lora_B = 0) or found but does not use; name them.
    expected = set(get_peft_model_state_dict(model))
    present = set(load_file(adapter_file))
    if expected != present:
        print(f"check_peft_adapter: FAIL {adapter_file}: missing {sorted(expected - present)}, "
              f"unexpected {sorted(present - expected)}")
        return 1
    model.eval()
    with torch.no_grad():
        got = model(input_ids=inputs, use_cache=False).logits.float()

    if got.shape != want.shape:
        print(f"check_peft_adapter: FAIL shape {tuple(got.shape)} != fixture {tuple(want.shape)}")
        return 1
    if not torch.isfinite(got).all():
        print("check_peft_adapter: FAIL PEFT produced non-finite logits")
        return 1
    cfg = model.peft_config["default"]
    scale = want.abs().max().item()
    abs_err = (got - want).abs().max().item()
    rel_err = abs_err / scale if scale > 0 else abs_err
    ok = rel_err <= TOL
    print(f"check_peft_adapter: {'PASS' if ok else 'FAIL'} {adapter_dir} on {base_dir} "
          f"({type(base).__name__}, r={cfg.r}, lora_alpha={cfg.lora_alpha}, "
          f"rslora={cfg.use_rslora}, {len(present)} tensors): max abs err {abs_err:.3e}, "
          f"max |logits| {scale:.4f}, relative {rel_err:.3e} (tol {TOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
