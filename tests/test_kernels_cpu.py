"""Kernel plumbing that needs no GPU: backend selection and a compile check of every .cu file.

The compile check builds, with the machine's nvcc for sm_90, exactly the template instantiations
the engine asks NVRTC for at run time, with the same -D defines (the constants Python and CUDA
share), so a syntax or type error in kernels_cu/ fails CI. nvcc
pulls in <math.h> through cuda_runtime.h, NVRTC does not: the check undefines the math macros a
kernel might use by habit (INFINITY, NAN, HUGE_VALF), so such a use fails here as it would there.
"""
import importlib
import pkgutil
import shutil
import subprocess

import pytest
import torch

import dsv2_lib
from dsv2_lib.core import kernels


def all_kernel_files():
    for mod in pkgutil.walk_packages(dsv2_lib.__path__, "dsv2_lib."):
        importlib.import_module(mod.name)  # modules declare their kernels on import
    return kernels.KERNEL_FILES


def test_every_cu_file_is_declared_by_a_module():
    on_disk = {p.relative_to(kernels.KERNEL_DIR).as_posix() for p in kernels.KERNEL_DIR.rglob("*.cu")}
    assert on_disk and on_disk == set(all_kernel_files())


@pytest.mark.parametrize("filename", sorted(p.relative_to(kernels.KERNEL_DIR).as_posix() for p in kernels.KERNEL_DIR.rglob("*.cu")))
def test_kernel_file_compiles_for_sm90(filename, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine (and NVRTC needs a GPU driver here): compile check skipped")
    kf = all_kernel_files()[filename]
    unit = tmp_path / "instantiate.cu"
    unit.write_text(
        "#include <cuda_runtime.h>\n#undef INFINITY\n#undef NAN\n#undef HUGE_VALF\n"  # as under NVRTC
        f'#include "{filename}"\n'
        + "".join(f"static const void* k{i} = (const void*)&{name};\n" for i, name in enumerate(kf.names))
    )
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", f"-I{kernels.KERNEL_DIR}", *kf.flags(), "-c", str(unit),
                        "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, f"{filename} does not compile:\n{r.stderr}"


def test_backend_choice(monkeypatch):
    cpu = torch.empty(1)
    monkeypatch.setenv("DSV2_BACKEND", "torch")
    assert not kernels.use_kernels(cpu)
    monkeypatch.setenv("DSV2_BACKEND", "auto")
    assert not kernels.use_kernels(cpu)  # CPU tensors always take the reference
    monkeypatch.setenv("DSV2_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="DSV2_BACKEND=cuda but the tensor is on cpu"):
        kernels.use_kernels(cpu)
    monkeypatch.setenv("DSV2_BACKEND", "fast")
    with pytest.raises(ValueError, match="DSV2_BACKEND must be one of auto, cuda, torch, got 'fast'"):
        kernels.use_kernels(cpu)


def test_an_older_gpu_takes_the_references(monkeypatch):
    """Below compute capability 8.0 (a T4, a V100) ``auto`` sends a CUDA tensor to the PyTorch reference and
    ``cuda`` refuses with the capability named: the kernels' bf16 mma.sync and cp.async need Ampere."""
    class FakeCudaTensor:  # what use_kernels reads of a tensor
        is_cuda, device = True, torch.device("cuda:0")

    monkeypatch.setattr(kernels, "cupy_works", lambda: True)
    for capability, runs in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        kernels._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        monkeypatch.setenv("DSV2_BACKEND", "auto")
        assert kernels.use_kernels(FakeCudaTensor()) is runs, capability
        monkeypatch.setenv("DSV2_BACKEND", "cuda")
        if runs:
            assert kernels.use_kernels(FakeCudaTensor())
        else:
            with pytest.raises(RuntimeError, match="cuda:0 has compute capability 7.5; the kernels need 8.0 or newer"):
                kernels.use_kernels(FakeCudaTensor())
    kernels._capability.cache_clear()


def test_linear_is_f_linear_on_the_cpu():
    """Off the GPU the dense GEMV never applies: Linear and gemv.linear are F.linear."""
    from dsv2_lib.model.layers import Linear
    from dsv2_lib.ops.gemv import gemv_applies, linear

    torch.manual_seed(0)
    x, layer = torch.randn(1, 64).bfloat16(), Linear(64, 24).bfloat16()
    layer.weight.data.normal_()
    assert not gemv_applies(x, layer.weight)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert torch.equal(linear(x, layer.weight), layer(x))


def test_a_header_change_changes_the_compiled_source(tmp_path, monkeypatch):
    """CuPy's on-disk cache is keyed by the source text; a header edit must give a new text."""
    (tmp_path / "k.cu").write_text('#include "h.cuh"\n__global__ void k() {}\n')
    (tmp_path / "h.cuh").write_text("#define N 1\n")
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    kf = kernels.KernelFile("k.cu", ("k",))
    before = kernels._source(kf)
    (tmp_path / "h.cuh").write_text("#define N 2\n")
    assert kernels._source(kf) != before and kernels._source(kf).startswith('#include "h.cuh"')
