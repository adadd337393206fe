"""Tensors that say they are on cuda:0 without a GPU: torch wrapper subclasses over CPU tensors, for the
optimizers' CUDA path (python/tests/test_cuda_tensors.py). Every op runs on the CPU tensor inside; a tensor
an op makes is given memory of `alloc` (the emulated device's, tests/emu/, where the kernels read it) unless
it is a view of an input's."""

import ctypes

import torch
from torch.utils._pytree import tree_map


class FakeCuda(torch.Tensor):
    alloc = None  # bytes -> address of device memory (None: the CPU's own, for tests that only check refusals)

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device="cuda:0",
                                                strides=inner.stride(), requires_grad=inner.requires_grad)
        t.inner = inner
        return t

    def data_ptr(self):
        return self.inner.data_ptr()

    def __repr__(self):
        return f"FakeCuda({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            if isinstance(x, FakeCuda):
                return x.inner
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x

        inputs = [x for x in tree_map(lambda x: x, list(args) + list((kwargs or {}).values()))
                  if isinstance(x, FakeCuda)]
        kwargs = {k: ("cpu" if k == "device" else unwrap(v)) for k, v in (kwargs or {}).items()}
        out = func(*tree_map(unwrap, args), **kwargs)
        storages = {x.inner.untyped_storage().data_ptr(): x for x in inputs}

        def wrap(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, FakeCuda):
                return x
            for w in inputs:  # an input itself (in place), or a view of one: the same memory
                if x is w.inner:
                    return w
            if x.untyped_storage().data_ptr() in storages:
                return FakeCuda(x)
            return FakeCuda(device_copy(x))
        return tree_map(wrap, out)


def device_copy(x):
    """x's values in memory of FakeCuda.alloc (contiguous), as a CPU tensor over it."""
    if FakeCuda.alloc is None:
        return x.contiguous().clone()
    n = max(x.numel() * x.element_size(), 1)
    buf = (ctypes.c_byte * n).from_address(FakeCuda.alloc(n))
    t = torch.frombuffer(buf, dtype=x.dtype, count=x.numel()).view(x.shape)
    t.copy_(x)
    return t


def on_device(x):
    """A FakeCuda copy of CPU tensor x (a Parameter stays one)."""
    t = FakeCuda(device_copy(x.detach()))
    return torch.nn.Parameter(t, requires_grad=x.requires_grad) if isinstance(x, torch.nn.Parameter) else t
