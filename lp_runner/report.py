"""What a run shows and keeps: records to the output file, the progress bar, the end-of-run summary.

One ``Report`` per run, on the process that writes (the only process, torchrun's rank 0, or the Ray driver), so
every launcher produces the same file, bar and summary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from lp_runner.config import Config
from lp_runner.metrics import combine
from lp_runner.output import OutputFile


def format_summary(cfg: Config, summary: dict, load_s: float, workers: int) -> str:
    la = cfg.lookahead
    lines = [
        "-" * 64,
        f"lp_runner  W={la.window_size} N={la.ngram_size} G={la.verification_set_size} "
        f"pool_from_prompt={la.pool_from_prompt}  workers={workers}",
        f"prompts {summary['generations']}  new tokens {summary['new_tokens']}  forwards {summary['forwards']}  "
        f"tokens/forward {summary['tokens_per_forward']:.2f}",
        f"tokens/s {summary['tokens_per_s']:.2f}  generation {summary['seconds']:.2f} s  model load {load_s:.2f} s",
        f"time split: forward {100 * summary['forward_share']:.1f}%  host {100 * summary['host_share']:.1f}%  "
        f"comm {100 * summary['comm_share']:.1f}% ({summary['comm_us_per_round']:.0f} us/round)  "
        f"mean packed rows {summary['mean_rows']:.1f}",
        "-" * 64,
    ]
    return "\n".join(lines)


class Report:
    """Records of this run go to ``output`` (if any) and the bar; ``finish`` prints the summary.

    ``total``: prompts in the job, ``already``: of those, how many the output held before (``--resume``).
    """

    def __init__(
        self, cfg: Config, output: OutputFile | None, total: int, already: int = 0, progress: bool = True
    ) -> None:
        self.cfg = cfg
        self.output = output
        self.records: list[dict] = []
        self.already = already
        self.bar: Any = None
        if progress and cfg.run.progress and total > 1:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=already, desc="prompts", unit="prompt", file=sys.stderr)

    def record(self, rec: dict) -> None:
        self.records.append(rec)
        if self.output is not None:
            self.output.write(rec)
        if self.bar is not None:
            self.bar.update(1)
            if "error" not in rec:
                self.bar.set_postfix(tok_per_fwd=f"{rec['tokens_per_forward']:.2f}", tok_s=f"{rec['tokens_per_s']:.1f}")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, load_s: float, workers: int, recoveries: Sequence[dict] = ()) -> None:
        self.close_bar()
        if not self.cfg.run.summary:
            return
        generated = [r for r in self.records if "error" not in r]
        summary = combine(SimpleNamespace(**r["stats"]) for r in generated)
        lines = format_summary(self.cfg, summary, load_s, workers).split("\n")
        errors = len(self.records) - len(generated)
        if errors or self.already:
            lines.insert(
                -1,
                f"skipped: {self.already} already in the output (--resume), {errors} error records "
                f"(run.on_error={self.cfg.run.on_error})",
            )
        if recoveries:
            spent = sum(r["seconds"] or 0.0 for r in recoveries)
            lines.insert(-1, f"recoveries {len(recoveries)} (lost workers, {spent:.2f} s to rebuild)")
            for r in recoveries:
                lines.insert(
                    -1,
                    f"  {r['lost'][:80]} -> prompt '{r['prompt']}' resumed at token {r['resumed_at_token']} "
                    f"on {r['workers_after']} workers",
                )
        print("\n".join(lines), file=sys.stderr)
