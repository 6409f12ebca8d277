"""The bytes PyTorch's CPU allocator holds, counted at the allocator itself: how a compiled step is measured.

A ``TorchDispatchMode`` (:class:`bonsai_core.measure.LiveBytes`) sees the tensors that ops return, but
inductor's compiled programs allocate their buffers outside the dispatcher, and its kernels run no aten
op. Every CPU tensor's bytes, though, come from c10's CPU allocator, which takes them from
``posix_memalign`` and gives them back with ``free``. A small C library preloaded into a process
(``native/allocation_hook.c``, built here with the system C compiler, the one inductor's CPU back-end
needs anyway) wraps those two calls and counts the bytes of the blocks ``posix_memalign`` handed out that
are not yet freed, and the most they were. :func:`run_hooked` runs a function in a fresh process with the
hook preloaded; inside it, :func:`live_bytes`, :func:`peak_bytes` and :func:`reset_peak` read it.

What it counts is everything c10's CPU allocator hands out (tensors, inductor's buffers, the kernels'
own temporaries) and the few other ``posix_memalign`` users of the process (oneDNN's scratch memory):
memory the process really holds for computing, which is what a budget is about.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, TypeVar

from bonsai_core.errors import BonsaiError

T = TypeVar("T")

_SOURCE = Path(__file__).with_name("native") / "allocation_hook.c"


def cache_folder() -> Path:
    """bonsai's cache folder: ``$BONSAI_CACHE_DIR``, else ``$XDG_CACHE_HOME/bonsai``, else ``~/.cache/bonsai``."""
    return Path(os.environ.get("BONSAI_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bonsai")


def hook_library(cache_dir: str | os.PathLike | None = None) -> Path:
    """The hook as a shared library, built once per source into the bonsai cache folder."""
    source = _SOURCE.read_bytes()
    base = Path(cache_dir) if cache_dir else cache_folder()
    library = base / f"allocation_hook-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BonsaiError("Measuring a compiled CPU step needs a C compiler (cc or gcc, as torch.compile's CPU back-end "
                          "does) to build its allocation hook; install one or set CC.")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(_SOURCE), "-ldl", "-lpthread"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BonsaiError(f"Building the allocation hook with {compiler} failed: {done.stderr.strip()[:400]}")
    partial.replace(library)
    return library


def _hook() -> Any:
    lib = ctypes.CDLL(None)
    try:
        for name in ("allocation_hook_live", "allocation_hook_peak"):
            getattr(lib, name).restype = ctypes.c_size_t
    except AttributeError:
        raise BonsaiError("The allocation hook is not loaded in this process: measure through run_hooked.") from None
    return lib


def hooked() -> bool:
    """Whether this process runs with the hook preloaded."""
    try:
        _hook()
    except BonsaiError:
        return False
    return True


def live_bytes() -> int:
    """Bytes of the allocator's blocks in use now."""
    return int(_hook().allocation_hook_live())


def peak_bytes() -> int:
    """The most :func:`live_bytes` has been since the process started or :func:`reset_peak`."""
    return int(_hook().allocation_hook_peak())


def reset_peak() -> None:
    """Start a new peak from the bytes in use now."""
    _hook().allocation_hook_reset_peak()


def _child() -> None:
    """The hooked process: read (fn, args) pickled on stdin, write ("ok", result) or ("error", text) pickled
    on stdout."""
    import pickle
    import sys

    fn, args = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # what fn prints must not mix with the result
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 (the parent raises it)
        result = ("error", f"{type(e).__name__}: {e}")
    pickle.dump(result, out)
    out.flush()


def run_hooked(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
    """``fn(*args)`` in a fresh Python process with the hook preloaded (``fn`` importable by name, its
    arguments and result picklable); an exception there is raised here as a BonsaiError. The process is
    started afresh (not forked, nor re-importing the caller's script), so it holds only what ``fn`` makes."""
    import pickle
    import sys

    env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, (str(hook_library()), os.environ.get("LD_PRELOAD"))))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH"))))
    try:
        done = subprocess.run([sys.executable, "-c", "from bonsai_core.allocations import _child; _child()"],
                              input=pickle.dumps((fn, args)), capture_output=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BonsaiError(f"The measured step did not end within {timeout:.0f} s.") from None
    try:
        status, value = pickle.loads(done.stdout)
    except Exception:  # noqa: BLE001 (it died before answering)
        raise BonsaiError(f"The measured step's process ended with status {done.returncode} without a result: "
                          f"{done.stderr.decode(errors='replace').strip()[-600:]}") from None
    if status == "error":
        raise BonsaiError(f"The measured step failed in its process: {value}")
    return value
