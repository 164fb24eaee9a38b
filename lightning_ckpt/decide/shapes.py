"""The shape of a step's batch, and the buckets that per-shape plans are made for. Pure torch.

A step's activation memory follows its batch's shape: the micro-batch (samples) times its lengths. A plan chosen
for one shape is wrong for another: too weak for a longer batch (the out-of-memory error of a long batch), too
strong for a shorter one (recompute it did not need). :func:`shape_of` reads the shape a batch has:

- **token batches**: ``(samples, (sequence length,))`` from the token ids or attention mask
  (:mod:`lightning_ckpt.measure.tokens`); an **encoder–decoder** batch has two lengths, ``(source, target)``, when
  it carries ``decoder_input_ids`` / ``decoder_attention_mask``, or ``labels`` of another length than its input;
- **batches without token ids**: a three-dimensional float tensor is a sequence of vectors, ``[B, T, D]`` →
  ``(B, (T,))`` (a guess: the edge warns once and asks for ``shape_fn``, since ``[B, C, L]`` signals read the other
  way); images and other tensors of four or more dimensions give their spatial sizes, ``[B, C, H, W]`` →
  ``(B, (H, W))``; ``()`` for flat features;
- ``shape_fn(batch)`` when given: ``(samples, length, ...)`` as integers, for any other batch.

**Buckets** (:func:`bucket_of`): the samples and each length rounded up to the next power of two, at least
:data:`MIN_LENGTH` for a length, and never past the run's longest shape (``max_shape``) where the raw value is
within it. A bucket's plan is made for its upper corner, so it holds for every batch in it (activation memory grows
with each dimension); powers of two keep the number of plans small (from 64 to 4096 tokens: 7), which bounds the
graphs ``torch.compile`` builds. Packed sequences (every batch one length) are one bucket: one plan, as before.

A batch of a bucket's shape is made from a real batch by :func:`resize_batch`: every dimension that holds the
batch's samples or one of its lengths takes the bucket's size, filled by repeating the batch along it (token ids
stay valid ids, a mask of ones stays ones).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from lightning_ckpt.measure.tokens import count_samples, sequence_length

__all__ = ["MIN_LENGTH", "Shape", "ambiguous_length", "bucket_of", "parse_shape", "resize_batch", "shape_of"]

MIN_LENGTH = 8
"""The smallest bucket of a length: shorter batches share one plan."""

_TARGET_KEYS = ("decoder_input_ids", "decoder_attention_mask")


@dataclass(frozen=True, order=True)
class Shape:
    """What a batch's activation memory depends on: ``samples`` and ``lengths`` (see the module docstring)."""

    samples: int
    lengths: Tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Samples times every length: the token count of a full (unpadded) batch of this shape."""
        return self.samples * math.prod(self.lengths)

    def covers(self, other: "Shape") -> bool:
        """Every dimension at least ``other``'s: a plan made for this shape holds for ``other``."""
        return (self.samples >= other.samples and len(self.lengths) == len(other.lengths)
                and all(a >= b for a, b in zip(self.lengths, other.lengths)))

    def __str__(self) -> str:
        return " x ".join([str(self.samples), *(str(n) for n in self.lengths)])


def parse_shape(value: Union[str, Sequence[int], Shape, None], name: str = "max_shape") -> Optional[Shape]:
    """A shape from ``"4x2048"``, ``(4, 2048)`` or ``[8, 512, 128]`` (samples first); ``None`` stays ``None``.

    Raises:
        ValueError: naming the value and the form it takes.
    """
    if value is None or isinstance(value, Shape):
        return value
    parts: Sequence[Any]
    if isinstance(value, str):
        parts = [p.strip() for p in value.lower().replace("×", "x").replace(",", "x").split("x")]
    else:
        parts = list(value)
    try:
        numbers = [int(p) for p in parts]
        if any(isinstance(p, float) and not float(p).is_integer() for p in parts):
            raise ValueError
    except (TypeError, ValueError):
        numbers = []
    if not numbers or any(n < 1 for n in numbers):
        raise ValueError(f"{name}={value!r} is not a batch shape: pass the micro-batch and the longest length, e.g. "
                         f"'4x2048' or (4, 2048) (an encoder-decoder batch: '4x512x128', source then target).")
    return Shape(numbers[0], tuple(numbers[1:]))


def _is_ids(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and not t.is_complex()


def _target_length(batch: Mapping, source: int) -> Optional[int]:
    """An encoder–decoder batch's target length (see the module docstring), else ``None``."""
    for key in _TARGET_KEYS:
        if _is_ids(batch.get(key)):
            return int(batch[key].shape[-1])
    labels = batch.get("labels")
    if _is_ids(labels) and labels.shape[-1] != source:
        return int(labels.shape[-1])
    return None


def _first_image(batch: Any) -> Optional[torch.Tensor]:
    from lightning_ckpt.measure.tokens import _tensors

    return next((t for t in _tensors(batch) if t.is_floating_point() and t.dim() >= 3), None)


def shape_of(batch: Any, shape_fn: Optional[Callable[[Any], Any]] = None) -> Shape:
    """The batch's :class:`Shape` by the module's rule, or ``shape_fn(batch)``'s (integers, samples first)."""
    if shape_fn is not None:
        shape = parse_shape(shape_fn(batch), name="shape_fn(batch)")
        return shape if shape is not None else Shape(count_samples(batch))
    length = sequence_length(batch)
    if length is not None:
        lengths: Tuple[int, ...] = (length,)
        if isinstance(batch, Mapping):
            target = _target_length(batch, length)
            lengths += (target,) if target is not None else ()
        return Shape(count_samples(batch), lengths)
    image = _first_image(batch)
    if image is not None and image.dim() == 3:  # [samples, length, features]: a sequence of vectors
        return Shape(int(image.shape[0]), (int(image.shape[1]),))
    if image is not None:
        return Shape(int(image.shape[0]), tuple(int(n) for n in image.shape[2:]))
    return Shape(count_samples(batch))


def ambiguous_length(batch: Any) -> Optional[str]:
    """The shape of the float tensor a batch's length is read from when that reading is a guess (no token ids, a
    three-dimensional float tensor: ``[samples, length, features]`` or ``[samples, channels, length]``), else
    ``None``."""
    if sequence_length(batch) is not None:
        return None
    image = _first_image(batch)
    return f"[{', '.join(str(n) for n in image.shape)}]" if image is not None and image.dim() == 3 else None


def _round_up(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def bucket_of(shape: Shape, cap: Optional[Shape] = None) -> Shape:
    """The bucket of ``shape``: each dimension rounded up to a power of two (a length to at least
    :data:`MIN_LENGTH`), no larger than ``cap``'s where the raw value is within it."""

    def dim(value: int, floor: int, limit: Optional[int]) -> int:
        up = _round_up(value, floor)
        return limit if limit is not None and value <= limit < up else up

    limits = cap.lengths if cap is not None and len(cap.lengths) == len(shape.lengths) else (None,) * len(
        shape.lengths)
    return Shape(dim(shape.samples, 1, cap.samples if cap is not None else None),
                 tuple(dim(n, MIN_LENGTH, limit) for n, limit in zip(shape.lengths, limits)))


def _resize(t: torch.Tensor, sizes: dict, samples: Tuple[int, int]) -> torch.Tensor:
    """``t`` with each dimension of a size in ``sizes`` (and dimension 0 of the batch's samples) resized, filled
    by repetition."""
    out = t
    for dim, size in enumerate(t.shape):
        new = samples[1] if dim == 0 and size == samples[0] else sizes.get(size) if dim > 0 else None
        if new is None or new == size:
            continue
        repeats = [1] * out.dim()
        repeats[dim] = -(-new // size)
        out = out.repeat(*repeats).narrow(dim, 0, new)
    return out


def resize_batch(batch: Any, source: Shape, target: Shape) -> Any:
    """A batch of ``target``'s shape made from ``batch`` (of shape ``source``): see the module docstring. In an
    encoder–decoder mapping the target length goes to the decoder's keys and ``labels``, the source length to the
    others (so equal source and target lengths are told apart)."""
    if len(source.lengths) != len(target.lengths):
        raise ValueError(f"cannot resize a batch of shape {source} to {target}: they have different lengths.")
    sizes = dict(zip(source.lengths, target.lengths))
    samples = (source.samples, target.samples)
    two = len(source.lengths) == 2 and isinstance(batch, Mapping)
    by_side = ({source.lengths[0]: target.lengths[0]}, {source.lengths[1]: target.lengths[1]}) if two else None

    def walk(x: Any, lengths: dict = sizes) -> Any:
        if isinstance(x, torch.Tensor):
            return _resize(x, lengths, samples)
        if isinstance(x, Mapping):
            items = {k: walk(v, by_side[k in (*_TARGET_KEYS, "labels")] if by_side and x is batch else lengths)
                     for k, v in x.items()}
            return items if type(x) is dict else type(x)(items)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(walk(v, lengths) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, lengths) for v in x)
        return x

    return walk(batch)
