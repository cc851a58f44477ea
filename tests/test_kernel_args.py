"""Kernel arguments and shared constants, checked without a GPU.

Every launch in ``dsv2_lib/ops`` and ``dsv2_lib/lessons`` names its arguments; read from the source (the AST),
each call site's names must be exactly the ``__global__`` parameters of every kernel it may launch, and every
declared kernel must have a call site. Each kernel file's ``-D`` defines must be the ``DSV2_...`` macros its
source (with its headers) uses, and the loader must hand them to NVRTC.
"""
import ast
import contextlib
import importlib
import pkgutil
import re
import sys
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

import dsv2_lib
from dsv2_lib.core import kernels

PACKAGE = Path(dsv2_lib.__file__).parent
SOURCES = sorted([*PACKAGE.glob("ops/*.py"), *PACKAGE.glob("lessons/*.py")])


def kernel_files() -> dict[str, kernels.KernelFile]:
    for mod in pkgutil.walk_packages(dsv2_lib.__path__, "dsv2_lib."):
        importlib.import_module(mod.name)  # modules declare their kernels on import
    return kernels.KERNEL_FILES


class Sources:
    """The scanned modules' ASTs: every function by name, every call with the function it sits in."""

    def __init__(self, paths):
        self.functions = defaultdict(list)  # name -> [FunctionDef]
        self.calls = []                     # (Call, enclosing FunctionDef or None, path)
        for path in paths:
            self._walk(ast.parse(path.read_text()), None, path)

    def _walk(self, node, fn, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[child.name].append(child)
                self._walk(child, child, path)
            else:
                if isinstance(child, ast.Call):
                    self.calls.append((child, fn, path))
                self._walk(child, fn, path)

    # ---- what a name expression can be: the kernels' base names --------------------------------------
    def kernel_names(self, node, fn) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value.split("<")[0].strip()}
        if isinstance(node, ast.JoinedStr):
            first = node.values[0]
            if isinstance(first, ast.Constant):
                return {first.value.split("<")[0].strip()}
            return self.kernel_names(first.value, fn)
        if isinstance(node, ast.Name):
            values = self._assigned(node.id, fn)
            if values:
                return set().union(*(self.kernel_names(v, fn) for v in values))
            return set().union(*(self.kernel_names(arg, caller) for arg, caller in self._passed(node.id, fn)))
        if isinstance(node, ast.Call):
            return set().union(*(self.kernel_names(r, callee) for callee, r in self._returns(node)))
        raise AssertionError(f"cannot tell which kernel {ast.unparse(node)!r} names: write a literal or an f-string")

    # ---- which names a keyword splat (**x) carries ------------------------------------------------------
    def dict_keys(self, node, fn, index: int | None = None) -> frozenset[str]:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            return self.keywords(node, fn)
        if isinstance(node, ast.Dict):
            return frozenset(k.value for k in node.keys)
        if isinstance(node, ast.Tuple) and index is not None:
            return self.dict_keys(node.elts[index], fn)
        if isinstance(node, ast.Name):
            found = {self.dict_keys(v, fn, i) for v, i in self._assigned_at(node.id, fn)}
            assert len(found) == 1, f"{node.id}: assigned dicts with different names {found}"
            return found.pop()
        if isinstance(node, ast.Call):
            found = {self.dict_keys(r, callee, index) for callee, r in self._returns(node)}
            assert len(found) == 1, f"{ast.unparse(node)}: returns dicts with different names {found}"
            return found.pop()
        raise AssertionError(f"cannot tell which names **{ast.unparse(node)} holds")

    def keywords(self, call, fn, skip=()) -> frozenset[str]:
        names = set()
        for kw in call.keywords:
            if kw.arg is None:
                names |= self.dict_keys(kw.value, fn)
            elif kw.arg not in skip:
                names.add(kw.arg)
        return frozenset(names)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _assigned_at(self, name, fn):
        """(value, tuple index or None) of every assignment to ``name`` in ``fn``."""
        out = []
        for node in ast.walk(fn) if fn is not None else ():
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == name:
                        out.append((node.value, None))
                    elif isinstance(target, ast.Tuple):
                        out += [(node.value, i) for i, e in enumerate(target.elts)
                                if isinstance(e, ast.Name) and e.id == name]
        return out

    def _assigned(self, name, fn):
        return [value for value, index in self._assigned_at(name, fn) if index is None]

    def _passed(self, param, fn):
        """(argument, caller) for every call of ``fn`` that passes its parameter ``param``."""
        names = [a.arg for a in fn.args.args]
        assert param in names, f"{param!r} is neither assigned in nor a parameter of {fn.name}"
        i, out = names.index(param), []
        for call, caller, _ in self.calls:
            if _callee_name(call) == fn.name:
                args = [k.value for k in call.keywords if k.arg == param] or call.args[i : i + 1]
                out += [(arg, caller) for arg in args]
        assert out, f"no call of {fn.name} passes {param!r}"
        return out

    def _returns(self, call):
        name = _callee_name(call)
        assert name in self.functions, f"{ast.unparse(call)}: not a function of the scanned modules"
        return [(f, r.value) for f in self.functions[name] for r in ast.walk(f) if isinstance(r, ast.Return)]


def _callee_name(call):
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def is_kernel_file(receiver, fn, path) -> bool:
    """``receiver`` is a KernelFile of the module (``NORM_CU``, ``attention.ATTENTION_CU``), or a parameter
    annotated as one."""
    module = importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    dotted = all(isinstance(n, (ast.Name, ast.Attribute, ast.Load)) for n in ast.walk(receiver))
    try:
        if dotted and isinstance(eval(ast.unparse(receiver), vars(module)), kernels.KernelFile):
            return True
    except (NameError, AttributeError):  # a local name, not a module attribute
        pass
    return isinstance(receiver, ast.Name) and fn is not None and any(
        a.arg == receiver.id and a.annotation is not None and "KernelFile" in ast.unparse(a.annotation)
        for a in fn.args.args)


def launch_sites():
    """(kernel base names, argument names, where) for every ``KernelFile.launch`` call in ops and lessons."""
    src = Sources(SOURCES)
    sites = []
    for call, fn, path in src.calls:
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "launch"):
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
        if isinstance(func.value, ast.Name) and func.value.id == "kernels":  # the positional primitive
            bound = call.args[3] if len(call.args) > 3 else None
            assert isinstance(bound, ast.Call) and _callee_name(bound) == "bind", \
                f"{where}: kernels.launch with positional arguments; name them (KernelFile.launch or kernels.bind)"
            continue
        if not is_kernel_file(func.value, fn, path):
            continue
        assert len(call.args) == 4, f"{where}: launch(name, device, grid, block, **arguments)"
        sites.append((src.kernel_names(call.args[0], fn), src.keywords(call, fn, skip=("shared_mem",)), where))
    return sites


def test_every_launch_names_exactly_its_kernels_parameters():
    files = kernel_files()
    declared = {(kf.filename, name.split("<")[0].strip()): kf.params(name)
                for kf in files.values() for name in kf.names}
    launched = set()
    sites = launch_sites()
    assert len(sites) > 30
    for bases, names, where in sites:
        for base in bases:
            matches = {key: params for key, params in declared.items() if key[1] == base}
            assert matches, f"{where}: launches {base!r}, which no kernel file declares"
            for (filename, _), params in matches.items():
                missing, unknown = sorted(set(params) - names), sorted(names - set(params))
                assert not missing and not unknown, (f"{where}: {base} ({filename}) takes {params}; the launch "
                                                     f"misses {missing} and names unknown {unknown}")
                launched.add((filename, base))
    assert set(declared) == launched, f"declared kernels never launched: {sorted(set(declared) - launched)}"


def test_the_exercises_launch_by_their_signatures():
    src = Sources([PACKAGE / "lessons" / "kernel_exercises.py"])
    from dsv2_lib.lessons import kernel_exercises

    binds = [(call, fn) for call, fn, _ in src.calls if _callee_name(call) == "bind"]
    assert len(binds) == len(kernel_exercises.KERNEL_EXERCISES)
    for call, fn in binds:
        params = getattr(kernel_exercises, call.args[0].id)
        assert src.dict_keys(call.args[1], fn) == set(params)


def test_bind_orders_by_the_signature_and_refuses_a_wrong_name():
    params = ("out", "x", "n")
    assert kernels.bind(params, dict(n=3, x=2, out=1), "k", "f.cu") == (1, 2, 3)
    with pytest.raises(TypeError, match=r"f\.cu: k: unknown argument 'nn' \(did you mean 'n'\?\); "
                                        r"missing argument 'n'; its parameters are \(out, x, n\)"):
        kernels.bind(params, dict(out=1, x=2, nn=3), "k", "f.cu")
    with pytest.raises(TypeError, match="unknown argument 'y'; its parameters"):
        kernels.bind(params, dict(out=1, x=2, n=3, y=4), "k", "f.cu")


def test_the_launch_path_orders_the_arguments_and_refuses_a_misspelled_one(monkeypatch):
    """A real kernel file: a first launch checks the names before anything is compiled (no GPU needed), and a
    later one, through the kept parameter order, refuses a wrong name too."""
    from dsv2_lib.ops import norm

    cuda, name = torch.device("cuda", 0), "rms_norm<float, true>"
    args = dict(eps=np.float32(1e-6), x=np.uint64(2), w=np.uint64(3), out=np.uint64(1), dim=np.int32(8),
                stride=np.int64(8))
    misspelled = r"rmsnorm\.cu: rms_norm<float, true>: unknown argument 'out_strid' \(did you mean 'out_stride'\?\); " \
                 r"missing argument 'out_stride'"
    with pytest.raises(TypeError, match=misspelled):
        norm.RMSNORM_CU.launch(name, cuda, (1,), (32,), out_strid=np.int64(9), **args)
    with pytest.raises(KeyError, match="rms_norm<double, true>' is not declared"):
        norm.RMSNORM_CU.launch("rms_norm<double, true>", cuda, (1,), (32,), out_stride=np.int64(9), **args)

    launched = []  # now as if compiled: the launch primitive gets the values in signature order
    monkeypatch.setitem(kernels._functions, ("rmsnorm.cu", name, 0), "compiled")
    monkeypatch.setattr(kernels, "launch", lambda fn, grid, block, values, shared_mem: launched.append((fn, values)))
    monkeypatch.setattr(kernels, "launch_dependent",
                        lambda fn, grid, block, values, shared_mem: launched.append(("dependent", fn, values)))
    values = (1, 2, 3, 8, 8, 9, np.float32(1e-6))
    assert norm.RMSNORM_CU.waits(name)  # rms_norm begins with wait_for_prior_grids()
    for hopper in (False, True):  # a waiting kernel is a programmatic dependent launch where the GPU has it
        monkeypatch.setattr(kernels, "_launchers", {})
        monkeypatch.setattr(kernels, "programmatic_launch_supported", lambda index: hopper)
        for _ in range(2):
            norm.RMSNORM_CU.launch(name, cuda, (1,), (32,), out_stride=np.int64(9), **args)
    assert launched == [("compiled", values)] * 2 + [("dependent", "compiled", values)] * 2
    with pytest.raises(TypeError, match=misspelled):
        norm.RMSNORM_CU.launch(name, cuda, (1,), (32,), out_strid=np.int64(9), **args)
    with pytest.raises(TypeError, match="unknown argument 'extra'"):
        norm.RMSNORM_CU.launch(name, cuda, (1,), (32,), out_stride=np.int64(9), extra=0, **args)


def test_signatures_are_read_from_the_file_and_its_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(kernels, "_params", {})
    (tmp_path / "h.cuh").write_text("template <int N> __global__ void __launch_bounds__(32 * (N + 1), 2)\n"
                                    "in_header(float* __restrict__ out /* [n] */, const Pair<int, float> p,\n"
                                    "          int n) {}\n")
    (tmp_path / "k.cu").write_text('#include "h.cuh"\n// __global__ void commented_out(int a)\n'
                                   "__global__ void k(const float* x,  // [n, 4]\n    int n, float scale[2]) {}\n")
    (tmp_path / "bad.cu").write_text("__global__ void bad(float* in) {}\n")
    assert kernels._signatures(tmp_path / "k.cu") == {"k": ("x", "n", "scale"), "in_header": ("out", "p", "n")}
    kf = kernels.KernelFile("k.cu", ("in_header<3>", "k"))
    assert kf.params("in_header<3>") == ("out", "p", "n")
    with pytest.raises(ValueError, match="parameter 'in' cannot be a keyword argument"):
        kernels._signatures(tmp_path / "bad.cu")


def test_a_kernel_waits_when_its_body_calls_wait_for_prior_grids(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_DIR", tmp_path)
    (tmp_path / "h.cuh").write_text("template <int N> __global__ void __launch_bounds__(32 * (N + 1))\n"
                                    "in_header(float* out) {\n    wait_for_prior_grids();\n    if (N) { out[0] = 1; }\n}\n")
    (tmp_path / "k.cu").write_text('#include "h.cuh"\n__global__ void plain(float* x) { if (x) { x[0] = 0; } }\n'
                                   "__global__ void later(float* x) { x[1] = 0; }  // wait_for_prior_grids();\n"
                                   "__global__ void last(float* x) { { x[0] = 2; } wait_for_prior_grids ( ); }\n")
    assert kernels._waiting_kernels(tmp_path / "k.cu") == {"in_header", "last"}  # a comment is not a call


def test_every_engine_kernel_waits_for_prior_grids_first():
    """Each engine kernel is a programmatic dependent launch on Hopper: its first statement must be the wait
    (common.cuh), or it could read what the kernel ahead of it has not finished writing."""
    for filename, kf in kernel_files().items():
        if filename.startswith("lessons/"):
            continue
        for text in kernels._texts(kernels.KERNEL_DIR / filename):
            text = kernels._COMMENT.sub(" ", text)
            for m in kernels._GLOBAL.finditer(text):
                body = text[text.index("{", m.end()) + 1 :].lstrip()
                assert body.startswith("wait_for_prior_grids();"), f"{filename}: {m[1]} does not begin with the wait"
        assert all(kf.waits(name) for name in kf.names), filename


def test_each_file_defines_exactly_the_macros_its_source_uses():
    for filename, kf in kernel_files().items():
        used = set(re.findall(r"\bDSV2_[A-Z0-9_]+", "".join(kernels._texts(kernels.KERNEL_DIR / filename))))
        assert used == {name for name, _ in kf.defines}, f"{filename}: uses {sorted(used)}, defines {kf.defines}"


def test_declare_refuses_a_define_that_could_clash_with_cuda_names():
    with pytest.raises(ValueError, match="define WARPS=4: want a DSV2_... name and an int"):
        kernels.declare("x.cu", ["k"], {"WARPS": 4})
    with pytest.raises(ValueError, match="define DSV2_ON=True"):
        kernels.declare("x.cu", ["k"], {"DSV2_ON": True})
    assert "x.cu" not in kernels.KERNEL_FILES


def test_the_loader_hands_the_defines_to_nvrtc(monkeypatch):
    """NVRTC gets the defines as options, which CuPy's compile cache keys on (cupy/cuda/compiler.py:
    ``_compile_with_cache_cuda`` hashes ``(arch, options, ...)`` with the source)."""
    from dsv2_lib.ops import gemv

    seen = {}

    class RawModule:
        def __init__(self, code, options, name_expressions):
            seen.update(code=code, options=options, names=name_expressions)

        def compile(self):
            pass

    cuda = types.SimpleNamespace(Device=lambda i: contextlib.nullcontext())
    fake = types.SimpleNamespace(RawModule=RawModule, cuda=cuda)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    kernels._compiled.__wrapped__(gemv.GEMV_CU, 0)
    assert f"-DDSV2_GEMV_WARPS={gemv.WARPS}" in seen["options"] and "--gpu-architecture=sm_90" in seen["options"]
    assert seen["names"] == gemv.GEMV_CU.names
