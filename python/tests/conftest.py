"""What the package's tests share: torch.optim.Muon with its Newton-Schulz in
FP32 (the references' iteration; in double on float64 params), as a fixture."""

import pytest
import torch
import torch.optim._muon as torch_muon


def ns_fp32(G, coeffs, eps):
    """docs/NUMERICS.md's Newton-Schulz in FP32 torch ops (tools/reference/make_muon_fixtures.py's); a
    float64 matrix in double throughout (the exact answer FP32 runs are measured from)."""
    X = G.to(torch.float64 if G.dtype == torch.float64 else torch.float32, copy=True)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X * float(1.0 / (X.double().norm().item() + eps))
    for a, b, c in coeffs:
        S = X @ X.T
        T = torch.addmm(S, S, S, beta=b, alpha=c)
        X = torch.addmm(X, T, X, beta=a)
    return X.T.contiguous() if tall else X


@pytest.fixture
def torch_muon_fp32(monkeypatch):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda grad, ns_coefficients, ns_steps, eps: ns_fp32(grad, [tuple(ns_coefficients)] * ns_steps,
                                                                             eps))
