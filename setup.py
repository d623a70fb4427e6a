"""Build script: compiles the C++ CPU ops in csrc/openmp/ into apex_compile/_C (ninja, OpenMP)."""
import glob
import os
import runpy

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# The flags module is read by path: importing the package here would try to load the ops being built.
_flags = runpy.run_path(os.path.join(ROOT, "apex_compile", "_build_flags.py"))
CXX_FLAGS, LD_FLAGS = _flags["CXX_FLAGS"], _flags["LD_FLAGS"]
sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "openmp", "*.cpp")))

setup(
    ext_modules=[
        CppExtension(
            name="apex_compile._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc", "openmp")],
            extra_compile_args=CXX_FLAGS,
            extra_link_args=LD_FLAGS,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
