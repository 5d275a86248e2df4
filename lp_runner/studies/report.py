"""A study's report: JSON, a markdown table and plots, every figure labelled measured or simulated.

The Lookahead paper's figures stand in their own labelled lines, never in a column they are not comparable with.
"""

from __future__ import annotations

import json
from pathlib import Path

from lp_runner.logs import log
from lp_runner.studies.simulate import PAPER_LP


def _window(d: dict) -> str:
    return "plain decoding" if d["W"] == 0 else f"{d['W']}-{d['N']}-{d['G']}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def rows_label(value: float | None) -> str:
    """A measured row count a round; "n/a" where a record at P > 1 lacks every rank's rows (an older file)."""
    return "n/a" if value is None else f"{value:.1f}"


def markdown(report: dict) -> str:
    md: list[str] = [f"# Strong-scaling study ({report['date']})", ""]
    meas = report.get("measured")
    if meas:
        md += [
            f"**Measured** on {report.get('machine', 'this machine')}: {meas['prompts']} prompts from "
            f"{meas['prompts_file']}, config {meas['config']}; {meas['repeat']} repetitions, P values interleaved, a "
            f"warm-up prompt first in every run; {meas['threads_per_rank']} thread(s) a rank at every P; outputs "
            f"identical to P={meas['base_workers']}'s at every P: **{meas['identical_outputs']}**.",
            "",
            "| P | window | ms/token (median) | spread | speed vs P=1 (> 1 faster) | its range over repetitions | "
            "latency p50 s | p90 s | tokens/forward | busiest rank's rows/round | forward | host | comm (incl. wait) | "
            "identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in meas["points"]:
            rng = r["speed_vs_p1_range"]
            md.append(
                f"| {r['label']} | {r['window']} | {r['ms_per_token']:.3f} | {100 * r['spread']:.0f}% | "
                f"{_x(r['speed_vs_p1'])} | {f'{rng[0]:.2f}-{rng[1]:.2f}x' if rng else 'n/a'} | "
                f"{r['latency_p50_s']:.3f} | {r['latency_p90_s']:.3f} | {r['tokens_per_forward']:.2f} | "
                f"{rows_label(r['busiest_rank_rows'])} | {100 * r['forward_share']:.0f}% | "
                f"{100 * r['host_share']:.0f}% | {100 * r['comm_share']:.0f}% | {r['identical_to_base']} |"
            )
        md.append("")
        md += [f"**Warning:** {w}" for w in meas.get("warnings", [])]
        md.append("")
    sim = report.get("simulated")
    if sim:
        inp = sim["inputs"]
        link = inp["interconnect"]
        md += [
            f"**Simulated** (not measured): forward {inp['curve']}, rows priced at {inp['rows_priced_at']}; model "
            f"shape {inp['model_shape']}; acceptance of {inp['acceptance']}; beyond the recorded windows: "
            f"{inp['extension']}; host: {inp['host']}; collective: {link['name']} ({link['source']}; {link['model']}); "
            f"K/V length: {inp['kv_len']}; {inp['margin']}; {inp['excluded']} excluded. Knee of the curve (within 10% "
            f"of one row): {sim['knee_rows']} rows. Plain decoding on one device: {sim['plain_ms_per_token']:.4f} "
            "ms/token.",
            "",
            "| P (simulated) | window W-N-G | busiest rank's rows (knee) | tokens/forward [95% interval] | "
            "forward ms | collective ms | host ms | ms/token | speed vs P=1 (> 1 faster) | speed vs plain decoding | "
            "same window as P=1: ms/token |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sim["points"]:
            lo, hi = p["tokens_per_forward_interval"] or (p["tokens_per_forward"],) * 2
            same = p.get("same_window_as_p1_ms_per_token")
            md.append(
                f"| {p['workers']} | {_window(p['window'])} | {p['busiest_rank_rows']:.0f} ({sim['knee_rows']}) | "
                f"{p['tokens_per_forward']:.2f} [{lo:.2f}, {hi:.2f}] | {p['forward_ms']:.3f} | "
                f"{p['collective_ms']:.3f} | {p['host_ms']:.3f} | {p['ms_per_token']:.4f} | {_x(p['speed_vs_p1'])} | "
                f"{_x(p['speed_vs_plain'])} | {'n/a' if same is None else f'{same:.4f}'} |"
            )
        md += ["", f"What limits it: {sim['limits']}.", ""]
        band = sim.get("band")
        if band:
            r, sl = band["speed_vs_p1"], band["slope_per_doubling"]
            md += [
                f"Band: P={band['workers']}'s speed vs P=1 is {min(r['low'], r['high']):.2f}x to "
                f"{max(r['low'], r['high']):.2f}x ({r['point']:.2f}x at the fitted slope, {sl['point']:+.3f}) over the "
                f"recorded slope's 95% interval, {sl['low']:+.3f} to {sl['high']:+.3f} tokens per forward per doubling "
                f"of rows; {band['rule']}.",
                "",
            ]
        if sim.get("splits"):
            md += split_markdown(sim["splits"])
        md += ["The Lookahead paper's reported figures (its GPUs, its models; not comparable with the rows above):", ""]
        md += [f"- {line}" for line in PAPER_LP]
    return "\n".join(md) + "\n"


def split_markdown(splits: dict) -> list[str]:
    """The D x P table of ``splits`` (``cli/study.py``) and why its winners win."""
    md = [
        f"Splits of {splits['devices']} devices (simulated; {splits['assumption']}):",
        "",
        "| split | window | ms/token | job tokens/s |",
        "|---|---|---|---|",
    ]
    for s in splits["table"]:
        md.append(
            f"| D={s['groups']} x P={s['workers']} | {_window(s['window'])} | {s['ms_per_token']:.4f} | "
            f"{s['tokens_per_s']:.1f} |"
        )
    md += ["", splits["why"], ""]
    return md


def plot(report: dict, path: Path) -> bool:
    """Left: per-prompt latency p50 / p90 vs P (measured) beside the simulated ms per token x the measured
    tokens per prompt; right: tokens per forward and rows per rank vs P. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    meas, sim = report.get("measured"), report.get("simulated")
    if meas:
        ps = [r["workers"] for r in meas["points"]]
        left.plot(ps, [r["latency_p50_s"] for r in meas["points"]], "s", label="measured latency p50 (s)")
        left.plot(ps, [r["latency_p90_s"] for r in meas["points"]], "^", label="measured latency p90 (s)")
        right.plot(ps, [r["tokens_per_forward"] for r in meas["points"]], "s", label="measured tokens/forward")
        rows = [r["busiest_rank_rows"] for r in meas["points"]]
        if None not in rows:  # older records without every rank's rows: no line rather than rank 0's
            right.plot(ps, rows, "^-", label="measured rows/round (busiest rank)")
    if sim:
        ps = [p["workers"] for p in sim["points"]]
        if meas:  # the simulated latency of a median prompt: ms/token x its measured tokens
            counts = sorted(x["new_tokens"] for x in meas["points"][0]["prompts"])
            tokens = counts[len(counts) // 2]
            ys = [p["ms_per_token"] * tokens / 1e3 for p in sim["points"]]
            left.plot(ps, ys, "o--", label=f"simulated latency of {tokens} tokens (s)")
            left.set_ylabel("latency per prompt (s)")
        else:
            left.plot(ps, [p["ms_per_token"] for p in sim["points"]], "o--", label="simulated ms/token")
            fixed = [p.get("same_window_as_p1_ms_per_token") for p in sim["points"]]
            if None not in fixed:
                left.plot(ps, fixed, "x:", label="simulated, P=1's window")
            left.set_ylabel("ms per token")
        right.plot(ps, [p["tokens_per_forward"] for p in sim["points"]], "o--", label="simulated tokens/forward")
        right.plot(ps, [p["busiest_rank_rows"] for p in sim["points"]], "x--", label="simulated rows (busiest rank)")
    for ax, title in ((left, "latency vs P"), (right, "tokens per forward and rows per rank vs P")):
        ax.set_xlabel("workers P")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    right.set_yscale("symlog")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(report: dict, out: Path) -> list[Path]:
    """``out``/study.json, study.md and study.png, each written atomically (``outfiles.write_file``: the old
    file or the new one, never a torn one); returns the paths written."""
    from lp_runner.outfiles import write_file

    paths = [out / "study.json", out / "study.md"]
    write_file(paths[0], (json.dumps(report, indent=2) + "\n").encode("utf-8"))
    write_file(paths[1], markdown(report).encode("utf-8"))
    png = out / "study.png"
    tmp = out / ".study.png.tmp.png"
    if plot(report, tmp):
        write_file(png, tmp.read_bytes())
        tmp.unlink()
        paths.append(png)
    return paths
