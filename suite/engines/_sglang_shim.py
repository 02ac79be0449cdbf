"""Explicit import shim for the ``sglang`` engine: a stand-in for ``torchvision`` during SGLang's import only.

Why: ``sglang.srt.layers.quantization.fp8_utils`` (and ``kv_cache``) reach, through ``sglang.srt.configs``, the
module-level imports ``import torchvision.transforms as T`` and ``from torchvision.transforms.functional import
InterpolationMode`` in ``sglang/srt/multimodal/internvl_utils.py`` (and ``from torchvision.transforms import
InterpolationMode`` in ``srt/configs/deepseek_ocr.py``) — image preprocessing for multimodal configs, unrelated to
FP8. PyPI's torchvision is a CUDA build that does not load beside CPU torch (``operator torchvision::nms does not
exist``), so the SGLang venv has none.

What the shim does (and nothing else):

* :func:`torchvision_stub` is a context manager. While it is active, a meta-path finder answers ``torchvision`` and
  ``torchvision.*`` **only** for ``import`` statements executed by a module whose ``__name__`` starts with
  ``sglang``, and only when no real torchvision is installed. It is invisible to ``importlib.util.find_spec`` (that
  call does not go through the import system's ``_find_and_load``), so transformers' availability probes keep
  seeing "no torchvision" (a fake module with a fake version breaks transformers).
* The stand-in modules are empty packages whose every public attribute is a placeholder that raises
  ``RuntimeError("torchvision stub ...")`` when called or inspected further: importing works, *using* torchvision
  does not. SGLang's FP8 code never uses it.
* On exit the finder is removed and the stand-in modules are taken out of ``sys.modules`` (the SGLang modules that
  bound them keep their references; any later torchvision import fails normally).
* Caveat, by construction of Python's import system: *while the block runs*, once SGLang has imported a stand-in it
  sits in ``sys.modules`` like any imported module, so ``importlib.util.find_spec("torchvision")`` (which consults
  ``sys.modules`` first) and any ``import torchvision`` see it until the block ends. The engine's block imports only
  SGLang's FP8 modules; transformers' cached ``is_torchvision_available()`` is evaluated (False) before the finder
  is installed so that no probe inside the window can cache a wrong answer.

Do NOT stub ``sgl_kernel``, ``flashinfer``, ``deep_gemm`` or ``aiter``: SGLang imports them inside ``try/except
ImportError`` and an empty stub would flip those guards to "available" (docs/triton-interpreter.md).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator

STUB_ROOT = "torchvision"
#: the attribute every stand-in module carries (tests and the engine check it)
MARKER = "__fp8rl_stub__"
_IMPORT_FRAMES = ("_find_and_load_unlocked",)


class _Placeholder:
    """A torchvision name that exists for ``from torchvision... import X`` but raises when used."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self):
        raise RuntimeError(f"torchvision stub (fp8rl sglang engine): {self._qualname} is not available; the stub "
                           "only satisfies SGLang's module-level imports")

    def __call__(self, *args, **kwargs):
        self._fail()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<fp8rl torchvision placeholder {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


def _importer_is_sglang() -> bool:
    """True if the import system is resolving this name for an ``import`` executed in an ``sglang*`` module.

    The finder must be called by ``importlib._bootstrap._find_spec`` called by ``_find_and_load_unlocked`` (an
    ``import`` statement or ``__import__``); ``importlib.util.find_spec`` calls ``_find_spec`` directly and is
    refused. The importer is the first frame above that is not importlib's own.
    """
    f: types.FrameType | None = sys._getframe(2)  # 0: this function, 1: find_spec, 2: importlib._bootstrap._find_spec
    if f is None or f.f_code.co_name != "_find_spec" or f.f_back is None \
            or f.f_back.f_code.co_name not in _IMPORT_FRAMES:
        return False
    f = f.f_back
    while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
        f = f.f_back
    return f is not None and str(f.f_globals.get("__name__", "")).startswith("sglang")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.created: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname != STUB_ROOT and not fullname.startswith(STUB_ROOT + "."):
            return None
        if not _importer_is_sglang():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []  # a package, so submodule imports resolve through this finder
        setattr(m, MARKER, True)
        return m

    def exec_module(self, module) -> None:
        self.created.append(module.__name__)


def real_torchvision_installed() -> bool:
    mod = sys.modules.get(STUB_ROOT)
    if mod is not None:
        return not getattr(mod, MARKER, False)
    try:
        return importlib.util.find_spec(STUB_ROOT) is not None
    except (ImportError, ValueError):
        return False


def _prime_transformers() -> None:
    """Evaluate transformers' lru-cached torchvision probe now (False: no torchvision), before any stand-in exists."""
    try:
        from transformers.utils import import_utils
    except Exception:  # noqa: BLE001 - transformers absent or broken: nothing to prime
        return
    probe = getattr(import_utils, "is_torchvision_available", None)
    if callable(probe):
        with contextlib.suppress(Exception):
            probe()


@contextlib.contextmanager
def torchvision_stub() -> Iterator[list[str]]:
    """Answer SGLang's module-level torchvision imports with stand-ins while the block runs (see module docstring).

    Yields the list of stand-in module names created (filled while the block runs). No-op if a real torchvision is
    installed.
    """
    if real_torchvision_installed():
        yield []
        return
    _prime_transformers()
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield finder.created
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name in finder.created:
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, MARKER, False):
                del sys.modules[name]


__all__ = ["MARKER", "real_torchvision_installed", "torchvision_stub"]
