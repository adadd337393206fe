"""Builds the package hypertrain and its extension module hypertrain._C with
the project's CMake (the library, position-independent, linked into the
module: -DHT_PYTHON=ON, target hypertrain_python), as a wheel another x86-64
Linux machine installs: `pip wheel ./python -w DIR` (or `pip install ./python`).

- Portable: compiled for x86-64-v3 (AVX2 and FMA, the engine's minimum;
  HT_MARCH=native in the environment builds for this machine only), the
  GEMMs in oneDNN, which picks its kernels by the CPU at run time (AVX-512,
  AMX); the package checks the CPU at import (hypertrain/_preload.py).
- One process: -DHT_MPI=OFF, so importing it loads no MPI (several ranks
  are the CLI's, mpirun).
- Self-contained: the shared libraries the module needs beyond the C and C++
  runtimes (oneDNN and what it needs, libyaml, xxhash, the OpenMP runtime)
  are copied into hypertrain/_bundled/, loaded by path before the module.
- Out of the source tree: CMake builds in a temporary directory, and
  setuptools' own build and egg-info directories are temporary too.
- Package data: the repository's configs/*.yaml (hypertrain.CONFIGS) and the
  default corpus, the regular files of Debian's fortunes folder
  (/usr/share/games/fortunes, HT_CORPUS to take another; hypertrain.CORPUS),
  so hypertrain.train() with no config runs the default model anywhere.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent
MARCH = os.environ.get("HT_MARCH", "x86-64-v3")
CORPUS = Path(os.environ.get("HT_CORPUS", "/usr/share/games/fortunes"))
# What any Linux system has (the manylinux policies' libraries): not bundled.
SYSTEM = ("linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so",
          "libstdc++.so", "libgcc_s.so")

TEMP = Path(tempfile.mkdtemp(prefix="hypertrain-build-"))
atexit.register(shutil.rmtree, TEMP, ignore_errors=True)


def needed(lib):
    """The shared libraries lib loads, as ldd resolves them here: {name: path}."""
    out = subprocess.run(["ldd", str(lib)], check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            if parts[2] == "not":
                raise RuntimeError(f"hypertrain: {lib} needs {parts[0]}, which this machine does not have")
            found[parts[0]] = parts[2]
    return found


def bundle(module, dest):
    """Copies the libraries module needs that are not SYSTEM into dest, with LOAD_ORDER: each after those it
    needs (fewer bundled dependencies first)."""
    libs = {n: p for n, p in needed(module).items() if not n.startswith(SYSTEM)}
    if any(n.startswith("libmpi") for n in libs):
        raise RuntimeError(f"hypertrain: {module} needs MPI ({sorted(libs)}); the wheel is built with -DHT_MPI=OFF")
    dest.mkdir(parents=True, exist_ok=True)
    deps = {n: set(needed(p)) & set(libs) for n, p in libs.items()}
    for n, p in libs.items():
        shutil.copyfile(p, dest / n)
    order = sorted(libs, key=lambda n: (len(deps[n]), n))
    (dest / "LOAD_ORDER").write_text("\n".join(order) + "\n")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = TEMP / "cmake"
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                               "-DHT_PYTHON=ON", "-DHT_MPI=OFF", f"-DHT_MARCH={MARCH}",
                               f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build), "--target", "hypertrain_python", "-j",
                               str(os.cpu_count() or 1)])
        built = sorted(build.glob("_C*.so"))
        if not built:
            raise RuntimeError(f"hypertrain: cmake built no _C*.so in {build}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], dest)
        bundle(dest, dest.parent / "_bundled")


class BuildPy(build_py):
    """The package, with the configs and the default corpus as its data."""

    def run(self):
        super().run()
        pkg = Path(self.build_lib) / "hypertrain"
        configs = pkg / "configs"
        configs.mkdir(parents=True, exist_ok=True)
        for f in sorted((ROOT / "configs").glob("*.yaml")):
            shutil.copyfile(f, configs / f.name)
        files = [f for f in sorted(CORPUS.iterdir()) if f.is_file() and not f.is_symlink()] \
            if CORPUS.is_dir() else []
        if not files:
            raise RuntimeError(f"hypertrain: the default corpus {CORPUS} has no files (Debian's fortunes package, "
                               "scripts/install-deps.sh; or HT_CORPUS=a folder of text files)")
        corpus = pkg / "data" / "fortunes"
        corpus.mkdir(parents=True, exist_ok=True)
        for f in files:  # symlinks left out, as the engine's text_bytes reader skips them
            shutil.copyfile(f, corpus / f.name)


setup(ext_modules=[Extension("hypertrain._C", sources=[])], cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
      options={"build": {"build_base": str(TEMP / "build")}, "egg_info": {"egg_base": str(TEMP)}})
