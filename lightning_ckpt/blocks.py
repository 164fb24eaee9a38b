"""Find the repeated Transformer blocks of a model.

Search order:

1. An explicit selector (``blocks=``): a class, a class name (``"GPT2Block"``), a fully-qualified-name glob
   (``"transformer.h.*"``) or a list of these.
2. Hugging Face ``_no_split_modules`` on the model or any submodule, keeping only classes that repeat.
3. Structure: module classes that appear ≥ 2 times as siblings inside a ``ModuleList``/``Sequential`` and have
   children of their own. The class holding the most parameters wins; other classes holding ≥ 25 % as many
   parameters and not nested in the winner are added too, so an encoder–decoder returns both stacks.

Nested matches keep the outermost module (a block and its own MLP both matching → only the block).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

from torch import nn

__all__ = ["find_blocks", "describe_blocks", "BlockSelector"]

BlockSelector = Union[None, str, Type[nn.Module], Sequence[Union[str, Type[nn.Module]]]]

_CONTAINERS = (nn.ModuleList, nn.Sequential)
_SECOND_STACK_SHARE = 0.25


def find_blocks(model: nn.Module, blocks: BlockSelector = None) -> List[Tuple[str, nn.Module]]:
    """The repeated Transformer blocks of ``model``, in model order, with their fully qualified names.

    Args:
        model: any ``nn.Module`` (a ``LightningModule`` works; names are relative to it).
        blocks: optional selector; see the module docstring.

    Raises:
        ValueError: an explicit selector matched nothing (the message lists the closest class names and
            paths), or no repeated blocks were found (the message says what was searched).
        TypeError: a selector of an unsupported type.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if blocks is not None:
        return _outermost(_select(named, blocks))
    hinted = _from_no_split_hint(model, named)
    if hinted:
        return hinted
    found = _from_structure(named)
    if not found:
        raise ValueError(
            f"No repeated blocks found in {type(model).__name__}: searched Hugging Face `_no_split_modules` "
            "and every nn.ModuleList / nn.Sequential for ≥2 sibling modules of the same class that have "
            "children of their own. Pass `blocks=` explicitly: a class, a class name such as 'GPT2Block', "
            "or a path glob such as 'transformer.h.*'."
        )
    return found


def _select(named: List[Tuple[str, nn.Module]], blocks: BlockSelector) -> List[Tuple[str, nn.Module]]:
    selectors = list(blocks) if isinstance(blocks, (list, tuple, set, frozenset)) else [blocks]
    if not selectors:
        raise ValueError("blocks=[] selects nothing; pass None for automatic detection or at least one selector.")
    chosen: Dict[str, nn.Module] = {}
    for selector in selectors:
        matches = _match(named, selector)
        if not matches:
            raise ValueError(_no_match_message(named, selector))
        chosen.update(matches)
    return [(n, m) for n, m in named if n in chosen]


def _match(named, selector) -> Dict[str, nn.Module]:
    if isinstance(selector, type) and issubclass(selector, nn.Module):
        return {n: m for n, m in named if isinstance(m, selector)}
    if not isinstance(selector, str):
        raise TypeError(
            f"blocks selector {selector!r} must be an nn.Module class, a class name, or a path glob "
            "(e.g. GPT2Block, 'GPT2Block', 'transformer.h.*')."
        )
    by_class = {n: m for n, m in named if selector in (type(m).__name__, _qualname(type(m)))}
    if by_class:
        return by_class
    return {n: m for n, m in named if fnmatch.fnmatchcase(n, selector)}


def _no_match_message(named, selector) -> str:
    label = selector.__name__ if isinstance(selector, type) else str(selector)
    classes = sorted({type(m).__name__ for _, m in named})
    paths = [n for n, _ in named]
    close_classes = difflib.get_close_matches(label, classes, n=3, cutoff=0.5)
    close_paths = difflib.get_close_matches(label, paths, n=3, cutoff=0.5)
    repeated = [c for c in _repeated_classes(named)][:5]
    parts = [f"blocks selector {label!r} matched no module."]
    if close_classes:
        parts.append(f"Closest class names: {close_classes}.")
    if close_paths:
        parts.append(f"Closest paths: {close_paths}.")
    if repeated:
        parts.append(f"Classes that repeat in this model: {repeated}.")
    parts.append("Pass a class, a class name, or a path glob such as 'layers.*'.")
    return " ".join(parts)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _outermost(items: Iterable[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    kept: List[Tuple[str, nn.Module]] = []
    for name, module in sorted(items, key=lambda item: item[0].count(".")):
        if not any(name.startswith(k + ".") for k, _ in kept):
            kept.append((name, module))
    order = {name: i for i, (name, _) in enumerate(items)}
    return sorted(kept, key=lambda item: order[item[0]])


def _from_no_split_hint(model: nn.Module, named) -> List[Tuple[str, nn.Module]]:
    hinted = set()
    for module in [model] + [m for _, m in named]:
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            hinted.update(str(n) for n in names)
    if not hinted:
        return []
    counts: Dict[str, int] = defaultdict(int)
    for _, module in named:
        counts[type(module).__name__] += 1
    repeated = {c for c in hinted if counts.get(c, 0) >= 2}
    return _outermost([(n, m) for n, m in named if type(m).__name__ in repeated])


def _stacked_instances(named) -> Dict[type, List[Tuple[str, nn.Module]]]:
    """Composite modules that sit as ≥2 same-class siblings in a ModuleList/Sequential, by class."""
    by_class: Dict[type, List[Tuple[str, nn.Module]]] = defaultdict(list)
    for name, container in named:
        if not isinstance(container, _CONTAINERS):
            continue
        siblings: Dict[type, List[Tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in container.named_children():
            if isinstance(child, _CONTAINERS) or not any(True for _ in child.children()):
                continue
            siblings[type(child)].append((f"{name}.{child_name}", child))
        for cls, members in siblings.items():
            if len(members) >= 2:
                by_class[cls].extend(members)
    return by_class


def _repeated_classes(named) -> List[str]:
    return [cls.__name__ for cls in _stacked_instances(named)]


def _param_count(modules: Iterable[nn.Module]) -> int:
    seen = set()
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _from_structure(named) -> List[Tuple[str, nn.Module]]:
    stacked = {cls: _outermost(members) for cls, members in _stacked_instances(named).items()}
    if not stacked:
        return []
    # ties (e.g. parameter-free blocks) go to the class with more instances
    scored = sorted(
        stacked.items(), key=lambda kv: (_param_count(m for _, m in kv[1]), len(kv[1])), reverse=True
    )
    best_score = _param_count(m for _, m in scored[0][1])
    chosen: List[Tuple[str, nn.Module]] = list(scored[0][1])
    for _, members in scored[1:]:
        if _param_count(m for _, m in members) < _SECOND_STACK_SHARE * best_score:
            break
        if not any(_nested(n, c) for n, _ in members for c, _ in chosen):
            chosen.extend(members)
    order = {name: i for i, (name, _) in enumerate(named)}
    return sorted(chosen, key=lambda item: order[item[0]])


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


def describe_blocks(found: List[Tuple[str, nn.Module]], limit: Optional[int] = 4) -> str:
    """Short text such as ``'12 × Block at transformer.h.0 … transformer.h.11'``."""
    if not found:
        return "no blocks"
    classes = sorted({type(m).__name__ for _, m in found})
    first, last = found[0][0], found[-1][0]
    span = first if len(found) == 1 else f"{first} … {last}"
    return f"{len(found)} × {'/'.join(classes)} at {span}"
