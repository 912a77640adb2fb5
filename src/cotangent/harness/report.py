"""`cotangent report RUNS`: figures (matplotlib, Agg) and a Markdown + self-contained HTML report.

Reads analysis/results.json, analysis/runs.csv and analysis/pairs.csv (written by `cotangent
analyze`) and each run's curve.jsonl; writes into RUNS/report/:
    fig-reductions.png  paired reductions (training time, update phase, time-to-target), mean
                        with the t interval (thick) and the bootstrap interval (thin)
    fig-quality.png     test BPB difference per comparison with its interval, per-pair points
                        and the non-inferiority margin
    fig-curves.png      probe BPB against training seconds, one line per run, one colour per arm
    fig-factorial.png   2x2 factorial contrasts with their t intervals (when the four arms ran)
    fig-update-ms.png   median update-phase ms per run, per model and arm
    report.md           the report, linking the figures (renders on GitHub); with decision
                        rules in the protocol, one line per model and rule: the verdict and the
                        numbers that decided it
    report.html         the same report with the figures embedded (one self-contained file)
    manifest.json       SHA-256 of each of these files (checked by `cotangent audit`)
The PNG bytes are deterministic: fixed size and dpi, no timestamp or software metadata.
"""

from __future__ import annotations

import base64
import csv
import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cotangent.harness import records  # noqa: E402
from cotangent.harness.analysis import (  # noqa: E402
    ANALYSIS,
    MANIFEST,
    REPORT,
    decision_rule_line,
    write_manifest,
)
from cotangent.harness.campaign import sha256_file  # noqa: E402
from cotangent.harness.stats import CONTRASTS  # noqa: E402

ARM_COLOURS = {"native": "#4d4d4d", "cotangent": "#1f77b4", "batched-norms-only": "#ff7f0e",
               "packing-only": "#2ca02c"}
METRICS = (("training_time_reduction", "training time"),
           ("update_phase_reduction", "update phase"),
           ("time_to_target_reduction", "time to target"))


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _colour(arm: str) -> str:
    return ARM_COLOURS.get(arm, "#9467bd")


def fig_reductions(results: dict, path: Path) -> None:
    """Forest plot of every comparison's reductions (%, positive = candidate faster)."""
    rows = [(f"{c['model']}: {c['candidate']}\n{label}", c[key], c["candidate"])
            for c in results["comparisons"] for key, label in METRICS]
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(rows) + 1.4))
    for i, (_, s, arm) in enumerate(rows):
        y = len(rows) - 1 - i
        if s["t"] is None:
            ax.text(0, y, f"n={s['n']}: no interval", va="center", fontsize=7)
            continue
        t, b = s["t"], s["bootstrap"]
        ax.plot([100 * b["low"], 100 * b["high"]], [y - 0.18] * 2, color=_colour(arm), lw=1)
        ax.plot([100 * t["low"], 100 * t["high"]], [y] * 2, color=_colour(arm), lw=3.5)
        ax.plot(100 * t["mean"], y, "o", color="white", mec=_colour(arm), ms=5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=7)
    ax.set_xlabel("reduction vs baseline, % (positive = candidate faster)")
    ax.set_title(f"Paired reductions: mean, {results['protocol']['level']:.0%} t interval "
                 "(thick), bootstrap (thin)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def fig_quality(results: dict, pairs: list[dict], path: Path) -> None:
    """Test BPB differences (candidate - baseline): per-pair ticks, t interval, margin line."""
    comps = results["comparisons"]
    margin = results["protocol"]["margin_bpb"]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(comps) + 1.4))
    extent = 1.5 * margin  # wide enough for the margin, every pair and every interval
    for i, c in enumerate(comps):
        y = len(comps) - 1 - i
        values = [float(p["quality_difference_bpb"]) for p in pairs
                  if p["model"] == c["model"] and p["candidate"] == c["candidate"]]
        ax.plot(values, [y + 0.2] * len(values), "|", color=_colour(c["candidate"]), ms=8)
        s = c["quality_difference_bpb"]
        extent = max([extent] + [1.1 * abs(v) for v in values])
        if s["t"] is not None:
            extent = max(extent, 1.1 * abs(s["t"]["low"]), 1.1 * abs(s["t"]["high"]))
            ax.plot([s["t"]["low"], s["t"]["high"]], [y] * 2, color=_colour(c["candidate"]), lw=3.5)
            ax.plot(s["t"]["mean"], y, "o", color="white", mec=_colour(c["candidate"]), ms=5)
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(margin, color="red", ls="--", lw=1, label=f"margin +{margin} BPB")
    ax.set_xlim(-extent, extent)
    ax.set_yticks(range(len(comps)), [f"{c['model']}: {c['candidate']}" for c in reversed(comps)],
                  fontsize=7)
    ax.set_xlabel("test BPB, candidate - baseline (ticks: pairs; bar: t interval)")
    ax.set_title("Quality difference and non-inferiority margin", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _save(fig, path)


def fig_curves(campaign: Path, results: dict, runs: list[dict], path: Path) -> None:
    """Probe BPB against the run's training seconds, every run, one panel per model."""
    models = results["protocol"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        seen = set()
        for r in runs:
            if r["model"] != model or r["state"] != "done":
                continue
            curve = records.read_jsonl(campaign / r["run_dir"] / "curve.jsonl")
            probes = [p for p in curve if "probe_bpb" in p]
            ax.plot([p["training_s"] for p in probes], [p["probe_bpb"] for p in probes],
                    color=_colour(r["arm"]), lw=0.8, alpha=0.7,
                    label=None if r["arm"] in seen else r["arm"])
            seen.add(r["arm"])
        ax.axhline(results["protocol"]["target_bpb"][model], color="red", ls="--", lw=0.8,
                   label="target")
        ax.set_title(f"{model}: probe BPB (held-out train tail)", fontsize=9)
        ax.set_xlabel("training seconds (sum of step times)")
        ax.set_ylabel("bits per byte")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def fig_factorial(results: dict, path: Path) -> bool:
    """Bars of the factorial contrasts with t intervals; False (no file) without them."""
    blocks = results["factorial"]
    if not blocks:
        return False
    fig, axes = plt.subplots(1, len(blocks), figsize=(4.2 * len(blocks), 3.6), squeeze=False)
    for ax, block in zip(axes[0], blocks):
        names = [n for n in CONTRASTS if n in block["contrasts"]]
        for i, name in enumerate(names):
            s = block["contrasts"][name]
            if s["t"] is None:
                continue
            t = s["t"]
            ax.bar(i, 100 * t["mean"], color="#1f77b4" if name != "interaction" else "#9467bd")
            ax.errorbar(i, 100 * t["mean"], yerr=[[100 * (t["mean"] - t["low"])],
                                                  [100 * (t["high"] - t["mean"])]],
                        color="black", capsize=3, lw=1)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_ylabel("% reduction vs native")
        ax.set_title(f"{block['model']}: {block['metric'].replace('_', ' ')}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    return True


def fig_update_ms(results: dict, runs: list[dict], path: Path) -> None:
    """Median update-phase ms per step of every run, grouped by model and arm."""
    models, arms = results["protocol"]["models"], results["protocol"]["arms"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(models) * len(arms)), 3.6))
    labels = []
    for i, (model, arm) in enumerate((m, a) for m in models for a in arms):
        values = [float(r["update_ms_median"]) for r in runs
                  if r["model"] == model and r["arm"] == arm and r["state"] == "done"]
        if values:
            ax.bar(i, sum(values) / len(values), color=_colour(arm), alpha=0.5)
            ax.plot([i] * len(values), values, "_", color="black", ms=10)
        labels.append(f"{model}\n{arm}")
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("update phase, ms per step (median per run)")
    ax.set_title("Update-phase time per step: bar = mean over seeds, ticks = runs", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _pct(s: dict) -> str:
    if s["t"] is None:
        return f"n={s['n']}, no interval"
    t, b = s["t"], s["bootstrap"]
    return (f"{100 * t['mean']:+.2f}% [{100 * t['low']:+.2f}, {100 * t['high']:+.2f}] "
            f"(bootstrap [{100 * b['low']:+.2f}, {100 * b['high']:+.2f}])")


def _bpb(s: dict) -> str:
    if s["t"] is None:
        return f"n={s['n']}, no interval"
    t = s["t"]
    return f"{t['mean']:+.5f} [{t['low']:+.5f}, {t['high']:+.5f}]"


def build_report(campaign: Path, *, log=print) -> Path:
    """Write the figures, report.md, report.html and report/manifest.json; return report.md.

    Raises:
        ValueError: the campaign has not been analysed (`cotangent analyze` first).
    """
    campaign = Path(campaign)
    results_path = campaign / ANALYSIS / "results.json"
    if not results_path.is_file():
        raise ValueError(f"{campaign}: no {ANALYSIS}/results.json; run `cotangent analyze "
                         f"{campaign}` first")
    results = records.read_json(results_path)
    runs = _read_csv(campaign / ANALYSIS / "runs.csv")
    pairs = _read_csv(campaign / ANALYSIS / "pairs.csv")
    out = campaign / REPORT
    out.mkdir(exist_ok=True)
    figures = [("fig-reductions.png", "Paired reductions"),
               ("fig-quality.png", "Quality difference (test BPB)"),
               ("fig-curves.png", "Learning curves"),
               ("fig-update-ms.png", "Update-phase ms per step")]
    fig_reductions(results, out / figures[0][0])
    fig_quality(results, pairs, out / figures[1][0])
    fig_curves(campaign, results, runs, out / figures[2][0])
    fig_update_ms(results, runs, out / figures[3][0])
    if fig_factorial(results, out / "fig-factorial.png"):
        figures.insert(2, ("fig-factorial.png", "2x2 factorial contrasts"))
    blocks = _report_blocks(results, figures, runs)
    records.write_atomic(out / "report.md", _markdown(blocks))
    records.write_atomic(out / "report.html", _html(blocks, out))
    built_from = {f"{ANALYSIS}/{name}": sha256_file(campaign / ANALYSIS / name)
                  for name in ("results.json", "runs.csv", "pairs.csv")}
    write_manifest(campaign, out / MANIFEST, under=REPORT, extra={"built_from": built_from})
    log(f"report: {out / 'report.md'} and {out / 'report.html'} ({len(figures)} figures)")
    return out / "report.md"


def _num(text: str, fmt: str, scale: float = 1.0) -> str:
    """A runs.csv cell formatted as a number, or '-' when empty (not recorded)."""
    return "-" if text in ("", None) else format(scale * float(text), fmt)


def _timing_blocks(results: dict, runs: list[dict]) -> list[tuple]:
    """The timing-quality section: the rules, the flagged runs with their reasons, and every
    run's load record (runs.csv)."""
    flags = results["timing_flags"]
    rules = flags["rules"]
    blocks: list[tuple] = [
        ("h2", "Timing quality: machine load and step-time outliers"),
        ("p", f"A run is flagged when its slow steps (step_s > {rules['slow_step_factor']:g}x its "
              f"median) added more than {100 * rules['outlier_excess_fraction']:g}% to its "
              "training time, or when the machine was busy while its steps were timed: "
              "(CPUs kept busy by other work + the run's torch threads) / the CPUs it may run "
              f"on > {rules['busy_demand_ratio']:g}. Flagged pairs stay in the statistics above; "
              "their times may reflect the machine rather than the code."),
    ]
    if flags["runs"]:
        blocks.append(("p", f"{len(flags['flagged'])} of {results['jobs']['done']} runs are "
                            "flagged:"))
        blocks.append(("table", ["job", "reasons"],
                       [[r["job"], "; ".join(r["reasons"])] for r in flags["runs"]]))
    else:
        blocks.append(("p", f"No run is flagged ({results['jobs']['done']} runs)."))
    if flags["load_not_measured"]:
        blocks.append(("p", f"{len(flags['load_not_measured'])} runs have no machine-load record "
                            "(older records, or no /proc/stat): the busy rule was not applied "
                            "to them."))
    header = ["job", "training s", "CPU s", "other work, CPUs", "CPU demand", "load avg 1m (end)",
              "slow steps", "slow-step excess %", "flagged"]
    rows = [[r["job"], _num(r["training_s"], ".2f"), _num(r["cpu_s"], ".2f"),
             _num(r["others_cpus"], ".2f"), _num(r["cpu_demand_ratio"], ".2f"),
             _num(r["load_avg_1m_end"], ".2f"), r["slow_steps"],
             _num(r["slow_excess_fraction"], ".1f", 100.0),
             "yes" if r["flagged"] == "true" else "no"]
            for r in runs if r["state"] == "done"]
    blocks.append(("table", header, rows))
    return blocks


def _decision_blocks(results: dict) -> list[tuple]:
    """The decision-rule section (none without rules): what the rules are and are not, then
    one paragraph per model and rule: the verdict and the numbers that decided it, and the
    rule as the protocol describes it."""
    rules = results.get("decision_rules")
    if not rules:
        return []
    blocks: list[tuple] = [("h2", "Decision rules (prospective, not significance tests)"),
                           ("p", rules["note"])]
    for entry in rules["verdicts"]:
        line = decision_rule_line(entry, results["protocol"]["seeds"], code=True)
        described = f" Declared as: {entry['description']}" if entry["description"] else ""
        blocks.append(("p", line + "." + described))
    return blocks


def _report_blocks(results: dict, figures: list[tuple[str, str]],
                   runs: list[dict]) -> list[tuple]:
    p, env, code = results["protocol"], results["environment"], results["code"]
    level = f"{p['level']:.0%}"
    blocks: list[tuple] = [
        ("h1", f"Campaign {results['campaign']}"),
        ("p", f"Protocol SHA-256 `{results['protocol_sha256']}`; Cotangent code SHA-256 "
              f"`{code['cotangent_sha256']}`; torch {code['torch']}; data "
              f"{results['data']['name']} (" + ", ".join(
                  f"{k} `{v[:16]}`" for k, v in results["data"]["splits"].items()) + ")."),
        ("p", f"Machine: {env['cpu_model']} ({env['machine']}, {env['cpu_capability']}), "
              f"{env['threads']} threads, {env['platform']}, Python {env['python']}."),
        ("p", f"Design: {p['design']}, models {', '.join(p['models'])}; arms "
              f"{', '.join(p['arms'])} (baseline {p['baseline']}); seeds "
              f"{', '.join(map(str, p['seeds']))}; {p['steps']} steps, a probe every "
              f"{p['eval_every']}; target BPB " + ", ".join(
                  f"{m} {v}" for m, v in p["target_bpb"].items())
              + f"; {level} paired Student-t intervals, seed bootstrap "
              f"({p['bootstrap_resamples']} resamples) as a cross-check; non-inferiority "
              f"margin {p['margin_bpb']} BPB; arm order balanced over blocks: "
              f"{'yes' if p.get('balanced') else 'no'}. Jobs: {results['jobs']['done']} of "
              f"{results['jobs']['total']} done"
              + (f", failed: {', '.join(results['jobs']['failed'])}" if results["jobs"]["failed"]
                 else "") + "."),
        ("h2", "Paired comparisons"),
    ]
    header = ["model", "candidate", "pairs", "training-time reduction",
              "update-phase reduction", "time-to-target reduction (censored)",
              "test BPB difference", "non-inferior", "identical final hash",
              "timing-flagged pairs"]
    rows = []
    for c in results["comparisons"]:
        ttt = c["time_to_target_reduction"]
        cens = sum(len(v) for v in ttt["censored_pairs"].values())
        q = c["quality_difference_bpb"]
        rows.append([c["model"], c["candidate"], str(c["pairs"]),
                     _pct(c["training_time_reduction"]), _pct(c["update_phase_reduction"]),
                     f"{_pct(ttt)} ({cens})", _bpb(q),
                     ("yes" if q["non_inferior"] else "no") if q["t"] is not None else "-",
                     f"{c['identical_final_hash']['identical']}/{c['identical_final_hash']['pairs']}",
                     str(len(c["timing_flagged_seeds"]))])
    blocks.append(("table", header, rows))
    blocks.append(("p", f"Reductions are 1 - candidate/baseline (positive = faster), mean "
                        f"[{level} t interval] (bootstrap interval). Time to target: training "
                        "seconds at the first probe at or below the target BPB; pairs where "
                        "either run never reached it are censored and counted, not dropped."))
    blocks += _decision_blocks(results)
    blocks += _timing_blocks(results, runs)
    if results["factorial"]:
        blocks.append(("h2", "2x2 factorial (batched norms x packing)"))
        fheader = ["model", "metric"] + list(CONTRASTS)
        frows = [[f["model"], f["metric"]] + [_pct(f["contrasts"][n]) for n in CONTRASTS]
                 for f in results["factorial"]]
        blocks.append(("table", fheader, frows))
    blocks.append(("h2", "Figures"))
    for name, title in figures:
        blocks.append(("figure", name, title))
    blocks.append(("h2", "Definitions"))
    blocks.append(("pre", results["definitions"]))
    return blocks


def _markdown(blocks: list[tuple]) -> str:
    out = []
    for kind, *rest in blocks:
        if kind == "h1":
            out.append(f"# {rest[0]}\n")
        elif kind == "h2":
            out.append(f"## {rest[0]}\n")
        elif kind == "p":
            out.append(f"{rest[0]}\n")
        elif kind == "pre":
            out.append(f"```\n{rest[0].strip()}\n```\n")
        elif kind == "table":
            header, rows = rest
            out.append("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
                       + "".join("| " + " | ".join(r) + " |\n" for r in rows))
        elif kind == "figure":
            out.append(f"### {rest[1]}\n\n![{rest[1]}]({rest[0]})\n")
    return "\n".join(out)


def _html(blocks: list[tuple], folder: Path) -> str:
    def inline(text: str) -> str:  # `code` spans
        parts = html.escape(text).split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))

    body = []
    title = "report"
    for kind, *rest in blocks:
        if kind == "h1":
            title = rest[0]
            body.append(f"<h1>{html.escape(rest[0])}</h1>")
        elif kind == "h2":
            body.append(f"<h2>{html.escape(rest[0])}</h2>")
        elif kind == "p":
            body.append(f"<p>{inline(rest[0])}</p>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(rest[0].strip())}</pre>")
        elif kind == "table":
            header, rows = rest
            body.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header)
                        + "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>"
                                                             for c in r) + "</tr>" for r in rows)
                        + "</table>")
        elif kind == "figure":
            data = base64.b64encode((folder / rest[0]).read_bytes()).decode("ascii")
            body.append(f"<h3>{html.escape(rest[1])}</h3><img alt=\"{html.escape(rest[1])}\" "
                        f"src=\"data:image/png;base64,{data}\">")
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:"
             "collapse;font-size:85%}td,th{border:1px solid #ccc;padding:3px 6px}"
             "img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")
