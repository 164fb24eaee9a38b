"""Boundary policies: which of L repeated blocks is checkpointed, and how.

A policy is a small frozen dataclass with a canonical string form (``policy.spec``) so that the same value
travels through Python, YAML and the command line. :func:`parse_policy` turns the string back into the object.

Grammar (``parse_policy``):

===========================  ==================================================================================
``none``                     wrap nothing (measure only)
``all``                      every block is its own checkpointed region
``every:N``                  blocks 0, N, 2N, … (the last block is skipped when it falls off the grid: its
                             activations are consumed first in backward, so recomputing it buys little)
``first:K``                  the first K blocks
``blocks:0-5,9``             explicit block indices and inclusive ranges
``group:K`` / ``group:sqrt`` regions of K consecutive blocks replayed as one (√L: Chen et al. 2016)
``selective``                op-level: save the outputs of matmuls and attention, recompute the rest
``selective:mm,sdpa``        op-level with an explicit save list (aliases ``mm``, ``sdpa``, ``conv`` or any
                             ``torch.ops.aten`` op name that does not always draw random numbers)
``offload``                  keep saved activations in host memory instead of recomputing them
``budget:18GiB``             reserved: the cheapest plan whose measured activation peak fits (needs measurement)
===========================  ==================================================================================

One case rule: the string is case-insensitive and read lower-cased (names, modes, op names; a budget's size keeps
its units as written in ``spec``). Numbers are the ASCII digits 0-9 only (``int()`` would read ``2_0`` and ``٢``).
``group:K`` regions stay within one stack (:meth:`GroupPolicy.layout`'s ``stacks``).

Per-block modes (:data:`MODES`, and ``modes:off,recompute,compiler:0.5,...``, ending in ``save=gelu+mm`` when the
save list of its ``selective`` blocks is not the default one) also include
``compiler:<fraction>``: no checkpoint wrapper; the block's compiled graph runs under
``torch.autograd.graph.region_activation_memory_budget(fraction)``, so the compiler's min-cut partitioner chooses
per operator what the block keeps (``0.0``: as little as a full recompute, ``1.0``: as ``off``). It needs the block
compiled as its own graph (``block.compile()``); run eagerly the block runs as ``off``.

``selective`` never keeps a call that draws random numbers: a kept op is skipped when its block is replayed in
backward, so it would leave the generator behind and every later random op of the block (dropout) would draw a
shifted stream, giving wrong gradients. An op that always draws (``native_dropout``, ``bernoulli``, ``rand_like``, …:
PyTorch tags it ``nondeterministic_seeded``) is refused in a save list; an op with a ``dropout_p`` argument (the
fused attention kernels, tagged too whatever their ``dropout_p``) is kept only in calls with ``dropout_p == 0``,
decided per call when the block runs (:mod:`lightning_ckpt.core.wrap`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List, Sequence, Tuple, Type, Union

from lightning_ckpt.core.units import parse_size_or_fraction

__all__ = [
    "COMPILER_MODE",
    "GRAMMAR",
    "MODES",
    "SELECTIVE_ALIASES",
    "AllPolicy",
    "BlocksPolicy",
    "BudgetPolicy",
    "EveryPolicy",
    "FirstPolicy",
    "GroupPolicy",
    "Layout",
    "ModesPolicy",
    "NonePolicy",
    "OffloadPolicy",
    "Policy",
    "SelectivePolicy",
    "compiler_budget_unavailable",
    "compiler_fraction",
    "compiler_modes",
    "is_mode",
    "parse_policy",
    "parse_policy_list",
]

_SIGNED_INT = re.compile(r"-?[0-9]+")
_ASCII_NUMBER = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?")

MODES = ("off", "recompute", "selective", "offload")
"""Per-block modes. ``off`` runs the plain forward; the other three are switchable at run time."""

COMPILER_MODE = "compiler"
"""The family of per-block modes ``compiler:<fraction>`` (see the module docstring)."""


def compiler_fraction(mode: str) -> Union[float, None]:
    """The fraction of a ``compiler:<fraction>`` mode (``None`` for any other string or a malformed fraction)."""
    if not isinstance(mode, str) or not mode.startswith(COMPILER_MODE + ":"):
        return None
    text = mode[len(COMPILER_MODE) + 1:]
    if not _ASCII_NUMBER.fullmatch(text):  # float() also reads '0_5' and non-ASCII digits
        return None
    fraction = float(text)
    return fraction if 0.0 <= fraction <= 1.0 else None


def compiler_modes(modes: Sequence[str]) -> List[str]:
    """The distinct ``compiler:<fraction>`` modes among ``modes``, sorted (empty when a plan has none)."""
    return sorted({m for m in modes if compiler_fraction(m) is not None})


def compiler_budget_unavailable() -> Union[str, None]:
    """Why the ``compiler:<fraction>`` modes cannot run with the installed torch (``None`` when they can): they
    annotate the block's graph with ``torch.autograd.graph.region_activation_memory_budget``, which torch 2.11 lacks
    and torch 2.14 has."""
    import torch

    if hasattr(torch.autograd.graph, "region_activation_memory_budget"):
        return None
    return (f"the modes '{COMPILER_MODE}:<fraction>' need torch.autograd.graph.region_activation_memory_budget, which "
            f"torch {torch.__version__} does not have (torch 2.14 does)")


def is_mode(mode: str) -> bool:
    """Whether ``mode`` is a per-block mode: one of :data:`MODES` or ``compiler:<fraction in [0, 1]>``."""
    return mode in MODES or compiler_fraction(mode) is not None

GRAMMAR = (
    "none | all | every:N | first:K | blocks:0-5,9 | group:K | group:sqrt | selective | "
    "selective:mm,sdpa,... | offload | budget:<size|fraction>"
)

SELECTIVE_ALIASES: Dict[str, Tuple[str, ...]] = {
    "mm": ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"),
    "sdpa": (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ),
    "conv": ("convolution",),
}
_DEFAULT_SELECTIVE = ("mm", "sdpa")


@dataclass(frozen=True)
class Layout:
    """What a policy means for a model with a given number of blocks.

    Attributes:
        modes: one entry of :data:`MODES` per block.
        groups: half-open ``(start, stop)`` index ranges of consecutive ``recompute`` blocks replayed as one
            region; blocks outside every group are their own region.
        save_ops: aten op names whose outputs ``selective`` blocks keep.
    """

    modes: Tuple[str, ...]
    groups: Tuple[Tuple[int, int], ...] = ()
    save_ops: Tuple[str, ...] = ()

    @property
    def num_checkpointed(self) -> int:
        return sum(mode != "off" for mode in self.modes)


class Policy:
    """Base class: a policy maps a block count to a :class:`Layout`."""

    name: ClassVar[str] = ""

    @property
    def spec(self) -> str:
        """The canonical string; ``parse_policy(p.spec) == p``."""
        raise NotImplementedError  # abstract: every concrete policy overrides it

    def layout(self, num_blocks: int) -> Layout:
        raise NotImplementedError  # abstract: every concrete policy overrides it

    def __str__(self) -> str:
        return self.spec


def _uniform(num_blocks: int, mode: str, indices=None) -> Layout:
    chosen = set(range(num_blocks)) if indices is None else set(indices)
    return Layout(tuple(mode if i in chosen else "off" for i in range(num_blocks)))


@dataclass(frozen=True)
class NonePolicy(Policy):
    name: ClassVar[str] = "none"
    spec = "none"

    def layout(self, num_blocks: int) -> Layout:
        return _uniform(num_blocks, "off")


@dataclass(frozen=True)
class AllPolicy(Policy):
    name: ClassVar[str] = "all"
    spec = "all"

    def layout(self, num_blocks: int) -> Layout:
        return _uniform(num_blocks, "recompute")


@dataclass(frozen=True)
class EveryPolicy(Policy):
    n: int = 2
    name: ClassVar[str] = "every"

    def __post_init__(self) -> None:
        _check_positive_int("every", self.n, "N")

    @property
    def spec(self) -> str:
        return f"every:{self.n}"

    def layout(self, num_blocks: int) -> Layout:
        return _uniform(num_blocks, "recompute", range(0, num_blocks, self.n))


@dataclass(frozen=True)
class FirstPolicy(Policy):
    k: int = 1
    name: ClassVar[str] = "first"

    def __post_init__(self) -> None:
        _check_positive_int("first", self.k, "K", allow_zero=True)

    @property
    def spec(self) -> str:
        return f"first:{self.k}"

    def layout(self, num_blocks: int) -> Layout:
        if self.k > num_blocks:  # refused like blocks: beyond the model, rather than silently meaning 'all'
            raise ValueError(
                f"policy {self.spec!r} asks for the first {self.k} blocks but the model has {num_blocks} blocks; "
                f"pass 'first:{num_blocks}' or fewer (or 'all')."
            )
        return _uniform(num_blocks, "recompute", range(self.k))


@dataclass(frozen=True)
class BlocksPolicy(Policy):
    indices: Tuple[int, ...] = ()
    name: ClassVar[str] = "blocks"

    def __post_init__(self) -> None:
        if not self.indices:
            raise ValueError("blocks: needs indices, e.g. 'blocks:0-5,9'.")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.indices):
            raise ValueError(f"blocks: indices must be non-negative ints, got {self.indices!r}.")
        object.__setattr__(self, "indices", tuple(sorted(set(self.indices))))

    @property
    def spec(self) -> str:
        return "blocks:" + ",".join(_compress_ranges(self.indices))

    def layout(self, num_blocks: int) -> Layout:
        too_big = [i for i in self.indices if i >= num_blocks]
        if too_big:
            raise ValueError(
                f"policy {self.spec!r} names block indices {too_big} but the model has {num_blocks} blocks "
                f"(valid indices 0-{num_blocks - 1}); fix the index list."
            )
        return _uniform(num_blocks, "recompute", self.indices)


@dataclass(frozen=True)
class GroupPolicy(Policy):
    """Regions of ``k`` consecutive blocks replayed as one; ``k="sqrt"`` picks ⌈√L⌉ (Chen et al. 2016)."""

    k: Union[int, str] = "sqrt"
    name: ClassVar[str] = "group"

    def __post_init__(self) -> None:
        if isinstance(self.k, str) and self.k.strip().lower() == "sqrt":
            object.__setattr__(self, "k", "sqrt")
        if self.k != "sqrt":
            _check_positive_int("group", self.k, "K")

    @property
    def spec(self) -> str:
        return f"group:{self.k}"

    def size(self, num_blocks: int) -> int:
        if self.k == "sqrt":
            return max(1, math.ceil(math.sqrt(num_blocks)))
        return int(self.k)

    def layout(self, num_blocks: int, stacks: Sequence[int] = ()) -> Layout:
        """Regions of K blocks within each stack: ``stacks`` gives the lengths of the runs of blocks that share a
        parent (an encoder's, then a decoder's); a region never spans two. ``group:sqrt`` takes ⌈√L⌉ of each
        stack's own length L. Empty: one stack of ``num_blocks``."""
        stacks = tuple(stacks) or (num_blocks,)
        if sum(stacks) != num_blocks:
            raise ValueError(f"stacks {stacks} do not add up to {num_blocks} blocks.")
        groups, start = [], 0
        for length in stacks:
            k, stop = self.size(length), start + length
            groups.extend((s, min(s + k, stop)) for s in range(start, stop, k) if min(s + k, stop) - s > 1)
            start = stop
        return Layout(("recompute",) * num_blocks, tuple(groups))


@dataclass(frozen=True)
class SelectivePolicy(Policy):
    """Op-level selective checkpointing: keep the outputs of ``ops``, recompute everything else."""

    ops: Tuple[str, ...] = _DEFAULT_SELECTIVE
    name: ClassVar[str] = "selective"

    def __post_init__(self) -> None:
        # one case rule everywhere: names are read lower-cased; a repeated name counts once
        object.__setattr__(self, "ops", tuple(dict.fromkeys(str(op).strip().lower() for op in self.ops)))
        if not self.ops:
            raise ValueError("selective: needs at least one op name, e.g. 'selective:mm,sdpa'.")
        self.aten_ops()  # validate names eagerly, before training starts

    @property
    def spec(self) -> str:
        return "selective" if self.ops == _DEFAULT_SELECTIVE else "selective:" + ",".join(self.ops)

    def aten_ops(self) -> Tuple[str, ...]:
        """The aten op names the aliases expand to (only those this torch build has)."""
        import torch

        names = []
        for op in self.ops:
            expanded = SELECTIVE_ALIASES.get(op, (op,))
            present = [n for n in expanded if hasattr(torch.ops.aten, n)]
            if not present:
                raise ValueError(
                    f"selective: unknown op {op!r}; use an alias ({', '.join(SELECTIVE_ALIASES)}) or a "
                    f"torch.ops.aten op name such as 'mm', 'addmm', 'gelu'."
                )
            for name in present:
                _refuse_random_op(name)
            names.extend(n for n in present if n not in names)
        return tuple(names)

    def layout(self, num_blocks: int) -> Layout:
        return Layout(("selective",) * num_blocks, save_ops=self.aten_ops())


@dataclass(frozen=True)
class OffloadPolicy(Policy):
    name: ClassVar[str] = "offload"
    spec = "offload"

    def layout(self, num_blocks: int) -> Layout:
        return _uniform(num_blocks, "offload")


@dataclass(frozen=True)
class BudgetPolicy(Policy):
    """The cheapest per-block plan whose measured activation peak fits ``budget``.

    It depends on measurements taken during training, so it is resolved by the measuring callback, never by
    the static :meth:`layout`.
    """

    budget: Union[int, float, str] = 0.8
    name: ClassVar[str] = "budget"

    def __post_init__(self) -> None:
        text = self.budget.strip() if isinstance(self.budget, str) else self.budget
        try:
            if isinstance(text, str) and (not text.isascii() or "_" in text):  # float() reads '0.0_1' and '٠.٥'
                raise ValueError(text)
            parsed = parse_size_or_fraction(text, name="budget")
        except ValueError:  # one wording for every bad value: '-1GiB', '0', '0.0', '1.5', '18XB'
            raise ValueError(
                f"budget={text!r} is not a budget: pass a positive size such as '18GiB' or '512MiB' (units B, KiB, "
                "MiB, GiB, TiB, KB, MB, GB, TB) or a fraction of capacity in (0, 1] such as 0.8."
            ) from None
        object.__setattr__(self, "budget", parsed)  # bytes (int) or a fraction (float), for computing
        # the user's own units, for spec and messages; '18 GiB' prints '18GiB' (one word on a command line)
        object.__setattr__(self, "_text", "".join(str(text).split()))

    @property
    def spec(self) -> str:
        """``budget:`` and the value as the user wrote it (``budget:1MiB``, not ``budget:1048576``); it parses back
        to an equal policy (equality and hash compare the parsed bytes or fraction)."""
        return f"budget:{self._text}"

    def layout(self, num_blocks: int) -> Layout:
        raise ValueError(
            f"policy {self.spec!r} is chosen from measured activation memory, so it cannot be applied "
            "statically; use a fixed policy such as 'all' or 'every:2' with apply_policy()."
        )


@dataclass(frozen=True)
class ModesPolicy(Policy):
    """An explicit per-block mode list, e.g. produced by a planner; spec ``modes:off,recompute,...``."""

    modes: Tuple[str, ...] = ()
    save_ops: Tuple[str, ...] = ()
    name: ClassVar[str] = "modes"

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(m.strip().lower() if isinstance(m, str) else m for m in self.modes))
        bad = sorted({m for m in self.modes if not is_mode(m)})
        if bad:
            raise ValueError(f"unknown block modes {bad}; valid modes are {list(MODES)} and "
                             f"'{COMPILER_MODE}:<fraction in [0, 1]>' (e.g. '{COMPILER_MODE}:0.5').")
        compiled = compiler_modes(self.modes)
        missing = compiler_budget_unavailable() if compiled else None
        if missing:
            raise ValueError(f"modes {compiled}: upgrade torch or choose among {list(MODES)} — {missing}.")
        save_ops = tuple(dict.fromkeys(str(op).strip().lower() for op in self.save_ops))
        default = SelectivePolicy().aten_ops()
        if "selective" in self.modes and not save_ops:
            save_ops = default
        elif "selective" not in self.modes and save_ops == default:
            save_ops = ()  # the default list is what 'selective' gets anyway: one spelling for one plan
        object.__setattr__(self, "save_ops", save_ops)
        for name in self.save_ops:  # an explicit list (a planner's) is held to the same rule as a parsed one
            _refuse_random_op(name)

    @property
    def spec(self) -> str:
        """``modes:<mode>,<mode>,...``, then ``save=<op>+<op>`` when the save list is not the default one (aliases
        where a whole alias is listed), so a plan's state carries its save list."""
        spec = "modes:" + ",".join(self.modes)
        if self.save_ops and self.save_ops != SelectivePolicy().aten_ops():
            spec += "," + _SAVE_PREFIX + "+".join(_with_aliases(self.save_ops))
        return spec

    def layout(self, num_blocks: int) -> Layout:
        if len(self.modes) != num_blocks:
            raise ValueError(f"{len(self.modes)} block modes given for a model with {num_blocks} blocks.")
        return Layout(self.modes, save_ops=self.save_ops)


_SAVE_PREFIX = "save="


def _with_aliases(names: Sequence[str]) -> List[str]:
    """``names`` (aten op names) with each alias whose every present op is listed written as the alias."""
    import torch

    out: List[str] = []
    covered = set()
    for name in names:
        if name in covered:
            continue
        alias = next((a for a, ops in SELECTIVE_ALIASES.items()
                      if name in ops and {o for o in ops if hasattr(torch.ops.aten, o)} <= set(names)), None)
        if alias is None:
            out.append(name)
        else:
            out.append(alias)
            covered.update(SELECTIVE_ALIASES[alias])
    return out


def _parse_modes(arg: str) -> "ModesPolicy":
    """``off,recompute,...`` with an optional last item ``save=<op>+<op>`` (the save list of ``selective``)."""
    items = [s.strip() for s in arg.split(",")]
    save = [s for s in items if s.startswith(_SAVE_PREFIX)]
    modes = tuple(s for s in items if not s.startswith(_SAVE_PREFIX))
    if not save:
        return ModesPolicy(modes)
    if len(save) > 1 or items[-1] != save[0]:
        raise ValueError(f"give one {_SAVE_PREFIX!r} item, after the modes, e.g. 'modes:off,selective,save=gelu+mm'.")
    ops = tuple(op.strip() for op in save[0][len(_SAVE_PREFIX):].split("+") if op.strip())
    return ModesPolicy(modes, SelectivePolicy(ops).aten_ops())


def _refuse_random_op(name: str) -> None:
    """Raise for an aten op that always draws random numbers: ``selective`` must never keep its output.

    The ``nondeterministic_seeded`` tag of any overload decides, except for ops with a ``dropout_p`` argument: PyTorch
    tags every fused attention kernel whatever its ``dropout_p``, and those are decided per call instead.
    """
    import torch

    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        raise ValueError(f"selective: unknown op {name!r}; use a torch.ops.aten op name such as 'mm', 'addmm', 'gelu'.")
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    if any(any(a.name == "dropout_p" for a in op._schema.arguments) for op in overloads):
        return
    if any(torch.Tag.nondeterministic_seeded in op.tags for op in overloads):
        raise ValueError(
            f"selective: drop {name!r} from the save list (e.g. 'selective:mm,sdpa'): it draws random numbers, and a "
            "kept op is skipped when its block is replayed, so every later random op of the block would draw a "
            "shifted stream and the gradients would be wrong."
        )


def _check_positive_int(policy: str, value, label: str, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{policy}:{label} needs an integer ≥ {low}, got {value!r} (e.g. '{policy}:2').")


def _compress_ranges(indices: Tuple[int, ...]):
    runs = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]


def _parse_int(text: str, policy: str, label: str) -> int:
    text = text.strip()
    if _SIGNED_INT.fullmatch(text):
        return int(text)
    # int() also reads '2_0' and non-ASCII digits ('٢'): a number here is the digits 0-9 only
    odd = "_" in text or any(c.isdigit() and not c.isascii() for c in text)
    digits = " written with the digits 0-9 only" if odd else ""
    raise ValueError(f"{policy}:{label} needs an integer{digits}, got {text!r} (e.g. '{policy}:2').")


def _parse_indices(arg: str) -> Tuple[int, ...]:
    out = []
    for part in filter(None, (p.strip() for p in arg.split(","))):
        if part.startswith("-"):
            raise ValueError(f"blocks: indices must be ≥ 0, got {part!r}.")
        lo, sep, hi = part.partition("-")
        if sep and (not hi.strip() or "-" in hi):
            raise ValueError(f"blocks: write the range {part!r} as low-high with one '-' between two indices ≥ 0, "
                             "e.g. 'blocks:0-2'.")
        a = _parse_int(lo, "blocks", "index")
        b = _parse_int(hi, "blocks", "index") if sep else a
        if b < a:
            raise ValueError(f"blocks: range {part!r} runs backwards; write it low-high, e.g. '0-5'.")
        out.extend(range(a, b + 1))
    if not out:
        raise ValueError("blocks: needs indices, e.g. 'blocks:0-5,9'.")
    return tuple(out)


_PARSERS: Dict[str, Callable[[str], Policy]] = {
    "none": lambda a: NonePolicy(),
    "all": lambda a: AllPolicy(),
    "offload": lambda a: OffloadPolicy(),
    "every": lambda a: EveryPolicy(_parse_int(a, "every", "N")),
    "first": lambda a: FirstPolicy(_parse_int(a, "first", "K")),
    "blocks": lambda a: BlocksPolicy(_parse_indices(a)),
    "group": lambda a: GroupPolicy("sqrt" if a.lower() == "sqrt" else _parse_int(a, "group", "K")),
    "selective": lambda a: SelectivePolicy(tuple(s.strip() for s in a.split(",") if s.strip()))
    if a else SelectivePolicy(),
    "budget": lambda a: BudgetPolicy(a),
    "modes": _parse_modes,
}
_NEEDS_ARG = {"every", "first", "blocks", "group", "budget", "modes"}
_OPTIONAL_ARG = {"selective"}  # bare name: the default save list; with ':' an explicit, non-empty list
_NO_ARG = {"none", "all", "offload"}
POLICY_TYPES: Dict[str, Type[Policy]] = {
    cls.name: cls
    for cls in (NonePolicy, AllPolicy, EveryPolicy, FirstPolicy, BlocksPolicy, GroupPolicy, SelectivePolicy,
                OffloadPolicy, BudgetPolicy, ModesPolicy)
}


def parse_policy(policy: Union[str, Policy, None]) -> Policy:
    """Turn a policy string (or object, returned as is) into a :class:`Policy`.

    Raises:
        ValueError: for an unknown name or a malformed argument; the message lists the grammar.
        TypeError: for a value that is neither a string nor a :class:`Policy`.
    """
    if isinstance(policy, Policy):
        return policy
    if policy is None:
        return NonePolicy()
    if not isinstance(policy, str):
        raise TypeError(f"policy={policy!r} must be a string such as 'every:2' or a Policy; grammar: {GRAMMAR}.")
    name, sep, arg = policy.strip().partition(":")
    name, arg = name.strip().lower(), arg.strip()
    if name != "budget":  # one case rule: names, modes and op names are read lower-cased (a size keeps its units)
        arg = arg.lower()
    if name not in _PARSERS:
        import difflib

        close = difflib.get_close_matches(name, list(_PARSERS), n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"Unknown policy {policy!r}.{hint} Valid policies: {GRAMMAR}.")
    if (name in _NEEDS_ARG or (name in _OPTIONAL_ARG and sep)) and not arg:
        raise ValueError(f"policy {policy!r} needs an argument after ':'. Valid policies: {GRAMMAR}.")
    if name in _NO_ARG and sep:
        raise ValueError(f"policy {policy!r}: {name!r} takes no argument. Valid policies: {GRAMMAR}.")
    try:
        return _PARSERS[name](arg)
    except (ValueError, TypeError) as err:
        raise ValueError(f"Malformed policy {policy!r}: {err} Valid policies: {GRAMMAR}.") from None


def parse_policy_list(values: Union[str, Sequence[str]], arg: str = "--policies") -> Tuple[str, ...]:
    """Fixed policies from ``"none,selective,every:2,all"`` (or a list), as written, duplicates dropped.

    A comma also separates the arguments of ``blocks:`` and ``selective:``, so a piece that is not a policy name
    on its own is joined to the one before (``"blocks:0,2,all"`` is ``blocks:0,2`` and ``all``).

    Raises:
        ValueError: an empty list, a malformed policy, or ``budget:`` (chosen from measurements during training,
            so it has no fixed meaning in a list).
    """
    items = [v.strip() for v in values.split(",")] if isinstance(values, str) else [str(v).strip() for v in values]
    merged: List[str] = []
    for item in items:
        if not item:
            continue
        if merged and item.split(":", 1)[0].strip().lower() not in _PARSERS:
            merged[-1] += "," + item
        else:
            merged.append(item)
    if not merged:
        raise ValueError(f"{arg}={values!r} is empty; pass e.g. 'none,selective,every:2,all'.")
    specs = []
    for item in merged:
        parsed = parse_policy(item)
        if isinstance(parsed, BudgetPolicy):
            raise ValueError(f"{arg}: {item!r} is chosen from measurements during training, so it cannot be listed "
                             "here; list fixed policies (none, selective, every:N, all, ...).")
        specs.append(item)
    return tuple(dict.fromkeys(specs))
