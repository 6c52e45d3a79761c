"""The adaptive verify width's calibration, written beside a benchmark run's results."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.bench.methods import parse_method_name
from blockspec.bench.plots import calibration_plot
from blockspec.decoding.policy import WidthPolicies
from blockspec.io import write_text_atomically


def write_calibration(methods, out: Path, *, plots: bool) -> dict[str, Path]:
    """The adaptive-width policies' confidence calibration (predicted vs observed acceptance), if any ran."""
    curves = {}
    for method in methods:
        label = parse_method_name(method.name).drafter  # dflash and dflash/d2: two drafters of one name
        for (kind, widest, _), policy in getattr(method, "width_policies", WidthPolicies()).policies.items():
            curves[f"{label} {kind} (widest {widest})"] = policy.calibrator.curve()
    if not curves:
        return {}
    path = write_text_atomically(out / "calibration.json", json.dumps(curves, indent=1))
    paths = {"calibration": path}
    if plots:
        paths["calibration_plot"] = calibration_plot(curves, out / "calibration.png")
    return paths
