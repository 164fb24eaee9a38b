"""Find the repeated Transformer blocks of a model.

Explicit selection (``blocks=``): a class (subclasses match too), a class name (``"GPT2Block"``), a qualified
class name (``"transformers.models.gpt2.modeling_gpt2.GPT2Block"``), a fully-qualified-name glob
(``"transformer.h.*"``) or a list of these. Class names are looked up along each module's MRO, so a module
that was re-classed by a wrapper (FSDP2's ``FSDPGPT2Block``) still answers to ``"GPT2Block"``. A selector that
matches nothing is an error that lists the closest class names and paths. A selected ``ModuleList`` or
``ModuleDict`` (``"transformer.h"``) stands for its children, since it has no forward of its own.

Automatic detection (``blocks=None``) works on *stacks*: composite modules (modules with children) that sit
as ≥ 2 same-class siblings in an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` (containers are
looked through, never picked):

1. Hugging Face ``_no_split_modules`` (on the model or any submodule): every *stacked* class it names is a
   block class. Names that do not stack are ignored (ViT also lists its one ``ViTEmbeddings``; RoBERTa-PreLN
   lists attention modules).
2. Structure fills in what the hint leaves out. Without a hint, the stacked class holding the most parameters
   is the block class. Then, in order of size, each stacked class not nested in (or around) a chosen one is
   added when it is interleaved with chosen blocks in the same container (hybrid models: Jamba, Zamba), or
   when it holds ≥ 25 % of the largest class's parameters (encoder–decoder, two-tower models), or when its
   blocks are each ≥ 25 % the size of the largest class's blocks (a 2-layer encoder under a 24-layer
   decoder). The last two also require a normalization layer in each block when a hint exists, and skip
   anything inside a module the hint names as one unit (DETR's CNN backbone).
3. Stages are opened. A chosen class whose every instance has a direct child list of alike sub-blocks (one
   class, the same classes under shared child names, a normalization layer each, ≥ 50 % of the parameters
   held in the instance's submodules, ≥ 2 of them somewhere) is a stage of a hierarchical model (Swin,
   ConvNeXt, MaxViT); its sub-blocks become the blocks. The finer unit lets a policy choose more freely, and
   ``group:K`` rebuilds coarser regions.
4. Every instance of a block class counts, also one alone in its container (EfficientNet's last stage).

Nested matches keep the outermost module (a block and its own MLP both matching → only the block). Results
are in ``named_modules()`` order with fully qualified names relative to ``model``.

Known limits: a model that reuses one block instance (ALBERT's shared layer) has no *repeated* blocks in its
module tree; models built only from plain ``nn.Sequential`` blocks have no block class; blocks registered as
plain attributes rather than in a container (timm's RegNet stages) are not a stack. Pass ``blocks=`` for them.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

from torch import nn

__all__ = ["BlockSelector", "describe_blocks", "find_blocks"]

BlockSelector = Union[None, str, Type[nn.Module], Sequence[Union[str, Type[nn.Module]]]]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_SECOND_STACK_SHARE = 0.25
_STAGE_SHARE = 0.5
_MAX_STAGE_DEPTH = 8
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
if hasattr(nn, "RMSNorm"):
    _NORMS = _NORMS + (nn.RMSNorm,)

Named = List[Tuple[str, nn.Module]]


def find_blocks(model: nn.Module, blocks: BlockSelector = None) -> List[Tuple[str, nn.Module]]:
    """The repeated Transformer blocks of ``model``, in model order, with their fully qualified names.

    Args:
        model: any ``nn.Module`` (a ``LightningModule`` works; names are relative to it).
        blocks: optional selector; see the module docstring.

    Returns:
        ``(name, module)`` pairs in ``model.named_modules()`` order, none nested in another.

    Raises:
        ValueError: an explicit selector matched nothing (the message names it and lists the closest class
            names and paths), or no repeated blocks were found (the message says what was searched and how to
            pass ``blocks=``).
        TypeError: ``model`` is not an ``nn.Module``, or a selector has an unsupported type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks(model=...) needs an nn.Module, got {type(model).__name__}.")
    named = [(n, m) for n, m in model.named_modules() if n]
    if blocks is not None:
        return _expand_lists(_outermost(_select(model, named, blocks)))
    stacks = _stacked_instances(model, named)
    classes = _choose_classes(model, named, stacks)
    if not classes:
        raise ValueError(_nothing_found_message(model, named))
    classes = _open_stages(classes, named)
    return _outermost([(n, m) for n, m in named if type(m) in classes])


# --------------------------------------------------------------------------------------------- selectors


def _select(model: nn.Module, named: Named, blocks: BlockSelector) -> Named:
    selectors = list(blocks) if isinstance(blocks, (list, tuple, set, frozenset)) else [blocks]
    if not selectors:
        raise ValueError(
            "blocks=[] selects nothing; pass None for automatic detection or at least one selector."
        )
    chosen: Dict[str, nn.Module] = {}
    for selector in selectors:
        matches = _match(named, selector)
        if not matches:
            raise ValueError(_no_match_message(model, named, selector))
        chosen.update(matches)
    return [(n, m) for n, m in named if n in chosen]


def _expand_lists(found: Named) -> Named:
    """A selected ``ModuleList``/``ModuleDict`` (which has no forward) stands for its children."""
    out: Named = []
    for name, module in found:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out.extend(_expand_lists([(f"{name}.{n}", m) for n, m in module.named_children()]))
        else:
            out.append((name, module))
    return out


def _match(named: Named, selector) -> Dict[str, nn.Module]:
    if isinstance(selector, type) and issubclass(selector, nn.Module):
        return {n: m for n, m in named if isinstance(m, selector)}
    if not isinstance(selector, str):
        raise TypeError(
            f"blocks selector {selector!r} ({type(selector).__name__}) must be an nn.Module class, a class "
            "name, or a path glob (e.g. GPT2Block, 'GPT2Block', 'transformer.h.*'), or a list of these."
        )
    by_class = {n: m for n, m in named if selector in _class_names(type(m))}
    if by_class:
        return by_class
    return {n: m for n, m in named if fnmatch.fnmatchcase(n, selector)}


def _no_match_message(model: nn.Module, named: Named, selector) -> str:
    label = selector.__name__ if isinstance(selector, type) else str(selector)
    classes = sorted({type(m).__name__ for _, m in named})
    paths = [n for n, _ in named]
    close_classes = _close(label.rsplit(".", 1)[-1], classes)
    if any(c in label for c in "*?["):  # a glob: offer the globs of the model's containers first
        paths = [f"{n}.*" for n, m in named if isinstance(m, _CONTAINERS)] + paths
    close_paths = _close(label, paths)
    parts = [f"blocks selector {label!r} matched no module."]
    if close_classes:
        parts.append(f"Closest class names: {close_classes}.")
    if close_paths:
        parts.append(f"Closest paths: {close_paths}.")
    stacks = _stack_summary(model, named)
    if stacks:
        parts.append(f"Repeated blocks in this model: {stacks}.")
    parts.append(
        "Pass a class, a class name, a qualified class name, or a path glob such as 'layers.*' (or a list "
        "of these); leave blocks=None for automatic detection."
    )
    return " ".join(parts)


def _close(word: str, options: Sequence[str], n: int = 3) -> List[str]:
    """Case-insensitive ``difflib`` matches, returned in their original spelling."""
    lowered: Dict[str, str] = {}
    for option in options:
        lowered.setdefault(option.lower(), option)
    found = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.5)
    return [lowered[f] for f in found]


def _stack_summary(model: nn.Module, named: Named, limit: int = 5) -> List[str]:
    """``['transformer.h.* (4 × Block)', ...]`` for the model's stacks, largest first."""
    summary = []
    stacks = sorted(
        _stacked_instances(model, named).items(), key=lambda kv: -_param_count(m for _, m in kv[1])
    )
    for cls, members in stacks[:limit]:
        parents = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n, _ in members})
        globs = [f"{p}.*" if p else "*" for p in parents]
        where = globs[0] if len(globs) == 1 else f"{globs[0]} … ({len(globs)} lists)"
        summary.append(f"{where} ({len(members)} × {cls.__name__})")
    return summary


def _class_names(cls: type) -> Set[str]:
    """Plain and qualified names of ``cls`` and its bases (``nn.Module`` and ``object`` left out)."""
    names: Set[str] = set()
    for base in cls.__mro__:
        if base not in (nn.Module, object):
            names.update((base.__name__, f"{base.__module__}.{base.__qualname__}"))
    return names


def _outermost(items: Iterable[Tuple[str, nn.Module]]) -> Named:
    items = list(items)
    kept: Set[str] = set()
    for name, _ in sorted(items, key=lambda item: item[0].count(".")):
        if not _has_ancestor(name, kept):
            kept.add(name)
    return [(n, m) for n, m in items if n in kept]


def _has_ancestor(name: str, names: Set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts)))


# --------------------------------------------------------------------------------------------- automatic


def _no_split_names(model: nn.Module, named: Named) -> Set[str]:
    """Class names in Hugging Face ``_no_split_modules`` anywhere in the model."""
    hint: Set[str] = set()
    for module in [model] + [m for _, m in named]:
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set, frozenset)):
            hint.update(str(n) for n in names)
    return hint


def _is_composite(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _stacked_instances(model: nn.Module, named: Named) -> Dict[type, Named]:
    """Composite modules sitting as ≥ 2 same-class siblings in a ModuleList/Sequential/ModuleDict, by class.

    Containers themselves are never blocks: a ``Sequential`` stage is looked through, not picked. ``model``
    itself counts as a container when it is one (``nn.Sequential(Block(), Block())``).
    """
    by_class: Dict[type, Named] = defaultdict(list)
    for name, parent in [("", model)] + named:
        if not isinstance(parent, _CONTAINERS):
            continue
        siblings: Dict[type, Named] = defaultdict(list)
        for child_name, child in parent.named_children():
            if isinstance(child, _CONTAINERS) or not _is_composite(child):
                continue
            siblings[type(child)].append((f"{name}.{child_name}" if name else child_name, child))
        for cls, members in siblings.items():
            if len(members) >= 2:
                by_class[cls].extend(members)
    return by_class


def _param_count(modules: Iterable[nn.Module]) -> int:
    seen = set()
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _choose_classes(model: nn.Module, named: Named, stacks: Dict[type, Named]) -> Set[type]:
    """Pick the block classes among the stacked ones: hinted classes first, then structure fills the rest."""
    if not stacks:
        return set()
    hint = _no_split_names(model, named)
    by_name = dict(named)
    # modules Hugging Face keeps as one unit (DETR's whole CNN backbone): no second stack is sought inside
    claimed = {n for n, m in named if _class_names(type(m)) & hint}
    ranked = []
    for position, (cls, members) in enumerate(stacks.items()):
        members = _outermost(members)
        depth = min(n.count(".") for n, _ in members)
        ranked.append((_param_count(m for _, m in members), len(members), depth, position, cls, members))
    # equal parameters: the outer class (a wrapper of the other), then more instances, then the earlier one
    ranked.sort(key=lambda r: (-r[0], r[2], -r[1], r[3]))
    top_params, top_count = ranked[0][0], ranked[0][1]
    chosen: Set[type] = set()
    chosen_names: Set[str] = set()
    chosen_parents: Set[str] = set()

    def accept(cls, members):
        chosen.add(cls)
        chosen_names.update(n for n, _ in members)
        chosen_parents.update(_parent(n) for n, _ in members)

    for _, _, _, _, cls, members in ranked:
        if _class_names(cls) & hint:
            accept(cls, members)
    for params, count, _, _, cls, members in ranked:
        if cls in chosen:
            continue
        names = {n for n, _ in members}
        if any(_has_ancestor(n, chosen_names) for n in names) or any(
            _has_ancestor(c, names) for c in chosen_names
        ):
            continue  # inside a chosen block, or around one
        if not chosen or any(_parent(n) in chosen_parents for n in names):
            accept(cls, members)  # the largest stack, or interleaved with a chosen one (hybrids: Jamba)
            continue
        if any(_has_ancestor(n, claimed) for n in names):
            continue  # inside a module the hint keeps whole
        normed = all(_has_norm(m) for _, m in members)
        if params >= _SECOND_STACK_SHARE * top_params and (normed or not hint):
            accept(cls, members)  # a second stack of comparable size (encoder–decoder, two towers)
        elif (
            params / count >= _SECOND_STACK_SHARE * top_params / top_count
            and normed
            and _pure(cls, members, by_name)
        ):
            accept(cls, members)  # a short stack of full-size layers (2 encoder layers, 24 decoder layers)
    return chosen


def _pure(cls: type, members: Named, by_name: Dict[str, nn.Module]) -> bool:
    """Every container holding ``members`` holds nothing else with children (Swin's PatchMerging layers,
    interleaved with its stages, are not a stack of their own)."""
    for parent in {_parent(n) for n, _ in members}:
        container = by_name.get(parent)
        if container is None:
            continue  # the model itself
        if any(_is_composite(c) and type(c) is not cls for c in container.children()):
            return False
    return True


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _open_stages(classes: Set[type], named: Named) -> Set[type]:
    """Replace stage classes (a module that is mostly one list of sub-blocks) by their sub-block classes."""
    for _ in range(_MAX_STAGE_DEPTH):
        opened: Set[type] = set()
        for cls in classes:
            inner = _stage_inner_classes([m for _, m in named if type(m) is cls])
            opened |= inner if inner else {cls}
        if opened == classes:
            break
        classes = opened
    return classes


def _stage_inner_classes(instances: List[nn.Module]) -> Optional[Set[type]]:
    inner: Set[type] = set()
    widest = 0
    for module in instances:
        stack = _dominant_child_stack(module)
        if stack is None:
            return None
        inner.add(type(stack[0]))
        widest = max(widest, len(stack))
    return inner if widest >= 2 else None


def _dominant_child_stack(module: nn.Module) -> Optional[List[nn.Module]]:
    """A direct child list of alike sub-blocks, each with a norm, holding most of the submodules' params.

    Parameters held directly by ``module`` (a stage's position table) are not counted.
    """
    held = _param_count(list(module.children()))
    for child in module.children():
        if not isinstance(child, _CONTAINERS):
            continue
        members = [m for m in child.children() if _is_composite(m) and not isinstance(m, _CONTAINERS)]
        if not members or not _alike(members):
            continue
        if _param_count(members) < _STAGE_SHARE * held:
            continue
        if all(_has_norm(m) for m in members):
            return members
    return None


def _alike(members: List[nn.Module]) -> bool:
    """One class, and the composite children they share by name have one class each.

    So ``[Residual(attention), Residual(mlp)]`` (a block's own sub-layers) is not a stack of blocks, while a
    stage whose first block alone has a ``downsample`` branch still is.
    """
    if len({type(m) for m in members}) != 1:
        return False
    maps = [{n: type(c) for n, c in m.named_children() if _is_composite(c)} for m in members]
    shared = set(maps[0]).intersection(*maps[1:])
    return all(len({d[n] for d in maps}) == 1 for n in shared)


def _has_norm(module: nn.Module) -> bool:
    return any(isinstance(m, _NORMS) or "norm" in type(m).__name__.lower() for m in module.modules())


def _nothing_found_message(model: nn.Module, named: Named) -> str:
    containers = [n for n, m in named if isinstance(m, _CONTAINERS)]
    hinted = sorted(_no_split_names(model, named))
    hint = (
        f"Hugging Face `_no_split_modules` {hinted} (none of them is stacked)"
        if hinted
        else "Hugging Face `_no_split_modules` (not present)"
    )
    composite = [type(m).__name__ for _, m in named if _is_composite(m) and not isinstance(m, _CONTAINERS)]
    weighted = [type(m).__name__ for _, m in named if any(True for _ in m.parameters(recurse=False))]
    example_cls = (composite or weighted or ["MyBlock"])[0]
    if isinstance(model, _CONTAINERS):
        example_path = "*"
    elif containers:
        example_path = f"{containers[0]}.*"
    else:
        example_path = named[0][0] if named else "layers.*"
    return (
        f"No repeated blocks found in {type(model).__name__}: searched {hint} and "
        f"{len(containers) + isinstance(model, _CONTAINERS)} nn.ModuleList / nn.Sequential / nn.ModuleDict "
        "container(s) for ≥ 2 sibling modules of the same class that have children of their own. Pass "
        f"`blocks=` explicitly: a class, a class name such as {example_cls!r}, a path glob such as "
        f"{example_path!r}, or a list of these."
    )


def describe_blocks(found: List[Tuple[str, nn.Module]], limit: Optional[int] = 4) -> str:
    """Short text such as ``'12 × GPT2Block at transformer.h.0 … transformer.h.11'``."""
    if not found:
        return "no blocks"
    classes = sorted({type(m).__name__ for _, m in found})
    if limit is not None and len(classes) > limit:
        classes = classes[:limit] + ["…"]
    first, last = found[0][0], found[-1][0]
    span = first if len(found) == 1 else f"{first} … {last}"
    return f"{len(found)} × {'/'.join(classes)} at {span}"
