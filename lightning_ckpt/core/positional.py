"""Hand a block's keyword arguments to ``torch.utils.checkpoint`` positionally, so their devices' RNG is restored.

Non-reentrant ``checkpoint`` saves and restores the random-number state of the devices of its *positional* tensor
arguments only (``_infer_device_type(*args)`` and ``get_device_states(*args)``, the same code path in torch 2.11
and 2.14); keyword arguments reach the checkpointed function but not that collection. A block whose CUDA tensors all
arrive by keyword (``block(hidden_states=h)``, common in Hugging Face models) would replay its dropout with a
different CUDA mask: wrong gradients, silently (CPU RNG is always restored, so the CPU cannot show it).

:func:`keywords_as_positional` passes the keyword values positionally and rebuilds the keywords inside the
checkpointed function, so every tensor the block receives, by position or keyword and nested in tuples, lists or
dicts (``checkpoint`` walks its arguments as a pytree), is in front of that collection. The keyword tensors are then
saved as checkpoint inputs like the positional ones: the same memory, held before by ``checkpoint``'s closure.
Keyword names never meet ``checkpoint``'s own options (a block taking ``debug=`` or ``context_fn=`` is safe).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

__all__ = ["keywords_as_positional"]


def keywords_as_positional(fn: Callable[..., Any], args: Sequence[Any],
                           kwargs: Dict[str, Any]) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    """``(body, inputs)`` such that ``body(*inputs)`` calls ``fn(*args, **kwargs)`` and ``inputs`` holds every value.

    Args:
        fn: the function to checkpoint.
        args: its positional arguments.
        kwargs: its keyword arguments (their order is kept).

    Returns:
        ``fn`` and ``tuple(args)`` unchanged when there are no keyword arguments; otherwise a function that splits
        its inputs back into ``args`` and ``kwargs``, and the positional values followed by the keyword values.
    """
    if not kwargs:
        return fn, tuple(args)
    count, names = len(args), tuple(kwargs)

    def with_keywords(*inputs):
        return fn(*inputs[:count], **dict(zip(names, inputs[count:])))

    return with_keywords, (*args, *kwargs.values())
