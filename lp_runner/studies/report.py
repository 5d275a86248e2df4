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


def markdown(report: dict) -> str:
    md: list[str] = [f"# Strong-scaling study ({report['date']})", ""]
    meas = report.get("measured")
    if meas:
        md += [
            f"**Measured** on {report.get('machine', 'this machine')}: {meas['prompts']} prompts from "
            f"{meas['prompts_file']}, config {meas['config']}; outputs identical to P={meas['base_workers']}'s at "
            f"every P: **{meas['identical_outputs']}**.",
            "",
            "| P | window(s) | latency p50 s | p90 s | tokens/s | ms/token | speed vs P=1 | tokens/forward | "
            "rows/rank | forward | host | comm (incl. wait) | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in meas["points"]:
            wins = ", ".join(_window(json.loads(w)) for w in r["windows"])
            md.append(
                f"| {r['workers']} | {wins} | {r['latency_p50_s']:.3f} | {r['latency_p90_s']:.3f} | "
                f"{r['tokens_per_s']:.2f} | {r['ms_per_token']:.2f} | {r['speedup_vs_p1']:.2f}x | "
                f"{r['tokens_per_forward']:.2f} | {r['rows_per_rank']:.1f} | {100 * r['forward_share']:.0f}% | "
                f"{100 * r['host_share']:.0f}% | {100 * r['comm_share']:.0f}% | {r['identical_to_base']} |"
            )
        md.append("")
    sim = report.get("simulated")
    if sim:
        inp = sim["inputs"]
        link = inp["interconnect"]
        md += [
            f"**Simulated** (not measured): forward {inp['curve']}; model shape {inp['model_shape']}; acceptance "
            f"{inp['acceptance']}; beyond the recorded windows: {inp['extension']}; host: {inp['host']}; "
            f"collective: {link['name']} ({link['source']}; {link['model']}); K/V length {inp['kv_len']}; "
            f"{inp['excluded']} excluded. Knee of the curve (within 10% of one row): {sim['knee_rows']} rows.",
            "",
            "| P (simulated) | window W-N-G | rows/rank (busiest) | tokens/forward | forward ms | host ms | "
            "collective ms | ms/token | speed vs P=1 (>1: faster) | same window as P=1: ms/token |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sim["points"]:
            md.append(
                f"| {p['workers']} | {_window(p['window'])} | {p['rows_per_rank']} | {p['tokens_per_forward']:.2f} | "
                f"{p['forward_ms']:.3f} | {p['host_ms']:.3f} | {p['collective_ms']:.3f} | {p['ms_per_token']:.4f} | "
                f"{p['speedup_vs_p1']:.2f}x | {p['fixed_window_ms_per_token']:.4f} |"
            )
        md += ["", f"What limits it: {sim['limits']}.", ""]
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
        left.plot(ps, [r["latency_p50_s"] for r in meas["points"]], "s-", label="measured latency p50 (s)")
        left.plot(ps, [r["latency_p90_s"] for r in meas["points"]], "^-", label="measured latency p90 (s)")
        right.plot(ps, [r["tokens_per_forward"] for r in meas["points"]], "s-", label="measured tokens/forward")
        right.plot(ps, [r["rows_per_rank"] for r in meas["points"]], "^-", label="measured rows/rank (rank 0)")
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
            fixed = [p["fixed_window_ms_per_token"] for p in sim["points"]]
            left.plot(ps, fixed, "x:", label="simulated, P=1's window")
            left.set_ylabel("ms per token")
        right.plot(ps, [p["tokens_per_forward"] for p in sim["points"]], "o--", label="simulated tokens/forward")
        right.plot(ps, [p["rows_per_rank"] for p in sim["points"]], "x--", label="simulated rows/rank (busiest)")
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
    """``out``/study.json, study.md and study.png; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "study.json", out / "study.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    if plot(report, out / "study.png"):
        paths.append(out / "study.png")
    return paths
