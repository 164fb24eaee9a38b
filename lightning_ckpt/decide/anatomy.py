"""The anatomy of a step's peak: what the blocks keep in hidden-width units, and findings named from the tensors.

From an attribution (:mod:`lightning_ckpt.measure.attribution`: every storage alive at a moment, with its module,
op, shape, dtype and role) this module says what a person staring at "CUDA out of memory" wants to read next.

**Hidden-width units.** A *hidden-width tensor* is one ``micro-batch × sequence × hidden width`` tensor in the run's
activation dtype (the autocast dtype under mixed precision): the textbook worked example counts "six hidden-width
tensors per block". Each block's kept bytes at the end of the forward — what it holds for backward — are given in
those units, part by part (``1.0 kept by fc1, 4.0 kept by act, 4.0 kept by fc2``), with the boundaries the plan
keeps and this run's blocks × tensors × bytes arithmetic (``4 blocks × 9.0 × 8.0 KiB = 288.0 KiB``).

**Findings**, each a stable code with the tensors, their bytes and one line of advice, derived from shapes, dtypes
and roles, not from op names:

======================  ==========================================================================================
code                    what it is
======================  ==========================================================================================
``attention_scores``    a kept tensor whose last two dimensions are both the sequence length: a materialised
                        attention matrix, whichever op made it
``logits_upcast``       a float32 tensor of ``batch × sequence × vocabulary`` under mixed precision (the loss's
                        upcast)
``wide_mlp``            feed-forward tensors wider than the hidden width hold most of a block's kept bytes
``outside_blocks``      what checkpointing the blocks cannot reach (embedding, head, loss), and its share
``workspace``           a large temporary at the peak that is not kept (a kernel's scratch, an unfused op's output)
``autocast_copies``     low-precision copies of the weights alive at the peak, and which weights
======================  ==========================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.measure.attribution import PeakAttribution, PeakTensor

__all__ = ["FINDINGS", "Finding", "anatomy", "anatomy_text", "block_units", "config_int", "hidden_width",
           "model_anatomy", "tensor_rows", "vocab_size"]

FINDINGS = ("attention_scores", "logits_upcast", "wide_mlp", "outside_blocks", "workspace", "autocast_copies")
"""The stable finding codes (documented in the module docstring and on the Diagnosis page)."""

_VOCAB_NAMES = ("vocab_size", "n_vocab", "padded_vocab_size")
_HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "embed_dim")
_WORKSPACE_SHARE = 0.10  # a temporary of at least this share of the activation peak is a workspace finding
_OUTSIDE_SHARE = 0.25
_WIDE_SHARE = 0.5


def config_int(model: nn.Module, names: Sequence[str]) -> Optional[int]:
    """The first positive integer named by one of ``names`` on a module of ``model`` (in ``modules()`` order, the
    model itself first) or on its ``config`` (Hugging Face); ``None`` when none says."""
    for module in model.modules():
        for holder in (getattr(module, "config", None), module):
            for name in names:
                value = getattr(holder, name, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def vocab_size(model: nn.Module) -> Optional[int]:
    """The vocabulary size: a config's or module's (``vocab_size``, ``n_vocab``, ``padded_vocab_size``), else the
    first embedding's number of rows."""
    size = config_int(model, _VOCAB_NAMES)
    if size is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        size = embedding.num_embeddings if embedding is not None else None
    return size


def hidden_width(model: nn.Module) -> Optional[int]:
    """The model's hidden width: its config's (``hidden_size``, ``n_embd``, ``d_model``, ...), else its first
    embedding's dimension; ``None`` when neither says."""
    width = config_int(model, _HIDDEN_NAMES)
    if width is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        width = embedding.embedding_dim if embedding is not None else None
    return width


@dataclass(frozen=True)
class Finding:
    """One named observation about the peak: a stable ``code``, the ``bytes`` concerned, the tensors, advice."""

    code: str
    bytes: int
    text: str
    advice: str
    tensors: List[PeakTensor] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {"code": self.code, "bytes": self.bytes, "text": self.text, "advice": self.advice,
                "tensors": [t.as_dict() for t in self.tensors[:5]]}


def _relative(path: Optional[str], block: str) -> str:
    """A module path inside ``block`` as the block sees it (``mlp.c_fc``); the block itself is ``block``; a path
    outside it as it is (the previous block's output kept as this one's input)."""
    if not path:  # made by the root module's own code, outside every block: an input to the block keeping it
        return "its input"
    if path == block:
        return "the block's code"
    return path[len(block) + 1:] if path.startswith(block + ".") else "its input"


def block_units(forward_end: PeakAttribution, unit: int, blocks: Sequence[str] = ()) -> Dict[int, List[tuple]]:
    """Per block, what it keeps at the end of the forward as ``(hidden-width tensors, description)``, largest first:
    tensors summed per (keeper, maker), named as the block sees them (``unit``: the bytes of one hidden-width
    tensor); what rounds to less than 0.05 of a tensor is summed as ``small tensors``."""
    sums: Dict[int, Dict[str, int]] = {}
    for t in forward_end.tensors:
        if t.role == "kept" and t.block is not None:
            block = blocks[t.block] if t.block < len(blocks) else ""
            maker = _relative(t.module, block)
            keeper = _relative(t.kept_by or t.module, block)
            what = f"its input kept by {keeper}" if maker == "its input" else f"output of {maker} kept by {keeper}"
            sums.setdefault(t.block, {})[what] = sums.setdefault(t.block, {}).get(what, 0) + t.bytes
    out: Dict[int, List[tuple]] = {}
    for block, parts in sums.items():
        big = sorted(((n / unit, what) for what, n in parts.items() if n / unit >= 0.05), key=lambda p: -p[0])
        small = sum(n for n in parts.values() if n / unit < 0.05)
        out[block] = big + ([(small / unit, "small tensors")] if small else [])
    return out


def anatomy(attribution: Dict[str, PeakAttribution], samples: int, length: Optional[int], hidden: Optional[int],
            element_size: int, vocab: Optional[int] = None, mixed: bool = False,
            blocks: Sequence[str] = (), checkpointed: Sequence[bool] = ()) -> Dict[str, Any]:
    """The report's ``peak`` section: the tensors at the peak, per block in hidden-width tensors with the
    blocks × tensors × bytes arithmetic, and the findings (see the module docstring)."""
    peak = attribution.get("activation peak")
    end = attribution.get("forward end")
    out: Dict[str, Any] = {"samples": samples, "length": length, "hidden": hidden, "element_size": element_size,
                           "shape": f"{samples} x {length}" if length else str(samples)}
    if peak is not None:
        out["activation_peak"] = peak.as_dict()
    if attribution.get("total peak") is not None:
        out["total_peak"] = attribution["total peak"].as_dict()
    unit = samples * (length or 0) * (hidden or 0) * element_size
    if end is not None and unit:
        out["unit_bytes"] = unit
        units = block_units(end, unit, blocks)
        per_block = []
        for i, name in enumerate(blocks or sorted(units)):
            parts = units.get(i, [])
            per_block.append({"block": i, "name": name if blocks else str(name),
                              "kept": end.per_block.get(i, 0), "hidden_tensors": round(sum(p[0] for p in parts), 2),
                              "parts": [{"hidden_tensors": round(x, 2), "what": what} for x, what in parts]})
        out["per_block"] = per_block
        out["outside_blocks"] = end.outside
        out["arithmetic"] = _arithmetic(per_block, unit, checkpointed)
    out["findings"] = [f.as_dict() for f in findings(attribution, samples, length, hidden, vocab, mixed)]
    return out


def _arithmetic(per_block: List[Dict[str, Any]], unit: int, checkpointed: Sequence[bool]) -> List[str]:
    """The worked example's ``24 × 6 × 16 MiB = 2304 MiB`` lines with this run's numbers."""
    if not per_block:
        return []
    counts = [b["hidden_tensors"] for b in per_block]
    lines = []
    plain = [c for c, cp in zip(counts, checkpointed or [False] * len(counts)) if not cp]
    if plain:
        mean = sum(plain) / len(plain)
        lines.append(f"{len(plain)} blocks kept whole × {mean:.1f} hidden-width tensors × {format_bytes(unit)} = "
                     f"{format_bytes(round(len(plain) * mean * unit))}")
    boundaries = [c for c, cp in zip(counts, checkpointed or []) if cp]
    if boundaries:
        mean = sum(boundaries) / len(boundaries)
        lines.append(f"{len(boundaries)} checkpointed blocks × {mean:.1f} hidden-width tensors (their boundaries) × "
                     f"{format_bytes(unit)} = {format_bytes(round(len(boundaries) * mean * unit))}")
    return lines


def findings(attribution: Dict[str, PeakAttribution], samples: int, length: Optional[int], hidden: Optional[int],
             vocab: Optional[int] = None, mixed: bool = False) -> List[Finding]:
    """The named findings of a step's attribution (codes: :data:`FINDINGS`)."""
    peak = attribution.get("activation peak")
    end = attribution.get("forward end") or peak
    total = attribution.get("total peak") or peak
    out: List[Finding] = []
    if peak is None:
        return out
    seen = {id(t): t for a in (end, peak) if a is not None for t in a.tensors}.values()
    if length:
        # (..., length, length), with more than the micro-batch in front: (B, heads, T, T) or (B * heads, T, T);
        # a (B, T, hidden) tensor whose hidden width happens to equal the length is not one
        scores = [t for t in seen if t.role in ("kept", "replay") and len(t.shape) >= 3
                  and t.shape[-1] == length and t.shape[-2] == length and _numel(t.shape[:-2]) > samples]
        if scores:
            size = sum(t.bytes for t in scores)
            out.append(Finding("attention_scores", size, f"{len(scores)} materialised attention matrices "
                               f"(... × {length} × {length}), {format_bytes(size)}, first made by "
                               f"{scores[0].module} ({scores[0].op})",
                               "Fix the attention implementation first: scaled_dot_product_attention (attn_"
                               "implementation='sdpa') keeps no score matrix; on the CPU, SDPA with dropout falls "
                               "back to the math kernel, which keeps one.", scores))
    if vocab and length:
        upcasts = [t for t in (total.tensors if total else []) if t.dtype == "float32" and mixed
                   and _numel(t.shape) == samples * length * vocab]
        if upcasts:
            size = sum(t.bytes for t in upcasts)
            # the logits they copy: the low-precision tensor of the same size, and the module that made it (the head)
            source = next((t.module for a in (total, peak) if a is not None for t in a.tensors
                           if t.dtype in ("bfloat16", "float16") and _numel(t.shape) == samples * length * vocab
                           and t.module), None)
            made = f"of {source}'s output" if source else "of the logits"
            out.append(Finding("logits_upcast", size, f"float32 copies {made} (batch × sequence × vocabulary), "
                               f"{format_bytes(size)}, made by {upcasts[0].module or 'the loss'} "
                               f"({upcasts[0].op})",
                               "Compute the loss in chunks or with a fused cross-entropy: the float32 copy of the "
                               "logits is not an activation checkpointing can remove.", upcasts))
    if hidden and end is not None:
        for block, size in sorted(end.per_block.items()):
            wide = [t for t in end.tensors if t.block == block and t.role == "kept" and t.shape
                    and t.shape[-1] >= 2 * hidden]
            wide_bytes = sum(t.bytes for t in wide)
            if size and wide_bytes > _WIDE_SHARE * size:
                out.append(Finding("wide_mlp", wide_bytes, f"block {block}: feed-forward tensors wider than the "
                                   f"hidden width ({wide[0].shape[-1]} vs {hidden}) keep {wide_bytes / size:.0%} of "
                                   f"its {format_bytes(size)}",
                                   "The feed-forward activations dominate this block: 'selective' keeps the matmul "
                                   "outputs and recomputes the pointwise ops between them; 'recompute' keeps "
                                   "only the block's input.", wide))
                break  # one line for the model: blocks are alike
    if peak.bytes:
        share = peak.outside / peak.bytes
        outside = [t for t in peak.tensors if t.block is None]
        if share >= _OUTSIDE_SHARE:
            out.append(Finding("outside_blocks", peak.outside, f"{share:.0%} of the activation peak "
                               f"({format_bytes(peak.outside)}) lies outside the blocks (embedding, head, loss)",
                               "Checkpointing the blocks cannot reach it: it is the floor of every plan. A smaller "
                               "micro-batch, a chunked loss, or checkpointing the head lower it.", outside))
        temporaries = [t for t in peak.tensors if t.role == "temporary" and t.bytes >= _WORKSPACE_SHARE * peak.bytes]
        if temporaries:
            size = sum(t.bytes for t in temporaries)
            out.append(Finding("workspace", size, f"a temporary of {format_bytes(temporaries[0].bytes)} at the "
                               f"peak ({temporaries[0].op} in {temporaries[0].module or 'no module'}), not kept for "
                               "backward", "A fused kernel or computing it in chunks shrinks it; checkpointing "
                               "does not (it is not kept).", temporaries))
    copies = [t for t in (total.tensors if total else []) if t.role == "copy"]
    if copies:
        size = sum(t.bytes for t in copies)
        modules = sorted({t.module for t in copies if t.module})
        out.append(Finding("autocast_copies", size, f"autocast's low-precision copies of {len(copies)} weights "
                           f"({format_bytes(size)}) at the peak, made in {', '.join(modules[:3])}"
                           + (" ..." if len(modules) > 3 else ""),
                           "bf16-true, or FSDP mixed precision with bf16 parameters, makes no copies; checkpointing "
                           "cannot remove them.", copies))
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_anatomy(attribution: Dict[str, PeakAttribution], model: nn.Module, samples: int, length: Optional[int],
                  blocks: Sequence[str], modes: Sequence[str], autocast_dtype: Optional[torch.dtype] = None,
                  param_dtype: Optional[torch.dtype] = None, vocab: Optional[int] = None) -> Dict[str, Any]:
    """:func:`anatomy` with what it needs read from the model and its plan: the hidden width, the vocabulary, and
    the activation element size (the autocast dtype's under mixed precision, else ``param_dtype`` or the model's
    floating parameters')."""
    if param_dtype is None:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        param_dtype = param.dtype if param is not None else torch.float32
    element = (autocast_dtype or param_dtype).itemsize
    return anatomy(attribution, samples, length, hidden_width(model), element, vocab=vocab or vocab_size(model),
                   mixed=autocast_dtype is not None, blocks=blocks, checkpointed=[m != "off" for m in modes])


def tensor_rows(tensors: Sequence[Dict[str, Any]], indent: str = "") -> List[str]:
    """A table of tensors (the ``tensors`` of a ``peak`` moment): a header, then bytes, role, shape, dtype, the
    module and op that made each and the module that keeps it."""
    rows = [f"{indent}{'bytes':>10}  {'role':<9} {'shape':<18} {'dtype':<9} made by (op) / kept by"]
    for t in tensors:
        made = f"{t['module'] or '(no module)'} ({t['op']})" + (f" / {t['kept_by']}" if t["kept_by"] else "")
        rows.append(f"{indent}{format_bytes(t['bytes']):>10}  {t['role']:<9} {str(tuple(t['shape'])):<18} "
                    f"{t['dtype']:<9} {made}")
    return rows


def anatomy_text(data: Dict[str, Any], top: int = 8) -> str:
    """The ``peak`` section of the report as text: the largest tensors at the activation peak, each block in
    hidden-width tensors (identical blocks on one line), the blocks × tensors × bytes arithmetic and the findings."""
    rows: List[str] = []
    peak = data.get("activation_peak")
    if peak:
        where = f"step {data['step']}, " if data.get("step") is not None else ""
        rows.append(f"  what is alive at the activation peak ({where}batch {data.get('shape', '?')}, "
                    f"{peak['phase']} phase): {format_bytes(peak['bytes'])}, of which "
                    + ", ".join(f"{role} {format_bytes(v)}" for role, v in peak["by_role"].items() if v))
        rows.extend(tensor_rows(peak["tensors"][:top], indent="    "))
    blocks = data.get("per_block")
    if blocks:
        rows.append(f"  kept for backward at the end of the forward, in hidden-width tensors (micro-batch "
                    f"{data['samples']} x {data['length']} tokens x width {data['hidden']} x {data['element_size']} "
                    f"B = {format_bytes(data['unit_bytes'])} each):")
        groups: List[List[Dict[str, Any]]] = []
        for b in blocks:  # runs of blocks that keep the same
            if groups and _same(groups[-1][-1], b):
                groups[-1].append(b)
            else:
                groups.append([b])
        for group in groups:
            first, last = group[0], group[-1]
            name = f"block {first['block']}" if len(group) == 1 else f"blocks {first['block']}-{last['block']}"
            parts = " + ".join(f"{p['hidden_tensors']:.1f} {p['what']}" for p in first["parts"]) or "nothing"
            each = " each" if len(group) > 1 else ""
            rows.append(f"    {name}: {first['hidden_tensors']:.1f}{each} = {parts}")
        rows.append(f"    outside the blocks: {format_bytes(data.get('outside_blocks', 0))}")
        for line in data.get("arithmetic", []):
            rows.append(f"  the arithmetic for this run: {line}")
    for f in data.get("findings", []):
        rows.append(f"  [{f['code']}] {f['text']}. {f['advice']}")
    return "\n".join(rows)


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a["hidden_tensors"] == b["hidden_tensors"] and [p["hidden_tensors"] for p in a["parts"]] == [
        p["hidden_tensors"] for p in b["parts"]]
