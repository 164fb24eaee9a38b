"""GPU names and compute capabilities: ``"H100"`` → SM 9.0, ``"sm_75"`` → 7.5.

The planner forecasts for a GPU it may not have; PyTorch's kernel choices depend on the GPU's compute capability
(SM major.minor), so a name or an SM version is all the planner needs. Capabilities are NVIDIA's own (CUDA GPUs
list, developer.nvidia.com/cuda-gpus; the CUDA C++ Programming Guide's compute-capability table).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

__all__ = ["GPU_SM", "format_sm", "parse_sm"]

# Name (as NVIDIA and torch.cuda.get_device_name spell it, without "NVIDIA"/"Tesla"/"GeForce") -> (major, minor).
GPU_SM: Dict[str, Tuple[int, int]] = {
    "K80": (3, 7), "P100": (6, 0), "P40": (6, 1), "P4": (6, 1), "GTX 1080 Ti": (6, 1),
    "V100": (7, 0), "Titan V": (7, 0),
    "T4": (7, 5), "RTX 2080 Ti": (7, 5), "RTX 2080": (7, 5), "Titan RTX": (7, 5), "Quadro RTX 6000": (7, 5),
    "Quadro RTX 8000": (7, 5),
    "A100": (8, 0), "A800": (8, 0), "A30": (8, 0),
    "A10": (8, 6), "A10G": (8, 6), "A40": (8, 6), "A16": (8, 6), "A2": (8, 6), "RTX A6000": (8, 6),
    "RTX A5000": (8, 6), "RTX A4000": (8, 6), "RTX 3090": (8, 6), "RTX 3090 Ti": (8, 6), "RTX 3080": (8, 6),
    "RTX 3070": (8, 6), "RTX 3060": (8, 6),
    "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9), "L20": (8, 9), "RTX 4090": (8, 9), "RTX 4080": (8, 9),
    "RTX 4070": (8, 9), "RTX 6000 Ada": (8, 9),
    "H100": (9, 0), "H200": (9, 0), "H800": (9, 0), "H20": (9, 0), "GH200": (9, 0),
    "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
    "RTX 5090": (12, 0), "RTX 5080": (12, 0), "RTX PRO 6000": (12, 0), "GB10": (12, 1), "DGX Spark": (12, 1),
}
_NOISE = {"NVIDIA", "TESLA", "GEFORCE"}


def _tokens(name: str) -> Tuple[str, ...]:
    return tuple(t for t in re.split(r"[^0-9A-Za-z]+", name.upper()) if t and t not in _NOISE)


# majors a bare number names: "10" is SM 10.0 (Blackwell) as "9" is 9.0, never SM 1.0, which no PyTorch runs on
_BARE_MAJORS = range(10, 13)


def _sm_from_number(text: str) -> Optional[Tuple[int, int]]:
    """``"9.0"``, ``"9"``, ``"10"``, ``"sm90"``, ``"sm_90"``, ``"90"``, ``"sm_103"``, ``"12.1"`` -> (major, minor).

    Raises:
        ValueError: a two-digit number starting with 1 that is not a bare 10-12 (``"sm_10"``, ``"13"``): read as
            digits it would be SM 1.x, which no PyTorch runs on.
    """
    raw = text.strip().lower()
    s = raw[2:].lstrip("_") if raw.startswith("sm") else raw
    m = re.fullmatch(r"(\d{1,2})(?:\.(\d))?", s)
    if m and (m.group(2) is not None or len(m.group(1)) == 1 or (s == raw and int(s) in _BARE_MAJORS)):
        return int(m.group(1)), int(m.group(2) or 0)
    if re.fullmatch(r"1\d", s):
        raise ValueError(f"Pass major.minor (--sm {s}.0), three digits (--sm sm_{s}0) or a GPU name (--sm B200): "
                         f"--sm={text!r} could mean SM {s}.0 or SM 1.{s[1]}.")
    m = re.fullmatch(r"(\d{1,2})(\d)", s)  # "90" -> 9.0, "103" -> 10.3
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_sm(value: str) -> Tuple[Tuple[int, int], Optional[str]]:
    """Parse ``--sm``: an SM version (``"9.0"``, ``"sm90"``, ``"sm_75"``, a bare major ``"9"`` or ``"10"``) or a
    GPU name (``"H100"``, ``"NVIDIA A100-SXM4-80GB"``, ``"RTX 4090"``). Returns ``((major, minor), name)``; ``name``
    is the table's spelling, ``None`` for a version.

    Raises:
        ValueError: neither a version nor a GPU in :data:`GPU_SM` (the message lists the names), or an ambiguous
            ``"sm_10"`` / ``"13"`` (SM 10.0 or 1.0?).
    """
    sm = _sm_from_number(str(value))
    if sm is not None:
        return sm, None
    tokens = _tokens(str(value))
    best: Optional[str] = None
    for name in GPU_SM:
        key = _tokens(name)
        hit = any(tokens[i:i + len(key)] == key for i in range(len(tokens) - len(key) + 1))
        if hit and (best is None or len(key) > len(_tokens(best))):
            best = name  # the longest match wins: "RTX 6000 Ada" over nothing, "L40S" is its own token
    if best is None:
        raise ValueError(f"--sm={value!r} is neither an SM version nor a known GPU; pass the compute capability "
                         f"(e.g. --sm 9.0 or --sm sm_75) or one of {sorted(GPU_SM)}.")
    return GPU_SM[best], best


def format_sm(sm: Tuple[int, int]) -> str:
    return f"SM {sm[0]}.{sm[1]}"
