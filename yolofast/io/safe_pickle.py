"""A restricted unpickler for ``torch.load(path, pickle_module=safe_pickle, weights_only=False)``.

A ``.pt`` file is a pickle, and a pickle may name any importable callable (``os.system``, ``builtins.eval``)
and call it while it loads. This module decides, per global the pickle names, what it gets:

* torch's tensor-rebuild functions and ``torch.Size`` / dtypes (storages are resolved by torch itself);
* plain containers (``collections.OrderedDict``, ``set``, ``frozenset``, ...) and numpy's array rebuild
  (the RNG state of older yolofast checkpoints holds a numpy array);
* every class of ``ultralytics.*``, ``yolofast.*`` and ``torch.nn.*`` -> an inert :class:`Stub` subclass
  of the same name that only stores what the pickle gives it (``__dict__``: ``_modules``, ``_parameters``,
  ``_buffers``, ``yaml``, ``names``, ...). No module of those packages is imported, so Ultralytics need not be
  installed and none of its code (or of a file posing as it) runs;
* anything else -> :class:`UnsafeCheckpointError` naming the global.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import codecs
import collections
import copyreg
import pickle

import torch

from yolofast.io.errors import UnsafeCheckpointError

__all__ = ["Stub", "Unpickler", "load", "loads", "stub_name", "STUB_PACKAGES"]

# Classes of these packages become stubs (module paths as pickled; "__main__" is not among them).
STUB_PACKAGES = ("ultralytics", "yolofast", "torch.nn")

_TORCH = {
    ("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                  "_rebuild_parameter", "_rebuild_parameter_with_state")
} | {("torch", "Size"), ("torch._tensor", "_rebuild_from_type_v2")}
_DTYPES = {str(d).removeprefix("torch.") for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}

_BUILTINS = {n: getattr(builtins, n) for n in (
    "set", "frozenset", "dict", "list", "tuple", "int", "float", "complex", "bool", "str", "bytes",
    "bytearray", "slice", "range")}
_PLAIN = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "deque"): collections.deque,
    ("copyreg", "_reconstructor"): copyreg._reconstructor,  # protocol 0/1 objects; its cls is checked too
    ("_codecs", "encode"): codecs.encode,  # protocol 2 writes bytes as encode(str, "latin1"): pure data
}


def _numpy_globals() -> dict:
    import numpy as np

    rebuild = np.zeros(1).__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it
    scalar = np.float64(0.0).__reduce__()[0]
    out = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):  # pickles of numpy 1.x and 2.x
        out[(mod, "_reconstruct")] = rebuild
        out[(mod, "scalar")] = scalar
    return out


class Stub:
    """An inert stand-in for a class the pickle names: it keeps the state it is given and does nothing.

    ``type(stub).__module__`` / ``__qualname__`` are the pickled ones, so the reader can tell a
    ``ultralytics.nn.modules.head.Segment`` from a ``Detect``; ``_reduce_args`` holds call arguments."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        self.__dict__["_reduce_args"] = args

    def __setstate__(self, state):
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if isinstance(part, dict):
                self.__dict__.update(part)
            elif part is not None:
                self.__dict__["_state"] = part

    def __repr__(self):
        return f"<stub {stub_name(self)}>"


_stub_classes: dict[tuple[str, str], type] = {}


def _stub(module: str, name: str) -> type:
    key = (module, name)
    if key not in _stub_classes:
        _stub_classes[key] = type(name, (Stub,), {"__module__": module, "__qualname__": name})
    return _stub_classes[key]


def stub_name(obj) -> str:
    """'ultralytics.nn.modules.head.Detect' for a stub instance (or a stub class)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _allowed(module: str, name: str):
    if module == "builtins" and name in _BUILTINS:
        return _BUILTINS[name]
    if (module, name) in _PLAIN:
        return _PLAIN[(module, name)]
    if (module, name) in _TORCH:
        mod = {"torch": torch, "torch._utils": torch._utils, "torch._tensor": torch._tensor}[module]
        return getattr(mod, name)
    if module == "torch" and name in _DTYPES:
        return getattr(torch, name)
    if module.split(".")[0] == "numpy" and (module, name) in _numpy_globals():
        return _numpy_globals()[(module, name)]
    if any(module == p or module.startswith(p + ".") for p in STUB_PACKAGES):
        return _stub(module, name)
    return None


class Unpickler(pickle.Unpickler):
    """pickle.Unpickler whose ``find_class`` only hands out the globals described in the module docstring."""

    def find_class(self, module, name):
        # Protocol-2 pickles (torch's default) name things as Python 2 did: __builtin__.set,
        # commands.Popen; map them back as pickle itself does, so the allow list and errors see real names.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"the checkpoint's pickle asks for '{module}.{name}', which yolofast does not load: a "
                f"checkpoint may hold only tensors, plain containers and model classes "
                f"({', '.join(p + '.*' for p in STUB_PACKAGES)}, read as inert data). Loading it could run "
                f"code; if you wrote this file yourself, save the weights as a state_dict instead")
        return found


def load(file, **kwargs):
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs):
    import io

    return Unpickler(io.BytesIO(data), **kwargs).load()
