"""The simulation charts: each writes a PNG of the fixed size, even with sparse data."""

from __future__ import annotations

from pathlib import Path

from matplotlib.image import imread

from raps_slurm.sim.plots import (
    DPI,
    FIGSIZE,
    plot_recovery_cdf,
    plot_storage_vs_replicas,
    plot_useful_vs_interval,
)

PNG_SIGNATURE = b"\x89PNG"


def assert_png(path: Path) -> None:
    assert path.exists()
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 5_000
    height, width = imread(path).shape[:2]
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))


def test_useful_vs_interval(tmp_path: Path) -> None:
    rows = [
        {"strategy": s, "interval_s": i, "useful_work_fraction": f, "useful_work_fraction_ci95": ci}
        for s, i, f, ci in [
            ("raps", 300, 0.90, 0.01), ("raps", 1800, 0.93, 0.02), ("raps", 7200, 0.88, 0.0),
            ("global", 300, 0.80, 0.01), ("global", 1800, 0.85, 0.02), ("global", 7200, 0.78, 0.03),
            ("scr", 300, 0.86, 0.01), ("scr", 1800, 0.89, 0.01), ("scr", 7200, 0.84, 0.02),
        ]
    ]
    daly = [(300.0, 0.81), (1800.0, 0.86), (7200.0, 0.79)]
    out = plot_useful_vs_interval(rows, tmp_path / "useful.png", daly=daly)
    assert out == tmp_path / "useful.png"
    assert_png(out)


def test_useful_vs_interval_accepts_str_path_and_missing_ci(tmp_path: Path) -> None:
    rows = [{"strategy": "raps", "interval_s": 600, "useful_work_fraction": 0.9}]
    out = plot_useful_vs_interval(rows, str(tmp_path / "one.png"), title="one point")
    assert isinstance(out, Path)
    assert_png(out)


def test_recovery_cdf(tmp_path: Path) -> None:
    recoveries = {
        "raps": [40.0, 95.0, 112.0, 130.0, 600.0],
        "global": [900.0, 1500.0, 2400.0],
        "scr": [],
    }
    out = plot_recovery_cdf(recoveries, tmp_path / "cdf.png", title="recoveries")
    assert_png(out)


def test_recovery_cdf_all_empty_still_writes(tmp_path: Path) -> None:
    out = plot_recovery_cdf({"raps": [], "global": []}, tmp_path / "empty.png")
    assert_png(out)


def test_storage_vs_replicas(tmp_path: Path) -> None:
    rows = [
        {"replicas": 2, "storage_gb": 3000.0, "useful_work_fraction": 0.92, "escalations_per_seed": 0.1},
        {"replicas": 0, "storage_gb": 1000.0, "useful_work_fraction": 0.80, "escalations_per_seed": 2.5},
        {"replicas": 1, "storage_gb": 2000.0, "useful_work_fraction": 0.90},
    ]
    out = plot_storage_vs_replicas(rows, tmp_path / "storage.png")
    assert_png(out)
