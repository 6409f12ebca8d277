"""Replace a function for the calling thread only, while other threads keep the original.

Traces run in threads of the explorer: a patch one trace needs (:mod:`bonsai_core.trace.patches`,
:func:`bonsai_core.models.hf.one_sequence_per_row`) must not change what another thread's trace calls.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

_thread_patches: dict[tuple[int, str], list[Any]] = {}  # (owner, attr) -> [original, active, users]
_thread_patches_lock = threading.Lock()


@contextlib.contextmanager
def in_this_thread(owner: Any, attr: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """Within: ``owner.attr(...)`` calls ``replacement`` in this thread only: traces run in threads of
    the explorer, and another thread's trace must keep the original. While any thread is within, a
    dispatcher stands in for the original; the last one out puts the original back."""
    key = (id(owner), attr)
    with _thread_patches_lock:
        if key not in _thread_patches:
            original, active = getattr(owner, attr), threading.local()

            @functools.wraps(original)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                return (getattr(active, "function", None) or original)(*args, **kwargs)

            _thread_patches[key] = [original, active, 0]
            setattr(owner, attr, dispatch)
        entry = _thread_patches[key]
        entry[2] += 1
    active = entry[1]
    previous = getattr(active, "function", None)
    active.function = replacement
    try:
        yield
    finally:
        active.function = previous
        with _thread_patches_lock:
            entry[2] -= 1
            if entry[2] == 0:
                setattr(owner, attr, entry[0])
                del _thread_patches[key]
