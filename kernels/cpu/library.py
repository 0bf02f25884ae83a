"""The one library `make kernels` builds (kernels/cpu/*.c -> build/libignis_cpu.so), and binding a
C function of it with ctypes; each kernel module binds its own function through `bind`."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ignis.engine")

LIBRARY = Path(__file__).resolve().parent / "build" / "libignis_cpu.so"

# How the C kernels name a KV cache's dtype (their KV_FP32, KV_BF16, KV_FP16).
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def bind(path: Path, symbol: str, argtypes: list[Any], what: str) -> Any | None:
    """`symbol` of the library at `path`, typed (returns a C int status), or None, logged with
    what runs instead (`what`), when the library or the symbol is not there."""
    try:
        fn = getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError) as exc:
        log.warning("CPU kernel %s not loaded (%s; `make kernels` builds it with gcc): %s", symbol, exc, what)
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn
