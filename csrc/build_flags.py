"""nvcc flags of the CUDA kernels, the one list both setup.py (the real build) and
.ci/cuda_compile_check.py (the compile gate) use, so the gate checks what is built.

Standard library only and torch-free: setup.py loads this file by path (importlib) before the
ringseq package exists, and the gate runs without torch. Flag choices: docs/kernels.md.
"""

NVCC_FLAGS = (
    "-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
    # torch's build defines these; the kernels use the half/bfloat16 operators and conversions
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-DRINGSEQ_WITH_CUDA",
)

# SASS for these SM versions when TORCH_CUDA_ARCH_LIST does not say otherwise: the kernels need
# sm_80 (bf16 mma.sync, cp.async); sm_90 is the Hopper build.
DEFAULT_ARCHS = ("80", "90")
# PTX embedded for this one, so GPUs newer than the SASS targets JIT-compile it.
PTX_ARCH = "90"


def gencode_flags(archs=DEFAULT_ARCHS, ptx_arch=PTX_ARCH):
    """-gencode flags: SASS for each of `archs`, plus PTX for `ptx_arch` unless it is None."""
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    if ptx_arch is not None:
        flags += ["-gencode", f"arch=compute_{ptx_arch},code=compute_{ptx_arch}"]
    return flags


def nvcc_flags(default_gencode=True):
    """The build's nvcc flags; default_gencode=False when TORCH_CUDA_ARCH_LIST picks the
    architectures (torch then adds its own -gencode flags)."""
    return list(NVCC_FLAGS) + (gencode_flags() if default_gencode else [])
