"""How a profile is shown: the terminal table, ``profile.md``, ``profile.png``, TensorBoard runs, a progress bar."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, List, Optional, Tuple

from lightning_ckpt.core.units import format_bytes, unit_for
from lightning_ckpt.forecast.profile.analysis import ProfileReport, ProfileResult

__all__ = ["Progress", "conclusions", "markdown", "save_plot", "summary_text", "table", "tensorboard_writer"]


def summary_text(r: ProfileResult) -> str:
    if r.oom:
        return f"{r.name}: out of memory"
    if r.error:
        return f"{r.name}: error {r.error}"
    return "  \n".join(f"{k}: {v}" for k, v in asdict(r).items())


def tensorboard_writer(outdir: str, name: str):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(outdir, "tb", name))


class Progress:
    """A ``rich`` progress bar over all steps of all configurations (a no-op when disabled)."""

    def __init__(self, enabled: bool, console: Any, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]profile[/bold] {task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=console or Console(stderr=True), transient=True)
            self.task = None

    def __enter__(self):
        if self.progress is not None:
            self.progress.__enter__()
            self.task = self.progress.add_task("", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if self.progress is not None and n > 0:
            self.progress.advance(self.task, n)


def _unit(report: ProfileReport) -> Tuple[str, int]:
    """The one unit of the table's byte columns: the one that fits the largest value measured."""
    sizes = [0]
    for r in report.results:
        sizes += [v for v in (r.activations, r.peak_allocated, r.peak_reserved, r.peak) if v is not None]
        sizes += list((r.phase_peaks or {}).values())
    return unit_for(max(sizes))


def _fmt_bytes(n: Optional[int], scale: int) -> str:
    return "—" if n is None else f"{n / scale:,.1f}"


def _fmt_s(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e3:,.1f}"


def _columns(report: ProfileReport) -> List[str]:
    unit = _unit(report)[0]
    cols = ["configuration", "policy", "micro-batch", "seq len", "tokens/step", f"act. peak {unit}"]
    if report.device.startswith("cuda"):
        cols += [f"peak alloc {unit}", f"peak reserved {unit}"]
    else:
        cols += [f"est. peak {unit}"]
    cols += [f"fwd peak {unit}", f"bwd peak {unit}", f"opt peak {unit}"]
    return cols + ["fwd ms", "bwd ms", "tokens/s", "fits", "status"]


def _row(r: ProfileResult, cuda: bool, scale: int) -> List[str]:
    mb = f"{r.micro_batch}×{r.accumulate}" if r.accumulate > 1 else str(r.micro_batch)
    row = [r.name, r.policy, mb, str(r.seq_len), f"{r.tokens_per_step:,}", _fmt_bytes(r.activations, scale)]
    row += ([_fmt_bytes(r.peak_allocated, scale), _fmt_bytes(r.peak_reserved, scale)] if cuda
            else [_fmt_bytes(r.peak, scale)])
    limit = r.peak_phase
    row += [_fmt_bytes((r.phase_peaks or {}).get(name), scale) + (" ◀" if name == limit else "")
            for name in ("forward", "backward", "optimizer")]
    status = "OOM" if r.oom else ("error" if r.error else "ok")
    fits = "—" if r.fits is None else ("yes" if r.fits else "no")
    row += [_fmt_s(r.forward_s), _fmt_s(r.backward_s),
            "—" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}", fits, status]
    return row


def table(report: ProfileReport):
    """The results as a ``rich.table.Table`` (the recommended row in bold)."""
    from rich.table import Table

    cuda = report.device.startswith("cuda")
    best = (report.recommendation or {}).get("name")
    t = Table(title=f"lightning-ckpt profile: {report.model} on {report.device}")
    for i, c in enumerate(_columns(report)):
        t.add_column(c, justify="left" if i < 2 else "right")
    scale = _unit(report)[1]
    for r in report.results:
        t.add_row(*_row(r, cuda, scale), style="bold green" if r.name == best else ("red" if not r.ok else None))
    return t


def conclusions(report: ProfileReport) -> List[str]:
    """The recommendation and the reading of the slopes, one paragraph each."""
    lines = []
    if report.recommendation:
        lines.append("Recommendation: " + report.recommendation["text"])
    lines.extend(report.reading.get("text", []))
    ooms = [r.name for r in report.results if r.oom]
    if ooms:
        lines.append(f"Out of memory: {', '.join(ooms)}.")
    errors = [f"{r.name} ({r.error})" for r in report.results if r.error]
    if errors:
        lines.append(f"Failed: {', '.join(errors)}.")
    return lines


def markdown(report: ProfileReport) -> str:
    """``profile.md``: settings, the table, the recommendation and the reading."""
    cuda = report.device.startswith("cuda")
    s = report.settings
    budget = "none" if s["budget"] is None else format_bytes(s["budget"])
    capacity = "unknown" if s["capacity"] is None else format_bytes(s["capacity"])
    accumulation = (f"gradient-accumulation baseline micro-batch 1 × {s['accumulate']}" if s["accumulate"] > 1
                    else "no gradient-accumulation baseline")
    out = [f"# lightning-ckpt profile: `{report.model}`", "",
           f"Device `{report.device}`, precision `{s['precision']}`, {s['warmup']} warm-up + {s['steps']} measured "
           f"steps per configuration, budget {budget}, capacity {capacity}. Micro-batch sweep at length "
           f"{s['seq_len']}; length sweep at micro-batch {s['micro_batch']}; {accumulation}. Batches from "
           f"`{s['batch']}`.", ""]
    if not cuda:
        out += ["On the CPU there are no allocator counters: the peak is the highest phase peak of the live-tensor "
                "count (model state included).", ""]
    out += ["Phase peaks: forward, backward and optimizer step; ◀ marks the phase that limits the configuration.", ""]
    cols = _columns(report)
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|")
    scale = _unit(report)[1]
    for r in report.results:
        out.append("| " + " | ".join(_row(r, cuda, scale)) + " |")
    out.append("")
    out += [f"- {line}" for line in conclusions(report)]
    if report.outputs.get("plot"):
        out += ["", f"![profile]({os.path.basename(report.outputs['plot'])})"]
    return "\n".join(out) + "\n"


def save_plot(report: ProfileReport, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    unit, scale = unit_for(max([r.activations or 0 for r in report.results], default=0))
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in report.settings["policies"]:
        rows = sorted((r for r in report.results if r.policy == policy and r.accumulate == 1 and r.ok),
                      key=lambda r: r.tokens_per_step)
        if not rows:
            continue
        xs = [r.tokens_per_step for r in rows]
        line, = ax_mem.plot(xs, [(r.activations or 0) / scale for r in rows], marker="o", label=policy)
        ax_tps.plot(xs, [r.tokens_per_sec or 0 for r in rows], marker="o", label=policy, color=line.get_color())
        ooms = [r for r in report.results if r.policy == policy and r.oom]
        for r in ooms:
            ax_mem.axvline(r.micro_batch * r.seq_len * r.accumulate, color=line.get_color(), ls=":", lw=1)
    for r in report.results:
        if r.accumulate > 1 and r.ok:
            ax_mem.scatter([r.tokens_per_step], [(r.activations or 0) / scale], marker="s", color="black",
                           label=f"none, 1×{r.accumulate} accumulation", zorder=3)
            ax_tps.scatter([r.tokens_per_step], [r.tokens_per_sec or 0], marker="s", color="black",
                           label=f"none, 1×{r.accumulate} accumulation", zorder=3)
    ax_mem.set(xlabel="tokens per optimizer step", ylabel=f"activation peak ({unit})", title="activation peak")
    ax_tps.set(xlabel="tokens per optimizer step", ylabel="tokens / s", title="throughput")
    for ax in (ax_mem, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model} on {report.device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
