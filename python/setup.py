"""Builds hypertrain._C with the project's CMake (the library, position-independent,
linked into the extension module: cmake -DHT_PYTHON=ON, target hypertrain_python)
and installs it with the package. From a clone: pip install ./python (make python)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent.parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = ROOT / "build" / "python"
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                               "-DHT_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build), "--target", "hypertrain_python", "-j",
                               str(os.cpu_count() or 1)])
        built = sorted(build.glob("_C*.so"))
        if not built:
            raise RuntimeError(f"hypertrain: cmake built no _C*.so in {build}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], dest)


setup(ext_modules=[Extension("hypertrain._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
