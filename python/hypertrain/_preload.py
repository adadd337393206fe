"""What runs before the extension module hypertrain._C loads: the CPU
checked against the engine's minimum (x86-64-v3: AVX2 and FMA, what a wheel
is compiled for), so an older CPU gets a sentence instead of an illegal
instruction, as the CLI's src/cli/cpu_check.c does; and a wheel's bundled
shared libraries (setup.py copies those the module needs that a Linux
system may lack into _bundled/, named in the order of LOAD_ORDER, each
after the ones it needs) loaded by path, so that the dynamic loader finds
them by name when the module asks. A build staged from the source tree
(scripts/test-python.sh) bundles none and uses the system's."""

import ctypes
from pathlib import Path

ENGINE_MINIMUM = ("avx2", "fma")
BUNDLED = Path(__file__).resolve().parent / "_bundled"


def _cpu_flags():
    """The CPU's flags as Linux names them (/proc/cpuinfo), or None where it cannot say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def check_cpu(flags):
    missing = [f for f in ENGINE_MINIMUM if flags is not None and f not in flags]
    if missing:
        raise ImportError(f"hypertrain: this CPU lacks {', '.join(missing)}; hypertrain needs an x86-64 CPU with "
                          "AVX2 and FMA (x86-64-v3: Intel Haswell, AMD Zen or later)")


def load_bundled():
    order = BUNDLED / "LOAD_ORDER"
    if order.is_file():
        for name in order.read_text().split():
            ctypes.CDLL(str(BUNDLED / name))


check_cpu(_cpu_flags())
load_bundled()
