"""PNG charts of simulation results: useful work against checkpoint interval, the distribution
of recovery times, and checkpoint storage against the number of replicas. Figures are drawn
with the Agg canvas directly so no global pyplot state or display is needed."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

FIGSIZE = (7.0, 4.5)
DPI = 120
# Fixed per strategy so the same strategy has the same colour in every chart.
STRATEGY_COLOURS = {"raps": "tab:blue", "global": "tab:orange", "scr": "tab:green",
                    "step": "tab:red"}
_OTHER_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
_STRATEGY_ORDER = ("raps", "global", "scr", "step")
# A log axis cannot show zero; an instant recovery is drawn at this many seconds instead.
_MIN_RECOVERY_S = 0.1


def _new_figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=DPI)
    return out


def _ordered(names: Sequence[str]) -> list[str]:
    known = [s for s in _STRATEGY_ORDER if s in names]
    return known + sorted(set(names) - set(known))


def _colours(names: Sequence[str]) -> dict[str, str]:
    others = iter(_OTHER_COLOURS * (len(names) + 1))
    return {n: STRATEGY_COLOURS.get(n) or next(others) for n in names}


def _plain_number(value: float, _pos: int) -> str:
    return f"{value:g}"


def plot_useful_vs_interval(
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str = "",
    daly: Sequence[tuple[float, float]] = (),
) -> Path:
    """Draw useful-work % against checkpoint interval, one line per strategy, to a PNG."""
    fig, ax = _new_figure()
    by_strategy: dict[str, list[tuple[float, float, float]]] = {}
    for row in rows:
        point = (
            float(row["interval_s"]) / 60.0,
            float(row["useful_work_fraction"]) * 100.0,
            float(row.get("useful_work_fraction_ci95", 0.0)) * 100.0,
        )
        by_strategy.setdefault(str(row["strategy"]), []).append(point)
    names = _ordered(list(by_strategy))
    colours = _colours(names)
    for name in names:
        points = sorted(by_strategy[name])
        xs, ys, errs = zip(*points, strict=True)
        ax.errorbar(xs, ys, yerr=errs, fmt="-o", ms=4, capsize=3, color=colours[name], label=name)
        best = max(points, key=lambda p: p[1])
        ax.plot(best[0], best[1], marker="*", ms=14, color=colours[name], mec="black", ls="none")
    if daly:
        dx, dy = zip(*sorted((s / 60.0, f * 100.0) for s, f in daly), strict=True)
        ax.plot(dx, dy, ls="--", color=STRATEGY_COLOURS["global"], alpha=0.7,
                label="global, Daly's model")
    if by_strategy:
        ax.plot([], [], marker="*", ms=10, color="grey", mec="black", ls="none",
                label="best interval")
    all_x = [p[0] for pts in by_strategy.values() for p in pts] + [s / 60.0 for s, _ in daly]
    positive = [x for x in all_x if x > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
    ax.set_xlabel("checkpoint interval (min)")
    ax.set_ylabel("useful work (% of wall time)")
    ax.set_title(title or "Useful work vs checkpoint interval")
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # Strategies first, then the model and the marker key, whatever order they were drawn in.
        order = sorted(range(len(labels)), key=lambda i: labels[i] not in by_strategy)
        ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="best",
                  fontsize="small")
    return _save(fig, path)


def _fmt_seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def plot_recovery_cdf(
    recoveries: Mapping[str, Sequence[float]], path: str | Path, *, title: str = ""
) -> Path:
    """Draw the empirical CDF of recovery durations per strategy to a PNG."""
    fig, ax = _new_figure()
    names = _ordered([n for n, v in recoveries.items() if len(v) > 0])
    colours = _colours(names)
    for name in names:
        values = sorted(max(float(v), _MIN_RECOVERY_S) for v in recoveries[name])
        n = len(values)
        shares = [0.0] + [100.0 * (i + 1) / n for i in range(n)]
        label = f"{name} (median {_fmt_seconds(statistics.median(values))})"
        ax.step([values[0], *values], shares, where="post", color=colours[name], label=label)
    if names:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "no recoveries", transform=ax.transAxes, ha="center", va="center",
                fontsize="large", color="grey")
    ax.set_ylim(0, 102)
    ax.set_xlabel("recovery time, fault to back where it was (s)")
    ax.set_ylabel("share of recoveries (%)")
    ax.set_title(title or "Recovery time distribution")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def plot_storage_vs_replicas(
    rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = ""
) -> Path:
    """Draw checkpoint storage (bars) and useful-work % (line) against replica count to a PNG."""
    fig, ax = _new_figure()
    ordered = sorted(rows, key=lambda r: int(r["replicas"]))
    xs = list(range(len(ordered)))
    storage_tb = [float(r["storage_gb"]) / 1000.0 for r in ordered]
    useful = [float(r["useful_work_fraction"]) * 100.0 for r in ordered]
    bars = ax.bar(xs, storage_tb, width=0.6, color=STRATEGY_COLOURS["raps"], alpha=0.45,
                  label="checkpoint storage")
    for x, row in zip(xs, ordered, strict=True):
        if "escalations_per_seed" in row:
            # At the foot of the bar: the useful-work line keeps to the middle band.
            ax.annotate(f"{float(row['escalations_per_seed']):.2g} esc/seed", (x, 0.0),
                        xytext=(0, 4), textcoords="offset points", ha="center",
                        fontsize="x-small")
    ax.set_xticks(xs, [str(int(r["replicas"])) for r in ordered])
    ax.set_xlabel("checkpoint copies besides the primary (replicas)")
    ax.set_ylabel("checkpoint storage (TB)")
    # Headroom above the tallest bar keeps the legend clear of the bars.
    ax.set_ylim(0, max(storage_tb, default=1.0) * 1.35 or 1.0)
    right = ax.twinx()
    (line,) = right.plot(xs, useful, "-o", color="black", label="useful work")
    right.set_ylabel("useful work (% of wall time)")
    if useful:
        low, high = min(useful), max(useful)
        pad = max((high - low) * 0.5, 1.0)
        # No cap at 100 %: the line must stay below the legend band at the top.
        right.set_ylim(max(low - pad, 0.0), high + pad)
    ax.set_title(title or "Checkpoint storage vs replicas")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend([bars, line], ["checkpoint storage (TB)", "useful work (%)"], loc="upper left",
              fontsize="small")
    return _save(fig, path)


def plot_advice_map(rows: Sequence[Mapping[str, Any]], path: str | Path, *,
                    title: str = "") -> Path:
    """Where each strategy wins: job nodes across, node MTBF up, each cell coloured by
    the best strategy and labelled with it and its useful work per allocated node, and
    raps's below when another wins (how far local recovery is from the winner)."""
    from matplotlib.colors import ListedColormap

    nodes = sorted({int(r["nodes"]) for r in rows})
    mtbfs = sorted({float(r["node_mtbf_h"]) for r in rows})
    names = _ordered(sorted({str(r["best"]) for r in rows}))
    colours = _colours(names)
    grid = [[0.0] * len(nodes) for _ in mtbfs]
    fig, ax = _new_figure()
    for r in rows:
        i, j = mtbfs.index(float(r["node_mtbf_h"])), nodes.index(int(r["nodes"]))
        grid[i][j] = names.index(str(r["best"]))
        best = str(r["best"])
        eff = float(r[f"{best}_node_efficiency"])
        tie = "*" if r.get("within_noise") else ""
        raps = r.get("raps_node_efficiency")
        under = f"\nraps {float(raps) * 100:.0f} %" if best != "raps" and raps is not None \
            else ""
        ax.text(j, i, f"{best}{tie}\n{eff * 100:.0f} %{under}", ha="center", va="center",
                fontsize=8, color="white")
    ax.imshow(grid, cmap=ListedColormap([colours[n] for n in names]), origin="lower",
              aspect="auto", vmin=-0.5, vmax=len(names) - 0.5)
    ax.set_xticks(range(len(nodes)), [f"{n:,}" for n in nodes])
    ax.set_yticks(range(len(mtbfs)), [f"{m:g}" for m in mtbfs])
    ax.set_xlabel("job nodes")
    ax.set_ylabel("node MTBF (h)")
    ax.set_title(title or "Best strategy (useful work per allocated node; * within noise)")
    return _save(fig, path)
