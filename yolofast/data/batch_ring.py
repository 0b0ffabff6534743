"""Loader workers hand batches to the main process through shared-memory blocks that are reused.

Why: a fresh shared block per batch (torch's default, ~20 MB for 16 images at 640 px) costs its worker
~16 ms a batch on an AMD EPYC Zen 4 core (8 ms to allocate it in /dev/shm, 8 ms to fault its pages in
while stacking), about a quarter of the batch's augmentation. Each small tensor of the batch (targets)
is one more shared block and one more file descriptor sent over a socket.

How: each worker owns ``slots`` blocks, made on first use and sent to the main process once (torch's
file-descriptor passing); afterwards a batch names its block by number. A shared ``held`` flag per block
says that the main process may still read it: the worker sets it before writing the block, and only the
main process clears it, from a finalizer of the numpy array that its batch tensor (and every view of it)
keeps alive, so a block is never overwritten while any tensor of the main process still points into it.
When all of a worker's blocks are held, that batch takes a fresh block the old way (counted in
``fresh``): slower, never wrong. Small tensors travel inside the pickle, by value.
"""

from __future__ import annotations

import secrets
import weakref

import torch
from torch.utils.data import get_worker_info

__all__ = ["BatchRing"]

_RINGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # main process: token -> BatchRing
_BY_VALUE = 1 << 16  # bytes: contiguous tensors up to this size are pickled by value, not shared


def _fresh_block(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor in shared memory (as torch's default collate makes one per batch)."""
    storage = torch.UntypedStorage._new_shared(max(int(nbytes), 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class BatchRing:
    """``collate_fn`` for a DataLoader with ``workers`` worker processes: in a worker it calls
    ``collate(batch, alloc=...)`` with an allocator that hands out this worker's reusable blocks; in the
    main process (workers=0) it is ``collate`` itself.

    Build it in the main process before the workers start (the ``held`` flags and the ``fresh`` counter
    are shared tensors the workers inherit or receive when they start)."""

    def __init__(self, collate, workers: int, slots: int = 4):
        self.collate, self.slots = collate, int(slots)
        self.token = secrets.token_hex(8)
        self.held = torch.zeros(max(int(workers), 1) * self.slots, dtype=torch.int32).share_memory_()
        self.fresh = torch.zeros(max(int(workers), 1), dtype=torch.int64).share_memory_()
        self.blocks: dict[int, torch.Tensor] = {}  # main process: slot -> the block the worker sent
        self._own: dict[int, torch.Tensor] = {}  # worker: slot -> its block
        _RINGS[self.token] = self

    def __getstate__(self):  # to a worker started by spawn/forkserver: the flags, not the blocks
        return {"collate": self.collate, "slots": self.slots, "token": self.token, "held": self.held,
                "fresh": self.fresh}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.blocks, self._own = {}, {}

    def __call__(self, batch):
        info = get_worker_info()
        if info is None:
            return self.collate(batch)
        taken: list = []
        out = self.collate(batch, alloc=lambda shape, dtype: self._alloc(info.id, shape, dtype, taken))
        return _RingBatch(self.token, out, taken)

    def _alloc(self, wid: int, shape, dtype, taken: list) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` at the start of one of worker ``wid``'s free blocks (flagged held
        from now on), or in a fresh shared block when the main process holds them all."""
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        held = self.held.numpy()
        for slot in range(wid * self.slots, (wid + 1) * self.slots):
            if held[slot]:
                continue
            block = self._own.get(slot)
            new = block is None or block.numel() < nbytes
            if new:  # first use, or a larger batch than the block has seen (rect shapes): a new block,
                # whole 64-byte units so that the main process can view all of it as any dtype
                block = self._own[slot] = _fresh_block(-(-nbytes // 64) * 64)
            held[slot] = 1
            taken.append((slot, block, new))
            return block[:nbytes].view(dtype).view(shape)
        self.fresh[wid] += 1
        return _fresh_block(nbytes).view(dtype).view(shape)


class _RingBatch:
    """A worker's batch dict on its way to the main process: tensors in a ring block are sent as
    (slot, shape, stride, offset), small ones by value, others as torch sends them."""

    def __init__(self, token, batch, taken):
        self.token, self.batch, self.taken = token, batch, taken

    def __reduce__(self):
        ptrs = {block.untyped_storage().data_ptr(): slot for slot, block, _ in self.taken}
        items = {}
        for k, v in self.batch.items():
            if torch.is_tensor(v) and v.untyped_storage().data_ptr() in ptrs:
                items[k] = ("ring", ptrs[v.untyped_storage().data_ptr()], tuple(v.shape), v.stride(),
                            v.storage_offset(), v.dtype)
            elif torch.is_tensor(v) and v.nbytes <= _BY_VALUE and v.is_contiguous():
                items[k] = ("value", v.numpy())
            else:
                items[k] = ("plain", v)
        new = [(slot, block) for slot, block, is_new in self.taken if is_new]
        return _rebuild, (self.token, items, new)


def _release(held: torch.Tensor, slot: int) -> None:
    held.numpy()[slot] = 0  # the worker may now write this block again


def _rebuild(token, items, new_blocks):
    """Main process: the batch dict, with ring tensors as views of the worker's blocks whose last
    reference releases the block."""
    ring = _RINGS.get(token)
    if ring is None:
        raise RuntimeError("a loader batch arrived after its DataLoader was deleted")
    for slot, block in new_blocks:
        ring.blocks[slot] = block
    out, bases = {}, {}
    for k, item in items.items():
        if item[0] == "ring":
            _, slot, shape, stride, offset, dtype = item
            if slot not in bases:  # one base per block: its release must wait for every tensor in it
                arr = ring.blocks[slot].numpy()  # a new array: only the tensors below keep it alive
                weakref.finalize(arr, _release, ring.held, slot)
                bases[slot] = torch.from_numpy(arr)
            out[k] = bases[slot].view(dtype).as_strided(shape, stride, offset)
        elif item[0] == "value":
            out[k] = torch.from_numpy(item[1])
        else:
            out[k] = item[1]
    return out
