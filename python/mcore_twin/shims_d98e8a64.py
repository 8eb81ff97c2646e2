"""Runtime shims so Megatron-Core d98e8a64 (Aug 2026) imports and runs on Debian torch 1.13 CPU.

Derived from the January pin's mcore_shims.py (93ddc247); same interface: import this module
before any megatron module, then call post_import_patches() after megatron.core.parallel_state
is imported (and the model-parallel state initialised). PATCHES lists what was applied.
None of these patches changes a layer's numerics. Shims 1-11 are the pin's, unchanged except
that the pin's shims 9 and 10 are dropped (fixed upstream); the
only ones on a layer's run path are placement (6: CUDA -> CPU), CPU no-op streams (11), eager
jit_fuser (2) and torch.nn.RMSNorm (7: a port of ATen's rms_norm). Shims 12-17 are new for
d98e8a64 and are all import-time: they stub modules / attributes touched only at import, or by
inference / checkpointing / torch.compile / float8 / FSDP / symmetric-memory / triton code.
(Everything here was checked necessary: without any one of them the import or a layer fails.)"""
import sys, types
import torch
import torch.distributed as dist

PATCHES = []

def _note(msg):
    PATCHES.append(msg)

# 1. torch.distributed._coalescing_manager (torch>=2.0) used only by DDP grad buffers
if not hasattr(dist, "_coalescing_manager"):
    import contextlib
    @contextlib.contextmanager
    def _coalescing_manager(*a, **k):
        yield None
    dist._coalescing_manager = _coalescing_manager
    _note("torch.distributed._coalescing_manager: no-op context manager (only used by DDP buffers, not exercised)")

# 2. megatron.core.jit: torch 1.13 has no torch.compile, so jit_fuser falls back to
#    torch.jit.script which cannot compile methods such as TopKRouter._maintain_float32_expert_bias.
#    Replace the module by its own documented fallback (noop_decorator == disable_jit_fuser()).
_jit = types.ModuleType("megatron.core.jit")
def noop_decorator(func):
    return func
_jit.noop_decorator = noop_decorator
_jit.jit_fuser = noop_decorator
_jit.enable_jit_fuser = lambda: None
_jit.disable_jit_fuser = lambda: None
sys.modules["megatron.core.jit"] = _jit
_note("megatron.core.jit: stub module with jit_fuser = noop_decorator (same as disable_jit_fuser(); eager math identical)")

# 3. torch.cuda.memory.CUDAPluggableAllocator (torch>=2.0) imported at module level by
#    megatron.core.inference.unified_memory (inference-only, never used here). Dummy class.
import torch.cuda.memory as _tcm
if not hasattr(_tcm, "CUDAPluggableAllocator"):
    class CUDAPluggableAllocator:  # pragma: no cover
        def __init__(self, *a, **k):
            raise RuntimeError("CUDAPluggableAllocator unavailable (shim)")
    _tcm.CUDAPluggableAllocator = CUDAPluggableAllocator
    _note("torch.cuda.memory.CUDAPluggableAllocator: dummy class (inference unified memory, unused)")

# 4. numpy.dtypes (numpy>=1.25) imported by megatron.core.safe_globals (checkpoint loading
#    allow-list, registration is skipped on torch<2.6 anyway). Provide UInt32DType.
import numpy as _np
try:
    import numpy.dtypes  # noqa: F401
except ImportError:
    _nd = types.ModuleType("numpy.dtypes")
    _nd.UInt32DType = type(_np.dtype("uint32"))
    sys.modules["numpy.dtypes"] = _nd
    _np.dtypes = _nd
    _note("numpy.dtypes: stub module with UInt32DType (only used for torch.load safe globals)")

# 5. torch.distributed.checkpoint (torch>=2.0) is imported at module level by checkpointing
#    code (megatron.core.dist_checkpointing / fsdp_dtensor_checkpoint / optimizer) that is
#    pulled in by `import megatron.core`. We never save/load checkpoints: auto-generated stub
#    modules whose attributes are inert placeholder classes.
import importlib.abc, importlib.machinery

# d98e8a64 adds (each imported at module level by code pulled in by `import megatron.core`):
#   torch.distributed._shard: exists in 1.13 but fails to import on Python 3.11 (a dataclass with a
#     mutable default in sharded_tensor/metadata.py); used by dist_checkpointing/strategies/torch.py.
#   torch.distributed.tensor / ._tensor / .device_mesh: DTensor / placements / init_device_mesh
#     (torch>=2.x), imported by megatron FSDP (distributed/fsdp/**) and optimizer code.
#   torch.distributed._symmetric_memory (torch>=2.5): imported at module level by megatron FSDP
#     experimental (parameter_group.py, dbuffer.py). Side effect: inference/symmetric_memory.py's
#     try-import now sets HAVE_TORCH_SYMM_MEM = True (inference NVLS buffers only; they still
#     refuse to initialise because triton is absent).
_STUB_PREFIXES = ["torch.distributed.checkpoint", "torch.distributed._shard",
                  "torch.distributed.tensor", "torch.distributed._tensor",
                  "torch.distributed.device_mesh", "torch.distributed._symmetric_memory"]  # add here if a later commit needs more

class _StubAttrMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _make_placeholder(name)

def _make_placeholder(name):
    def _init(self, *a, **k):
        raise RuntimeError(f"shim placeholder {name} is not usable on this torch")
    return _StubAttrMeta(name, (object,), {"__init__": _init})

class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        v = _make_placeholder(name)
        setattr(self, name, v)
        return v

class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        for p in _STUB_PREFIXES:
            if fullname == p or fullname.startswith(p + "."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None
    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m
    def exec_module(self, module):
        _note(f"stub module {module.__name__}")

sys.meta_path.insert(0, _StubFinder())


# 6. CUDA -> CPU device redirect. Megatron hard-codes device="cuda" /
#    torch.cuda.current_device() in allocation helpers (get_default_causal_mask,
#    GlobalMemoryBuffer, RotaryEmbedding.get_emb, MoE index buffers, ...). We map every
#    CUDA device request to CPU. Values are unchanged; only placement.
import functools

def _is_cuda_dev(d):
    if d is None:
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False

def _fix_device_kw(kwargs):
    if "device" in kwargs and _is_cuda_dev(kwargs["device"]):
        kwargs["device"] = "cpu"
    return kwargs

_FACTORIES = ["ones", "zeros", "empty", "full", "arange", "tensor", "rand", "randn", "randint",
              "randperm", "linspace", "eye", "as_tensor", "empty_strided", "ones_like",
              "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "logspace"]
for _name in _FACTORIES:
    _orig = getattr(torch, _name, None)
    if _orig is None:
        continue
    def _mk(orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            return orig(*args, **_fix_device_kw(kwargs))
        return wrapper
    setattr(torch, _name, _mk(_orig))

torch.cuda.current_device = lambda: "cpu"

_orig_to = torch.Tensor.to
def _to(self, *args, **kwargs):
    if args and _is_cuda_dev(args[0]) and not isinstance(args[0], torch.dtype):
        args = ("cpu",) + tuple(args[1:])
    return _orig_to(self, *args, **_fix_device_kw(kwargs))
torch.Tensor.to = _to
torch.Tensor.cuda = lambda self, *a, **k: self
torch.nn.Module.cuda = lambda self, *a, **k: self
_note("CUDA->CPU redirect: torch factory functions map device=cuda/int to cpu; "
      "torch.cuda.current_device() returns 'cpu'; Tensor.to(cuda)/Tensor.cuda()/Module.cuda() stay on cpu")


# 7. torch.nn.RMSNorm (torch>=2.4) used by WrappedTorchNorm for normalization="RMSNorm"
#    (the local spec falls back to WrappedTorchNorm when apex is absent).
#    Faithful port of ATen rms_norm (torch 2.4+ layer_norm.cpp):
#      eps cast to the input scalar type; x upcast to opmath (fp32 for bf16/fp16);
#      y = (x * rsqrt(mean(x^2, last dims) + eps)).type_as(x); y = y * weight
if not hasattr(torch.nn, "RMSNorm"):
    class RMSNorm(torch.nn.Module):
        def __init__(self, normalized_shape, eps=None, elementwise_affine=True,
                     device=None, dtype=None):
            super().__init__()
            if isinstance(normalized_shape, int):
                normalized_shape = (normalized_shape,)
            self.normalized_shape = tuple(normalized_shape)
            self.eps = eps
            self.elementwise_affine = elementwise_affine
            if elementwise_affine:
                self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, dtype=dtype))
            else:
                self.register_parameter("weight", None)
            self.reset_parameters()

        def reset_parameters(self):
            if self.weight is not None:
                torch.nn.init.ones_(self.weight)

        def forward(self, x):
            dims = tuple(range(-len(self.normalized_shape), 0))
            opmath = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            if self.eps is None:
                eps = torch.finfo(opmath).eps
            else:
                # scalar_t eps_val = eps.value(): rounded to the input dtype
                eps = float(torch.tensor(self.eps, dtype=x.dtype).item())
            xu = x.to(opmath)
            r = torch.rsqrt(xu.pow(2).mean(dims, keepdim=True) + eps)
            y = (xu * r).type_as(x)
            if self.weight is not None:
                y = y * self.weight
            return y

        def extra_repr(self):
            return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"

    torch.nn.RMSNorm = RMSNorm
    _note("torch.nn.RMSNorm: port of ATen rms_norm (torch>=2.4) for WrappedTorchNorm(RMSNorm)")


def post_import_patches():
    """Patches that need megatron modules to be importable."""
    import megatron.core.transformer.torch_norm as tn
    _orig = tn.is_torch_min_version
    def is_torch_min_version_rmsnorm(v, check_equality=True):
        # WrappedTorchNorm asserts torch>=2.4 only to get torch.nn.RMSNorm (shimmed above).
        if v == "2.4.0a0":
            return True
        return _orig(v, check_equality)
    tn.is_torch_min_version = is_torch_min_version_rmsnorm
    _note("megatron.core.transformer.torch_norm.is_torch_min_version('2.4.0a0') -> True "
          "(only gate for torch.nn.RMSNorm, provided by shim 7)")

    # 9. (pin only, dropped) is_te_min_version() crashing without TE: fixed upstream at
    #    d98e8a64 (get_te_version() returns Version("0.0.0") when TE is absent), and the pin's
    #    shim imported megatron.core.models.retro.config, which no longer exists (Retro removed).


# 8. torch.distributed.new_group(use_local_synchronization=..., group_desc=...) are torch>=2.x
#    keyword args; drop the ones torch 1.13 does not know (only affect group creation sync/logging).
import inspect as _inspect
_orig_new_group = dist.new_group
_ng_params = set(_inspect.signature(_orig_new_group).parameters)
def _new_group(*args, **kwargs):
    for k in list(kwargs):
        if k not in _ng_params:
            kwargs.pop(k)
    return _orig_new_group(*args, **kwargs)
dist.new_group = _new_group
_note("torch.distributed.new_group: drop kwargs unknown to torch 1.13 (use_local_synchronization, group_desc)")


# 10. (pin only, dropped) moe_utils' missing TE names: d98e8a64 defines them as None itself.


# 11. CUDA streams/events on CPU: MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream() for
#     device-to-host copies and synchronises on an event. On CPU everything is synchronous, so a
#     no-op stream/event object is semantically exact.
class _CpuEvent:
    def synchronize(self):
        pass
    def wait(self, *a, **k):
        pass
    def record(self, *a, **k):
        pass
    def query(self):
        return True

class _CpuStream:
    def __init__(self, *a, **k):
        pass
    def wait_stream(self, *a, **k):
        pass
    def wait_event(self, *a, **k):
        pass
    def record_event(self, event=None):
        return event or _CpuEvent()
    def synchronize(self):
        pass
    def query(self):
        return True

_CPU_STREAM = _CpuStream()
import contextlib as _ctx
torch.cuda.Stream = _CpuStream
torch.cuda.Event = _CpuEvent
torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
torch.cuda.default_stream = lambda *a, **k: _CPU_STREAM
torch.cuda.stream = lambda *a, **k: _ctx.nullcontext()
torch.cuda.synchronize = lambda *a, **k: None
_note("torch.cuda.Stream/Event/current_stream/stream/synchronize: CPU no-op objects "
      "(alltoall dispatcher DtoH side stream; CPU execution is synchronous)")


# ---------------------------------------------------------------------------------------------
# Shims new for d98e8a64 (not needed by the January pin).

# 12. Newer torch dtypes read at import time as dict values / default arguments, e.g.
#     inference/quantization/mxfp8_tensor.py:47 {"triton": torch.float8_e8m0fnu} (MXFP8 inference
#     quantization). torch 1.13 has no such dtype, so no tensor can ever have it: a unique
#     placeholder object compares unequal to every real dtype (the answer 1.13 semantics give) and
#     raises if anyone tries to use it as a dtype (tensor.to / view / empty(dtype=...)).
class _MissingDtype:
    def __init__(self, name):
        self._name = name
    def __repr__(self):
        return f"torch.{self._name} (shim placeholder: not in torch {torch.__version__})"

for _dt in ["float8_e8m0fnu"]:  # add here if a later commit needs more
    if not hasattr(torch, _dt):
        setattr(torch, _dt, _MissingDtype(_dt))
        _note(f"torch.{_dt}: placeholder object (read at import by inference/float8 code; "
              "never equal to a real dtype, unusable as one)")

# 13. torch.distributed.DeviceMesh (torch>=2.2) is imported by name from torch.distributed at
#     module level by megatron FSDP / optimizer modules (type hints, isinstance checks). An inert
#     placeholder class: never instantiated on this path; isinstance(x, DeviceMesh) is False.
if not hasattr(dist, "DeviceMesh"):
    dist.DeviceMesh = _make_placeholder("DeviceMesh")
    _note("torch.distributed.DeviceMesh: inert placeholder class (FSDP / optimizer type hints)")

# 14. torch.compile (torch>=2.0) is applied as a bare decorator at class-definition time:
#     transformer/moe/router.py:923 (InferenceTopKRouter, inference only) and
#     transformer/hyper_connection.py:216..395 (hyper connections, off unless configured).
#     Identity decorator (both @torch.compile and @torch.compile(...) forms): the function runs
#     eagerly, which is the reference semantics torch.compile is meant to preserve. Neither
#     decorated function is on the path of the layers run here. (torch.compiler.disable, used by
#     megatron FSDP methods, is not reached by `import megatron.core`: not shimmed.)
if not hasattr(torch, "compile"):
    def _compile(model=None, *args, **kwargs):
        if model is None:
            return lambda fn: fn
        return model
    torch.compile = _compile
    _note("torch.compile: identity decorator (import-time decorator on inference router / hyper "
          "connections; eager semantics)")

# 15. torch.optim.optimizer.ParamsT (torch>=2.1): a typing alias used in type hints of
#     optimizer/emerging_optimizers.py (imported by `import megatron.core`). Same alias as torch's.
import torch.optim.optimizer as _topt
if not hasattr(_topt, "ParamsT"):
    from typing import Any as _Any, Dict as _Dict, Iterable as _Iterable, Union as _Union
    _topt.ParamsT = _Union[_Iterable[torch.Tensor], _Iterable[_Dict[str, _Any]]]
    _note("torch.optim.optimizer.ParamsT: typing alias (type hints only)")

# 16. torch.cuda.MemPool (torch>=2.6) appears in a class-level annotation evaluated at import
#     (distributed/fsdp/src/megatron_fsdp/experimental/parameter_group.py:87
#     `_symm_mem_pool: torch.cuda.MemPool | None`); otherwise used by the NCCL user-buffer
#     allocator (nccl_allocator.py) and inference unified memory. Inert placeholder class.
if not hasattr(torch.cuda, "MemPool"):
    torch.cuda.MemPool = _make_placeholder("MemPool")
    _note("torch.cuda.MemPool: inert placeholder class (import-time annotation; NCCL UB / UVM only)")

# 17. triton, scoped. transformer/moe/ops/paged_stash.py (pulled in by `import megatron.core`
#     via pipeline_parallel/schedules.py -> transformer/moe/paged_stash.py) does an unguarded
#     `import triton` and applies @triton.jit at import. Its two kernels run only with
#     config.moe_paged_stash=True (TE grouped-MLP path; default False). A stub `triton` module is
#     put in sys.modules ONLY while the modules listed in _TRITON_IMPORTERS execute, then removed,
#     so every guarded `try: import triton` elsewhere still sees ImportError and all HAVE_TRITON
#     flags keep their real value (False). In the stub, triton.jit / autotune / heuristics are
#     identity decorators and triton.language attributes are inert placeholders (annotations
#     like `X: tl.constexpr`); calling a stubbed kernel (kernel[grid](...)) raises.
_TRITON_IMPORTERS = {"megatron.core.transformer.moe.ops.paged_stash"}  # add here if a later commit needs more

def _identity_decorator(fn=None, *a, **k):
    if fn is None or not callable(fn):
        return lambda f: f
    return fn

_triton = _StubModule("triton")
_triton.__path__ = []
_triton.__version__ = "0.0.0+shim"
_triton.jit = _identity_decorator
_triton.autotune = lambda *a, **k: (lambda f: f)
_triton.heuristics = lambda *a, **k: (lambda f: f)
_triton.cdiv = lambda a, b: (a + b - 1) // b
_tl = _StubModule("triton.language")
_tl.__path__ = []
_triton.language = _tl

class _ScopedTritonFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TRITON_IMPORTERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module
        def exec_module(module, _real=real_exec):
            saved = {k: sys.modules.get(k) for k in ("triton", "triton.language")}
            sys.modules["triton"], sys.modules["triton.language"] = _triton, _tl
            try:
                _real(module)
            finally:
                for k, v in saved.items():
                    if v is None:
                        sys.modules.pop(k, None)
                    else:
                        sys.modules[k] = v
            _note(f"{fullname}: imported with a scoped triton stub (jit = identity; kernels unusable)")
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _ScopedTritonFinder())
