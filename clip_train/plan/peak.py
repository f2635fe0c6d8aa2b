"""The peak bytes of the storages a pass creates: activations and temporaries, without the
parameters, buffers and gradients that exist before it.

torch's MemTracker gives the same figure but re-sums every live storage at each operator, which
made a ViT-L/14 chunk a minute of the plan's time on a CPU. Here each new storage adds its bytes
once and a finalizer takes them off when it is freed, so an operator costs O(its outputs)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class NewStoragePeak(TorchDispatchMode):
    """``with NewStoragePeak() as peak: ...`` then ``peak.bytes``: the most bytes that storages
    created inside the block held at once. A storage counts from the operator that creates it to its
    release; views and in-place results are not new storages."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.bytes = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or any(r.alias_info for r in func._schema.returns):
            return out  # writes into an existing tensor, or a view of one
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor.untyped_storage())
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.bytes = max(self.bytes, self.live)
        weakref.finalize(storage, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size
