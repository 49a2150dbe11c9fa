"""Build of the ``megarl._C`` extension (the reshard's batched box copies and block-FP8 quantisation, sources in
``csrc/``).

Package metadata lives in ``pyproject.toml``; this file only adds the extension. Build in place with

    .venv/bin/python setup.py build_ext --inplace

A ``CUDAExtension`` (sm_90a for the H200, plus compute_80 PTX for other GPUs) is built where
``torch.cuda.is_available()`` and ``nvcc`` exist, a CPU-only ``CppExtension`` elsewhere. ``MAX_JOBS`` bounds
the parallel compile jobs. Where torch cannot be imported (an isolated ``pip install .`` build environment),
the package is built without the extension; the reshard then uses its pure-torch copies.
"""

import os
import shutil

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # an isolated build environment (plain `pip install .`): no torch, so no extension
    torch = None

SOURCES = ["csrc/box_copy.cpp", "csrc/quantize_fp8.cpp"]  # the C++ of both builds; the CUDA build adds csrc/*.cu
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
              "-gencode=arch=compute_80,code=compute_80"]


def _have_nvcc() -> bool:
    return shutil.which("nvcc") is not None or (CUDA_HOME is not None
                                                and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))


def _extension():
    if torch.cuda.is_available() and _have_nvcc():
        return CUDAExtension("megarl._C", SOURCES + ["csrc/box_copy_cuda.cu", "csrc/quantize_fp8_cuda.cu"],
                             define_macros=[("MEGARL_WITH_CUDA", None)],
                             extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
                             extra_link_args=["-fopenmp"])
    return CppExtension("megarl._C", SOURCES, extra_compile_args=CXX_FLAGS,
                        extra_link_args=["-fopenmp"])


if torch is None:
    print("megarl: torch is not importable here, building without the megarl._C extension "
          "(build it with: python setup.py build_ext --inplace)")
    setup()
else:
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension})
