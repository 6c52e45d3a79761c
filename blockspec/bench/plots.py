"""PNG figures of a benchmark summary (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path


def write_plots(summary: dict, out_dir) -> dict[str, Path]:
    """tau histograms, acceptance-by-position curves and speedup bars, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    datasets = [d for d in summary if d != "all"] or list(summary)
    plots = {
        "tau_histogram": _save(_tau_histograms(summary, datasets), out / "tau_histogram.png"),
        "acceptance_by_position": _save(_acceptance_curves(summary, datasets), out / "acceptance_by_position.png"),
        "speedup": _save(_speedup_bars(summary, datasets), out / "speedup.png"),
    }
    if any(len(f.get("verify_width_histogram", {})) > 1 for d in datasets for f in summary[d].values()):
        plots["verify_widths"] = _save(_width_histograms(summary, datasets), out / "verify_widths.png")
    return plots


def _panels(count: int, title: str):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, count, figsize=(4.8 * count, 3.8), squeeze=False)
    figure.suptitle(title)
    return figure, axes[0]


def _drafting(methods: dict) -> dict:
    """Methods whose steps can hold more than one token (the others have tau 1)."""
    return {name: f for name, f in methods.items() if any(int(k) > 1 for k in f["tau_histogram"])
            or f["acceptance_by_position"]}


def _tau_histograms(summary, datasets):
    figure, axes = _panels(len(datasets), "Tokens per target forward (acceptance length)")
    for axis, dataset in zip(axes, datasets):
        methods = _drafting(summary[dataset]) or summary[dataset]
        width = 0.8 / max(len(methods), 1)
        for i, (name, f) in enumerate(methods.items()):
            total = sum(f["tau_histogram"].values()) or 1
            lengths = [int(k) for k in f["tau_histogram"]]
            shares = [v / total for v in f["tau_histogram"].values()]
            axis.bar([n + (i - (len(methods) - 1) / 2) * width for n in lengths], shares, width=width,
                     label=f"{name} (tau {f['tau']:.2f})")
        axis.set(title=dataset, xlabel="tokens per step", ylabel="share of steps")
        axis.legend(fontsize=8)
    return figure


def _width_histograms(summary, datasets):
    """Tokens per verify forward: a point for a fixed width, a spread for adaptive width and trees.

    Every drafting method is drawn, so an adaptive run that fell back to plain decoding shows
    as a point at width 1 instead of disappearing."""
    from blockspec.bench.methods import BASELINES

    figure, axes = _panels(len(datasets), "Tokens per verify forward")
    for axis, dataset in zip(axes, datasets):
        methods = {n: f for n, f in summary[dataset].items()
                   if n not in BASELINES and f.get("verify_width_histogram")}
        for name, f in methods.items():
            total = sum(f["verify_width_histogram"].values()) or 1
            widths = [int(k) for k in f["verify_width_histogram"]]
            axis.plot(widths, [v / total for v in f["verify_width_histogram"].values()], marker="o", label=name)
        axis.set(title=dataset, xlabel="verify width (last token + drafts or tree nodes)", ylabel="share of steps")
        if methods:
            axis.legend(fontsize=8)
    return figure


def _acceptance_curves(summary, datasets):
    figure, axes = _panels(len(datasets), "Acceptance rate by position in the block")
    for axis, dataset in zip(axes, datasets):
        for name, f in summary[dataset].items():
            rates = f["acceptance_by_position"]
            if rates:
                axis.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=name)
        axis.set(title=dataset, xlabel="draft position k", ylabel="P(k accepted | k drafted)", ylim=(0, 1.02))
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    return figure


def _speedup_bars(summary, datasets):
    figure, axes = _panels(len(datasets), "Speedup over ar (per-prompt median; 1 = as fast as ar)")
    for axis, dataset in zip(axes, datasets):
        methods = {n: f for n, f in summary[dataset].items() if f["speedup_vs_ar_median"] is not None}
        names = list(methods)
        values = [methods[n]["speedup_vs_ar_median"] for n in names]
        bars = axis.bar(names, values, color=["#999999" if n == "ar" else "#3b75af" for n in names])
        axis.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=8)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set(title=dataset, ylabel="speedup")
        axis.tick_params(axis="x", labelrotation=30, labelsize=8)
    return figure


def calibration_plot(curves: dict, path: Path) -> Path:
    """Observed acceptance against the calibrated prediction, per confidence bin (size: drafts tried)."""
    import matplotlib

    matplotlib.use("Agg")
    figure, axes = _panels(1, "Draft confidence calibrated against acceptance")
    axis = axes[0]
    axis.plot([0, 1], [0, 1], color="#bbbbbb", linewidth=0.8, label="raw confidence")
    for name, bins in curves.items():
        centres = [(b["low"] + b["high"]) / 2 for b in bins]
        line, = axis.plot(centres, [b["predicted"] for b in bins], label=f"{name}: calibrated")
        seen = [(c, b) for c, b in zip(centres, bins) if b["tried"]]
        total = max((b["tried"] for _, b in seen), default=1)
        axis.scatter([c for c, _ in seen], [b["observed"] for _, b in seen], color=line.get_color(),
                     s=[8 + 80 * b["tried"] / total for _, b in seen], alpha=0.6, label=f"{name}: observed")
    axis.set(xlabel="draft confidence", ylabel="P(accepted | reached)", xlim=(0, 1), ylim=(0, 1.02))
    axis.legend(fontsize=7)
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    temporary.replace(path)
    return path
