"""Plots: whole-number rounds on the x axis, and a y axis that fits the values."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import fedexlora.experiments.cells as cells  # noqa: E402
import fedexlora.experiments.compare_plots as compare_plots
import fedexlora.run.report as report


def _row(method, rnd, value, metric="accuracy"):
    dev = {"mean": 0.1, "max": 0.2, "per_layer": {"layer.0.attention.self.query": 0.1}}
    return {
        "method": method,
        "round": rnd,
        "metrics": {metric: value},
        "deviation": dev,
        "effective_deviation": {"mean": 0.0, "max": 0.0},
        "bytes_up": 1,
        "bytes_down": 1,
    }


def _figures(monkeypatch, fn, *args):
    """Runs a plotting function and returns the figures it closed."""
    seen = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (seen.append(fig), real_close(fig)))
    fn(*args)
    return seen


def test_round_ticks_are_whole_numbers(tmp_path, monkeypatch):
    rows = [_row(m, r, 0.5 + 0.1 * r) for m in ("fedex", "fedit") for r in (1, 2, 3)]
    for fn, name in ((report.plot_metrics, "m.png"), (report.plot_deviation, "d.png")):
        (fig,) = _figures(monkeypatch, fn, rows, tmp_path / name)
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_compare_plot_fits_values_above_one(tmp_path, monkeypatch):
    setting = cells.Setting("iid-2", 2, "iid")
    rows = {
        cells.Cell(setting, 4, None, seed): [
            _row(m, 1, v + seed, "perplexity") for m, v in (("fedex", 7.0), ("fedit", 9.0))
        ]
        for seed in (0, 1)
    }
    (fig,) = _figures(monkeypatch, compare_plots.plot_comparison, rows, tmp_path / "c.png")
    bottom, top = fig.axes[0].get_ylim()
    assert top >= 9.5 + 0.707  # the tallest bar (mean 9.5) and its error bar (0.707) fit


def test_wilson_interval_matches_a_hand_computation():
    # p = 0.8 on n = 100, z = 1.96: centre (0.8 + 0.0192) / 1.0384 = 0.78891,
    # half 1.96 * sqrt(0.0016 + 0.000096) / 1.0384 = 0.07774 -> [0.7112, 0.8667]
    lo, hi = report.wilson(0.8, 100)
    assert abs(lo - 0.7112) < 2e-4 and abs(hi - 0.8667) < 2e-4
    assert abs(report.wilson(1.0, 10)[1] - 1.0) < 1e-12 and report.wilson(0.0, 10)[0] < 1e-12


def test_summary_names_the_exact_methods_from_the_registry(tmp_path, monkeypatch):
    from dataclasses import replace

    from fedexlora.core.methods import REGISTRY

    rows = [_row(m, 1, 0.5) for m in ("fedex", "fedit", "ffa")]
    for r in rows:
        r.update(train_loss=1.0, seconds=1.0)
    text = report.write_summary(tmp_path, rows).read_text()
    assert "Exact: fedex (FedEx-LoRA), ffa (FFA-LoRA): float rounding only (over 0.001 for" in text
    assert "Not exact, by design: fedit (FedIT)" in text
    assert "FLoRA" not in text and "sends nothing" not in text  # not in this run
    # the registry says, not the report: flip a flag and the sentence follows
    monkeypatch.setitem(REGISTRY, "ffa", replace(REGISTRY["ffa"], exact=False))
    text = report.write_summary(tmp_path, rows).read_text()
    assert "Exact: fedex (FedEx-LoRA): float rounding only" in text
    assert "Not exact, by design: fedit (FedIT), ffa (FFA-LoRA)" in text
    # a method without clients: named as sending nothing, and neither exact nor not
    pooled = _row("centralized", 1, 0.6)
    pooled.update(train_loss=1.0, seconds=1.0)
    text = report.write_summary(tmp_path, [*rows, pooled]).read_text()
    assert "counted from the tensors sent; `centralized` sends nothing." in text
    assert "(Centralized" not in text and "centralized (" not in text
