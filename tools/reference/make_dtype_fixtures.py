#!/usr/bin/env python3
"""Write tests/fixtures/dtype/torch_casts.safetensors: what torch does when it
narrows float32 to bfloat16 / float16 and widens them back, bit for bit.

  f32              F32 (N,)     inputs: normals at scales from 2^-150 to 2^127,
                                subnormals, exact round-to-nearest-even ties
                                (and their neighbours) for bf16 and for f16,
                                the f16 overflow edge (65504 .. 65520 and
                                beyond), bf16 overflow near FLT_MAX, +-0,
                                +-Inf, NaNs, FLT_MAX, FLT_MIN, FLT_TRUE_MIN
  bf16_bits        U16 (N,)     x.to(torch.bfloat16) as raw bits
  f16_bits         U16 (N,)     x.to(torch.float16) as raw bits
  bf16_all_to_f32  F32 (65536,) bf16 pattern i widened by torch, i = 0..65535
  f16_all_to_f32   F32 (65536,) f16 pattern i widened by torch

Deterministic (fixed seed). Usage:
  python3 tools/reference/make_dtype_fixtures.py [OUT.safetensors]
"""

import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file

N = 100_000  # f32 + two u16 arrays = 8 bytes a value; with the 2 x 65,536 widenings about 1 MB


def from_bits(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


def both_signs(u):
    u = np.asarray(u, dtype=np.uint32)
    return np.concatenate([u, u | np.uint32(0x80000000)])


def edge_bits(rng):
    """Bit patterns of the hand-picked float32 inputs."""
    parts = []
    f32 = lambda v: np.array(v, dtype=np.float32).view(np.uint32)  # noqa: E731

    # Specials: +-0, +-Inf, NaNs (quiet, signalling, payload only in the low
    # 16 bits, which naive bf16 truncation would turn into Inf), FLT_MAX,
    # FLT_MIN (smallest normal), FLT_TRUE_MIN (smallest subnormal).
    parts.append(np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0x7FC00001, 0x7F80FFFF,
        0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x80800000, 0x00000001, 0x80000001,
        0x007FFFFF, 0x807FFFFF,
    ], dtype=np.uint32))

    # Subnormals: random patterns plus the smallest ones.
    parts.append(both_signs(rng.integers(1, 0x00800000, 4000)))
    parts.append(both_signs(np.arange(1, 65, dtype=np.uint32)))

    # bf16 ties: low 16 bits exactly 0x8000 (half a bf16 ulp), with even and
    # odd kept mantissa, and the neighbours 0x7FFF / 0x8001. High halves are
    # random, plus the carries (mantissa all ones) and the FLT_MAX edge.
    hi = rng.integers(0, 0x7F80, 3000).astype(np.uint32) << 16
    hi = np.concatenate([hi, np.array([0x007F0000, 0x3F7F0000, 0x7F7F0000,
                                       0x7F7E0000, 0x00000000, 0x00010000],
                                      dtype=np.uint32)])
    for low in (0x8000, 0x7FFF, 0x8001):
        parts.append(both_signs(hi | np.uint32(low)))

    # f16 ties in the f16 normal range (|x| in [2^-14, 65504]): low 13 bits
    # exactly 0x1000, and neighbours; float32 exponent 113..142.
    exp = rng.integers(113, 143, 3000).astype(np.uint32) << 23
    man = (rng.integers(0, 1 << 10, 3000).astype(np.uint32)) << 13
    for low in (0x1000, 0x0FFF, 0x1001):
        parts.append(both_signs(exp | man | np.uint32(low)))
    # f16 ties in the f16 subnormal range: (k + 1/2) * 2^-24, k = 0..1023,
    # and just either side; k = 0 is the tie between 0 and the smallest f16.
    k = np.arange(0, 1024, dtype=np.float64)
    t = ((k + 0.5) * 2.0 ** -24).astype(np.float32).view(np.uint32)
    parts.append(both_signs(np.concatenate([t, t - 1, t + 1])))
    # The f16 subnormal/normal boundary 2^-14 and the smallest f16 (2^-24).
    for v in (2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26):
        b = int(f32(v))
        parts.append(both_signs(np.arange(b - 8, b + 9, dtype=np.uint32)))

    # f16 overflow edge: every float32 from 65504 - 256 ulps to
    # 65520 + 256 ulps (65520 is the tie that rounds to Inf), and larger
    # values that must become Inf.
    lo, up = int(f32(65504.0)), int(f32(65520.0))
    parts.append(both_signs(np.arange(lo - 256, up + 257, dtype=np.uint32)))
    parts.append(both_signs(f32([65536.0, 65535.99, 1e5, 1e10, 3.0e38])))

    # Values exactly representable in bf16 / f16 must come back unchanged
    # (NaN patterns left out: the NaNs above are the deliberate ones).
    b = rng.integers(0, 1 << 16, 4000).astype(np.uint32) << 16
    parts.append(b[~np.isnan(from_bits(b))])
    h = torch.from_numpy(rng.integers(0, 1 << 16, 4000).astype(np.uint16).view(np.int16))
    hf = h.view(torch.float16).float().numpy()
    parts.append(hf[~np.isnan(hf)].view(np.uint32))
    return np.concatenate(parts)


def make_inputs():
    rng = np.random.default_rng(20240601)
    edges = edge_bits(rng)
    n_rand = N - edges.size
    assert n_rand > 0, "edge cases alone exceed N"
    # Normals at log-uniform scales over the float32 exponent range (finite).
    scale = np.exp2(rng.uniform(-150.0, 126.0, n_rand))
    rand = (rng.standard_normal(n_rand) * scale).astype(np.float32)
    # Half of them at ordinary scales, where rounding errors would matter most.
    rand[: n_rand // 2] = (rng.standard_normal(n_rand // 2) *
                           np.exp2(rng.uniform(-20.0, 20.0, n_rand // 2))).astype(np.float32)
    with np.errstate(over="ignore"):
        return np.concatenate([from_bits(edges), rand])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        root, "tests", "fixtures", "dtype", "torch_casts.safetensors")
    torch.set_num_threads(1)

    x = make_inputs()  # (N,) float32
    xt = torch.from_numpy(x.copy())
    bf16 = xt.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    f16 = xt.to(torch.float16).view(torch.int16).numpy().view(np.uint16)

    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # wraps to all patterns
    bf16_all = pats.view(torch.bfloat16).float().numpy()
    f16_all = pats.view(torch.float16).float().numpy()

    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file({
        "f32": x,
        "bf16_bits": bf16,
        "f16_bits": f16,
        "bf16_all_to_f32": bf16_all,
        "f16_all_to_f32": f16_all,
    }, out, metadata={"torch": torch.__version__, "n": str(N)})
    print(f"{out}: {x.size} values, {os.path.getsize(out)} bytes, "
          f"{int(np.isnan(x).sum())} NaN, {int(np.isinf(x).sum())} Inf, "
          f"{int(((x != 0) & (np.abs(x) < np.float32(1.17549435e-38))).sum())} subnormal")


if __name__ == "__main__":
    main()
