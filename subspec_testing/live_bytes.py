"""Peak bytes of live tensors on CPU, where there are no allocator statistics: what a test
reads to bound a computation's temporary memory."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the mode and still alive (CPU: no allocator
    statistics). A view shares its base's storage and is not counted again."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if ptr in inputs or ptr in self.storages or size == 0:
                continue
            self.storages.add(ptr)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr, size)
        return out

    def _free(self, ptr: int, size: int) -> None:
        self.storages.discard(ptr)
        self.live -= size
