"""Run gemlite 0.6.0.post2's real Triton kernels on CPU under the Triton interpreter (tests only).

Import this module only in a child process whose environment has TRITON_INTERPRET=1 *before*
triton is imported, with a `pip install --no-deps --target` copy of gemlite on sys.path. Then
`install()` answers the device queries gemlite makes at import and first use, and makes the
interpreter compute bf16 like a GPU does. Nothing of gemlite itself is patched: its kernels,
packers, autotune pruning and kernel choice run as shipped.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np

# What an H100 SXM reports (sm_90, 132 SMs, 227 KiB shared memory per block).
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
CAPABILITY = (9, 0)
NUM_SMS = 132
MAX_SHARED_MEM = 232448


def _check_environment() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before triton is imported")
    if "gemlite" in sys.modules:
        raise RuntimeError("install() must run before gemlite is imported")


def _patch_torch_cuda() -> None:
    import torch

    props = types.SimpleNamespace(
        name=DEVICE_NAME, multi_processor_count=NUM_SMS, major=CAPABILITY[0],
        minor=CAPABILITY[1], total_memory=80 * 2**30)
    # gemlite/triton_kernels/utils.py:10 (capability), :176 (SM count, at import),
    # :135/:144 and core.py:919 (device name picks the GPU's config file and feature flags).
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    torch.cuda.get_device_properties = lambda device=None: props
    # per-GPU buffers allocated at import (quant_utils.py:33, gemv_kernels.py:18): none here
    torch.cuda.device_count = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False  # gemv_revsplitK_kernels.py:469


class _FakeDriver:
    """The active Triton driver, as far as gemlite and triton's autotuner ask it anything."""

    def __init__(self):
        import torch
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", 90, 32)  # gemlite/triton_kernels/utils.py:125 (is_hip)
        self._cpu = torch.device("cpu")
        self._clock = iter(range(10**9, 0, -1))
        self.utils = types.SimpleNamespace(
            # gemlite/triton_kernels/utils.py:223 (shared memory bound for the config pruners)
            get_device_properties=lambda device=0: {
                "max_shared_mem": MAX_SHARED_MEM, "multiprocessor_count": NUM_SMS})

    def get_current_target(self):
        return self._target

    def get_benchmarker(self):
        # triton/runtime/autotuner.py (_bench -> do_bench): run each candidate config once and
        # report ever shorter times, so the autotuner keeps the *last* config it tried. For
        # GEMM_SPLITK that is the SPLIT_K=2 one (gemm_splitK_kernels.py:214-217): the split-K
        # accumulation path runs, not only the SPLIT_K=1 store.
        def bench(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            t = float(next(self._clock))  # shared: autotuner asks for a benchmarker per config
            return [t, t, t] if quantiles else t
        return bench

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return self._cpu

    def get_device_interface(self):
        import torch
        return torch.cuda


# ---- bf16 in the interpreter -------------------------------------------------------------------
# triton/runtime/interpreter.py stores bf16 as raw uint16 (_get_np_dtype: "bfloat16 types are
# stored as uint16") and runs numpy arithmetic on those bits; int<->bf16 casts reinterpret
# values as bits (cast_impl: astype) and fp32->bf16 truncates (_convert_float, rounding None).
# A GPU computes bf16 ops in fp32 and rounds to nearest even: emulate exactly that.

def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(np.asarray(values, dtype=np.float32)).view(np.uint32)
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def patch_interpreter_bf16() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    handle = interp.TensorHandle
    bf16, f32 = tl.bfloat16, tl.float32

    def is_bf16(h):
        return h.dtype.scalar == bf16

    def widen(h):
        return handle(_bf16_to_f32(h.data), f32) if is_bf16(h) else h

    def narrow(h):
        return handle(_f32_to_bf16(h.data), bf16)

    orig_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        src_bf, dst_bf = is_bf16(src), dst_type.scalar == bf16
        if not (src_bf or dst_bf):
            return orig_cast(self, src, dst_type)
        values = _bf16_to_f32(src.data) if src_bf else src.data
        if dst_bf:
            return handle(_f32_to_bf16(values.astype(np.float32)), bf16)
        return handle(values.astype(interp._get_np_dtype(dst_type)), dst_type.scalar)

    builder.cast_impl = cast_impl
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui",
                 "create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    orig_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if is_bf16(src) or dst_type.scalar == bf16:
            return self.cast_impl(src, dst_type)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp

    def binary(orig):
        def op(self, lhs, rhs):
            if not is_bf16(lhs):
                return orig(self, lhs, rhs)
            out = orig(self, widen(lhs), widen(rhs))
            if out.data.dtype == np.bool_:  # a comparison
                return handle(out.data, bf16)
            return narrow(out)
        return op

    for name in ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem",
                 "create_precise_divf", "create_approx_divf", "create_minimumf",
                 "create_maximumf", "create_minnumf", "create_maxnumf") + tuple(
                     n for n in vars(builder) if n.startswith("create_fcmp")):
        setattr(builder, name, binary(getattr(builder, name)))

    orig_unary = builder.unary_op

    def unary_op(self, arg, op):
        if not is_bf16(arg):
            return orig_unary(self, arg, op)
        return narrow(orig_unary(self, widen(arg), op))

    builder.unary_op = unary_op
    orig_fma = builder.create_fma

    def create_fma(self, x, y, z):
        if not is_bf16(z):
            return orig_fma(self, x, y, z)
        # fma.rn.bf16 rounds once: the float64 product and sum are exact here, and rounding
        # through fp32 to bf16 differs from one rounding only at exact fp32 ties
        a, b, c = (_bf16_to_f32(h.data).astype(np.float64) for h in (x, y, z))
        return handle(_f32_to_bf16((a * b + c).astype(np.float32)), bf16)

    builder.create_fma = create_fma
    orig_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 x bf16 products are exact in fp32; the accumulator d is fp32
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def _patch_interpreter_range() -> None:
    """gemm_kernels.py:417 `k_m = (k * stride_mul).to(tl.int32)`: compiled for a GPU, `k` from
    `tl.range` is an int32 tensor; the interpreter's tl.range (interpreter.py `_new_range`)
    yields Python ints, and int * float has no `.to`. Yield int32 scalar tensors instead, as
    the compiler would (tl.static_range keeps yielding ints: it is unrolled at compile time)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    orig_patch_core = interp._patch_lang_core

    def tensor_range(arg1, arg2=None, step=None, **kwargs):
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        for k in range(int(start), int(end), int(step or 1)):
            yield tl.tensor(interp.TensorHandle(np.array([k], dtype=np.int32), tl.int32),
                            tl.int32)

    def patch_core(lang, scope):
        orig_patch_core(lang, scope)
        scope.set_attr(lang, "range", tensor_range)

    interp._patch_lang_core = patch_core


def install():
    """Patch torch.cuda / triton for gemlite under the interpreter; return the gemlite module."""
    _check_environment()
    _patch_torch_cuda()
    from triton.runtime import driver

    driver.set_active(_FakeDriver())
    patch_interpreter_bf16()
    _patch_interpreter_range()
    import gemlite

    gemlite.set_autotune("default")  # one config per kernel: nothing to benchmark
    gemlite.set_native_atomic_bfp16(False)  # the interpreter has no bf16 atomic add
    return gemlite
