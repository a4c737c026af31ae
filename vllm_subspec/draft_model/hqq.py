"""HQQ's group quantizer (`quantize_groups`), solved in cache-sized chunks on every core the
process may use. Its codes, scales and zeros are bit-identical to HQQ 0.2.8.post1's
`HQQLinear.from_weights` with `BaseQuantizeConfig(nbits, group_size, axis=1)`
(tests/unit/test_hqq.py compares against the installed hqq), whatever the thread count.

Design: docs/substitutes.md, "The HQQ solver".
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

HQQ_RELEASE = "0.2.8.post1"  # the hqq whose numbers these are (the substitute cache's key)
LP_NORM, BETA, ITERS = 0.7, 10.0, 20  # hqq.core.optimize.optimize_weights_proximal_legacy

# Elements per chunk: its four fp32 buffers (1 MiB each) are reused for every chunk. Measured on
# an 8960x1536 weight, two pinned threads, torch at one thread (as in vLLM's CPU worker):
# 32K elements 1.8 s, 64K 1.4 s, 128K 1.2 s, 256K 1.1 s; smaller chunks lose to Python's
# per-operation cost under the GIL.
CHUNK_ELEMENTS = 262144

THREADS_ENV = "VLLM_SUBSPEC_QUANTIZE_THREADS"  # caps the solver's threads (default: every core)


@dataclasses.dataclass
class GroupQuantized:
    codes: torch.Tensor  # uint8 [G, group_size]
    scale: torch.Tensor  # float32 [G, 1], W = (codes - zero) * scale
    zero: torch.Tensor  # float32 [G, 1], fractional after the solve


def quantize_groups(
    groups: torch.Tensor, bits: int, optimize: bool, meta_dtype: torch.dtype
) -> GroupQuantized:
    """groups: [G, group_size], any float dtype. Scale and zero are rounded through
    `meta_dtype` (HQQLinear's compute dtype), as the substitutes HQQLinear built were."""
    solve_dtype = torch.float16 if groups.is_cuda else torch.float32
    w = groups.float()
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    max_v = 2**bits - 1
    denom = hi - lo
    inv_scale = max_v / denom
    inv_scale = torch.where(denom.abs() <= 1e-4, torch.full_like(inv_scale, 1.0), inv_scale)
    inv_scale = inv_scale.clamp(max=2e4)
    zero = -lo * inv_scale
    if bits == 4:  # round_zero, set for 4 bits only
        zero = torch.round(zero)
    if optimize:
        inv_scale, zero = _solve_zero(
            w.to(solve_dtype), inv_scale.to(solve_dtype), zero.to(solve_dtype), max_v
        )
    codes = torch.round(w * inv_scale + zero).clamp_(0, max_v)
    return GroupQuantized(
        codes=codes.to(torch.uint8),
        scale=(1.0 / inv_scale).to(meta_dtype).float(),
        zero=zero.to(meta_dtype).float(),
    )


def _solve_zero(w: torch.Tensor, inv_scale: torch.Tensor, zero: torch.Tensor, max_v: int):
    """HQQ's proximal zero-point solve; returns (inv_scale, zero) in float32."""
    n_groups, group_size = w.shape
    rows = n_groups if w.is_cuda else max(1, CHUNK_ELEMENTS // group_size)
    chunks = [(s, min(s + rows, n_groups)) for s in range(0, n_groups, rows)]
    errors = torch.empty(len(chunks), dtype=torch.float64)
    local = threading.local()

    def run(indices, zero_in, zero_out):
        bufs = getattr(local, "bufs", None)
        if bufs is None or bufs[0].shape[0] < rows or bufs[0].dtype != w.dtype:
            bufs = local.bufs = [w.new_empty(rows, group_size) for _ in range(4)]
        for i in indices:
            s, e = chunks[i]
            errors[i] = _step(
                w[s:e],
                inv_scale[s:e],
                zero_in[s:e],
                max_v,
                [b[: e - s] for b in bufs],
                zero_out[s:e],
            )

    best = float("inf")
    with _pool(enabled=not w.is_cuda) as (pool, lanes):
        shares = [range(t, len(chunks), lanes) for t in range(lanes)]
        for _ in range(ITERS):
            new_zero = torch.empty_like(zero)
            if pool is None:
                run(shares[0], zero, new_zero)
            else:
                for f in [pool.submit(run, share, zero, new_zero) for share in shares]:
                    f.result()
            zero = new_zero
            error = float(errors.sum()) / w.numel()  # mean |W - W_r| of this iteration's zero
            if error < best:
                best = error
            else:
                break
    return inv_scale.float(), zero.float()


def _step(w, inv_scale, zero, max_v, bufs, zero_out) -> torch.Tensor:
    """One chunk of `optimize_weights_proximal_legacy_step`, written into `bufs`; the new zero
    goes to zero_out, and the chunk's sum |W - W_r| (at the old zero) is returned."""
    wq, x, a, p = bufs
    torch.mul(w, inv_scale, out=wq)
    wq.add_(zero).round_().clamp_(0, max_v)  # W_q
    torch.sub(wq, zero, out=x)
    x.div_(inv_scale)  # W_r
    torch.sub(w, x, out=x)  # W_f - W_r
    torch.abs(x, out=a)
    error = a.sum(dtype=torch.float64)
    torch.pow(a, LP_NORM - 1, out=p)  # shrink_lp_op: sign(x) * relu(|x| - |x|^(p-1) / beta)
    p.mul_(1.0 / BETA)
    a.sub_(p).clamp_min_(0.0)
    a.mul_(torch.sign(x))  # W_e
    torch.sub(w, a, out=p)
    p.mul_(inv_scale)
    torch.sub(wq, p, out=p)
    torch.mean(p, 1, keepdim=True, out=zero_out)
    return error


class _pool:
    """`with _pool() as (pool, lanes)`: threads pinned one per usable core, or (None, 1)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        # torch already spreads each operation over its threads when it has one per core
        # (outside vLLM's CPU worker, which pins itself to its OMP cores)
        cpus = sorted(usable_cpus()) if self.enabled else [0]
        if len(cpus) <= torch.get_num_threads():
            cpus = cpus[:1]
        limit = os.environ.get(THREADS_ENV)
        if limit:
            cpus = cpus[: max(1, int(limit))]
        self.pool = None
        if len(cpus) <= 1:
            return None, 1
        slots = iter(cpus)
        lock = threading.Lock()

        def pin():
            with lock:
                cpu = next(slots)
            os.sched_setaffinity(0, {cpu})  # this thread only

        self.pool = ThreadPoolExecutor(len(cpus), thread_name_prefix="subspec-hqq", initializer=pin)
        return self.pool, len(cpus)

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown()


def usable_cpus() -> set[int]:
    """The cores this process may run on, not only those its calling thread is pinned to
    (vLLM's CPU worker pins its threads): a fresh thread widens its own affinity to every core
    and reads back what the kernel allows (the cgroup's cpuset)."""
    if not hasattr(os, "sched_setaffinity"):
        return {0}
    found: dict[str, set[int]] = {}

    def probe():
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError:
            pass
        found["cpus"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return found.get("cpus") or {0}
