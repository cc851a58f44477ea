"""Programmatic dependent launch on the GPU (``pytest -m gpu``): every engine kernel begins with
``wait_for_prior_grids()`` and, on a Hopper GPU, is launched so that it may start while the kernel ahead of
it is finishing (``kernels.launch_dependent``). A chain of such launches, each reading what the one before
wrote, gives the same bits as ordinary launches, eagerly and replayed from a CUDA graph."""
import numpy as np
import pytest
import torch

from dsv2_lib.core import dependent_launch, kernels
from dsv2_lib.ops import norm
from dsv2_lib.ops.norm import fused_add_rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_on")]
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="programmatic dependent launch needs compute capability 9.0")


def chain(x, residual, w, steps):
    """``steps`` fused add + RMSNorm launches, each reading the previous one's output and residual."""
    for _ in range(steps):
        x, residual = fused_add_rms_norm(x, residual, w, 1e-6)
    return x, residual


@hopper
def test_a_chain_of_dependent_launches_equals_ordinary_launches(monkeypatch):
    torch.manual_seed(0)
    x0 = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)  # large enough to overlap the next launch
    r0 = torch.randn_like(x0)
    w = (1 + 0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    runs, used, real = {}, [], kernels.launch_dependent
    monkeypatch.setattr(kernels, "launch_dependent", lambda *a: (used.append(a[0]), real(*a)))
    for dependent in (False, True):
        monkeypatch.setattr(kernels, "_launchers", {})  # the launcher is chosen at a kernel's first launch
        monkeypatch.setattr(kernels, "programmatic_launch_supported", lambda index, on=dependent: on)
        used.clear()
        runs[dependent] = chain(x0.clone(), r0.clone(), w, 40)
        torch.cuda.synchronize()
    assert len(used) == 40  # the dependent run: every launch dependent
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))


@hopper
@pytest.mark.cuda_graph
def test_dependent_launches_replay_from_a_cuda_graph():
    torch.manual_seed(1)
    x, r = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16), torch.randn(64, 2048, device="cuda",
                                                                                   dtype=torch.bfloat16)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    want = chain(x.clone(), r.clone(), w, 30)
    xs, rs = x.clone(), r.clone()
    chain(xs.clone(), rs.clone(), w, 1)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(xs, rs.clone(), w, 30)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0])


@hopper
def test_a_failed_dependent_launch_raises_with_the_driver_error(monkeypatch):
    """The driver's error code comes back as its name, with the launch's shape. (The launch is refused by a
    stand-in for cuLaunchKernelEx: a real failed launch would count as an error in the sanitizer runs.)"""
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    fn = norm.RMSNORM_CU.function("rms_norm<__nv_bfloat16, true>", x.device)
    args = (kernels.ptr(x), kernels.ptr(x), kernels.ptr(w), np.int32(2048), np.int64(2048), np.int64(2048),
            np.float32(1e-6))
    launch_ex, config, attribute, error_name = dependent_launch._driver()
    refuse = lambda *a: 1  # noqa: E731 (CUDA_ERROR_INVALID_VALUE)
    monkeypatch.setattr(dependent_launch, "_driver", lambda: (refuse, config, attribute, error_name))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(CUDA error 1\), "
                                           r"grid \(2,\), block \(256,\)"):
        kernels.launch_dependent(fn, (2,), (256,), args)
    with pytest.raises(TypeError, match="kernel argument of type int: pass numpy"):
        kernels.launch_dependent(fn, (2,), (256,), (*args[:3], 2048, *args[4:]))
