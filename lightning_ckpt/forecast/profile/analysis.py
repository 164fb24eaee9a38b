"""What a profile concluded: the results, the recommendation and the seed's reading of the slopes (pure Python).

See :mod:`lightning_ckpt.forecast.profile` for what is measured; this module only reads the measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from lightning_ckpt.core.units import format_bytes
from lightning_ckpt.decide.report import loglog_slope

__all__ = ["ProfileReport", "ProfileResult", "read_slopes", "recommend"]


# ------------------------------------------------------------------------------------------------- results


@dataclass
class ProfileResult:
    """One configuration's measurements (see :mod:`lightning_ckpt.forecast.profile`); bytes are ``int``, ``None``
    = not measured."""

    name: str
    policy: str
    micro_batch: int
    seq_len: int
    accumulate: int = 1
    sweep: str = ""
    tokens_per_step: int = 0
    oom: bool = False
    error: Optional[str] = None
    activations: Optional[int] = None
    autocast_copies: Optional[int] = None
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    model_state: Optional[int] = None
    peak: Optional[int] = None
    peak_source: str = ""
    forward_s: Optional[float] = None
    backward_s: Optional[float] = None
    optimizer_s: Optional[float] = None
    step_s: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    fits: Optional[bool] = None
    loss: Optional[float] = None
    phase_peaks: Optional[Dict[str, int]] = None
    anatomy: Optional[Dict[str, Any]] = None

    @property
    def peak_phase(self) -> Optional[str]:
        """The phase that limits this configuration: the one with the highest peak (``None`` unmeasured)."""
        return max(self.phase_peaks, key=self.phase_peaks.get) if self.phase_peaks else None

    @property
    def ok(self) -> bool:
        return not self.oom and self.error is None


@dataclass
class ProfileReport:
    """Everything :func:`profile` measured and concluded; ``as_json()`` is what ``profile.json`` holds."""

    model: str
    device: str
    settings: Dict[str, Any]
    results: List[ProfileResult]
    recommendation: Optional[Dict[str, Any]]
    reading: Dict[str, Any]
    outputs: Dict[str, str] = field(default_factory=dict)

    def as_json(self) -> Dict[str, Any]:
        return {"version": 1, "model": self.model, "device": self.device, "settings": self.settings,
                "results": [asdict(r) for r in self.results], "recommendation": self.recommendation,
                "reading": self.reading, "outputs": self.outputs}

    def result(self, policy: str, micro_batch: int, seq_len: int, accumulate: int = 1) -> ProfileResult:
        for r in self.results:
            if (r.policy, r.micro_batch, r.seq_len, r.accumulate) == (policy, micro_batch, seq_len, accumulate):
                return r
        raise KeyError((policy, micro_batch, seq_len, accumulate))


# -------------------------------------------------------------------------------------------- conclusions


def recommend(results: Sequence[ProfileResult], budget: Optional[int]) -> Optional[Dict[str, Any]]:
    """The configuration with the highest tokens/s that ran and whose ``peak`` fits ``budget`` (``None``: any)."""
    eligible = [r for r in results if r.ok and r.tokens_per_sec is not None
                and (budget is None or (r.peak is not None and r.peak <= budget))]
    if not eligible:
        ran = [r for r in results if r.ok and r.peak is not None]
        smallest = min(ran, key=lambda r: r.peak) if ran else None
        text = "no configuration fits the budget"
        if budget is not None:
            text += f" of {format_bytes(budget)}"
        if smallest is not None:
            text += (f"; the smallest peak was {smallest.name} at {format_bytes(smallest.peak)} — shrink the model "
                     "state (precision, sharding, optimizer) or the micro-batch")
        return {"name": None, "text": text + "."}
    best = max(eligible, key=lambda r: (r.tokens_per_sec, -(r.peak or 0)))
    fits = (f"peak {format_bytes(best.peak)} ({best.peak_source}) within the budget of {format_bytes(budget)}"
            if budget is not None else "no budget given, so every configuration that ran was eligible")
    shape = f"micro-batch {best.micro_batch}" + (f" × {best.accumulate} accumulation steps" if best.accumulate > 1
                                                  else "")
    text = (f"{best.name}: policy {best.policy!r}, {shape}, sequence length {best.seq_len} — "
            f"{best.tokens_per_sec:,.0f} tokens/s, {fits}.")
    return {"name": best.name, "policy": best.policy, "micro_batch": best.micro_batch, "seq_len": best.seq_len,
            "accumulate": best.accumulate, "tokens_per_sec": best.tokens_per_sec, "peak": best.peak,
            "budget": budget, "text": text}


def read_slopes(results: Sequence[ProfileResult], micro_batch: int, seq_len: int,
                policy: Optional[str] = None) -> Dict[str, Any]:
    """The seed's reading of how memory responds to tokens and to length (pure Python).

    Args:
        results: the profiled configurations.
        micro_batch: the micro-batch held fixed in the length sweep.
        seq_len: the length held fixed in the micro-batch sweep.
        policy: which policy to read (default ``none``, else the first one present).

    Returns:
        ``{"policy", "tokens": {...}, "length": {...}, "text": [...]}``; ``tokens.verdict`` is ``"flat"`` or
        ``"grows"``, ``length.verdict`` one of ``"flat"``, ``"linear"``, ``"superlinear"``, ``"quadratic"``
        (``None`` when a sweep has fewer than two points that ran).
    """
    policies = [r.policy for r in results]
    if policy is None:
        policy = "none" if "none" in policies else (policies[0] if policies else "none")
    rows = [r for r in results if r.policy == policy and r.accumulate == 1 and r.ok]
    out: Dict[str, Any] = {"policy": policy, "tokens": {"verdict": None}, "length": {"verdict": None}, "text": []}

    by_mb = sorted((r for r in rows if r.seq_len == seq_len and r.peak), key=lambda r: r.tokens_per_step)
    if len(by_mb) >= 2 and by_mb[-1].tokens_per_step > by_mb[0].tokens_per_step:
        lo, hi = by_mb[0], by_mb[-1]
        ratio = hi.tokens_per_step / lo.tokens_per_step
        growth = hi.peak / lo.peak - 1
        elasticity = loglog_slope([r.tokens_per_step for r in by_mb], [r.peak for r in by_mb])
        share = (hi.activations / hi.peak) if hi.activations is not None and hi.peak else None
        verdict = "flat" if elasticity is not None and elasticity < 0.1 else "grows"
        out["tokens"] = {"verdict": verdict, "token_ratio": ratio, "peak_growth": growth, "elasticity": elasticity,
                         "activation_share": share}
        share_txt = f"; activations are {share:.0%} of it at {hi.tokens_per_step} tokens" if share is not None else ""
        if verdict == "flat":
            out["text"].append(
                f"Peak barely changes with tokens (+{growth:.1%} for ×{ratio:g} tokens per step{share_txt}): "
                "activations are not the problem — the model state is; checkpointing will not rescue a run "
                "that does not fit (look at precision, sharding or the optimizer's state).")
        else:
            out["text"].append(
                f"Peak grows with tokens (+{growth:.1%} for ×{ratio:g} tokens per step{share_txt}): activations "
                "are a credible target for checkpointing.")

    by_len = sorted((r for r in rows if r.micro_batch == micro_batch and r.activations), key=lambda r: r.seq_len)
    if len(by_len) >= 2 and by_len[-1].seq_len > by_len[0].seq_len:
        k = loglog_slope([r.seq_len for r in by_len], [r.activations for r in by_len])
        lo, hi = by_len[0], by_len[-1]
        ratio = hi.seq_len / lo.seq_len
        growth = hi.activations / lo.activations
        if k is None or k < 0.5:
            verdict, text = "flat", "the activation peak barely changes with length"
        elif k < 1.15:
            verdict, text = "linear", ("the activation peak grows linearly with length: no attention matrix is "
                                       "materialized (a memory-efficient attention kernel is in use)")
        elif k < 1.5:
            verdict, text = "superlinear", ("the activation peak grows faster than length: part of it grows with the "
                                            "square of length — attention is probably materialized; profile the "
                                            "attention kernel before checkpointing")
        else:
            verdict, text = "quadratic", ("the activation peak grows with the square of length: attention is "
                                          "materialized — switch to a fused / memory-efficient attention kernel "
                                          "first")
        out["length"] = {"verdict": verdict, "exponent": k, "length_ratio": ratio, "activation_ratio": growth}
        out["text"].append(f"Length ×{ratio:g} → activation peak ×{growth:.2f} (log-log exponent {k:.2f}): {text}.")
    return out


