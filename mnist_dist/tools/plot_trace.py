"""Draws one profiled step of every rank's trace (profile=true): backward ops, all-reduces, optimizer.

    python -m mnist_dist.tools.plot_trace outputs/<date>/<time>_ddp docs/ddp_trace.png

Perfetto (ui.perfetto.dev) shows the whole trace; this picture answers one question offline: does the
all-reduce run while backward still computes? The all-reduce bars are gloo's (or NCCL's) own events,
from when a bucket was handed over to when its result was ready.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mnist_dist.operations import files  # noqa: E402

# row label, colour, test on an event name; the first match wins. Forward is drawn from the step's start
# to its first backward op (data indexing and zero_grad included: both are small).
KINDS = [
    ("forward", "tab:grey", lambda name: False),
    ("all-reduce", "tab:red", lambda name: name.endswith(":all_reduce")),
    ("backward", "tab:blue", lambda name: name.endswith("Backward0") and "::" not in name),
    ("optimizer", "tab:green", lambda name: name.startswith("Optimizer.step")),
]


def step_events(trace: Path, step: int) -> tuple[float, dict[str, list[tuple[float, float]]]]:
    """The span of ``ProfilerStep#<step>`` and, by kind, the (start, duration) in ms of its events."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    (span,) = [e for e in events if e["name"] == f"ProfilerStep#{step}"]
    start, end = span["ts"], span["ts"] + span["dur"]
    bars = {label: [] for label, _, _ in KINDS}
    for event in events:
        if start <= event["ts"] <= end:
            label = next((label for label, _, test in KINDS if test(event["name"])), None)
            if label:
                bars[label].append(((event["ts"] - start) / 1000, event["dur"] / 1000))
    bars["forward"] = [(0.0, min(start for start, _ in bars["backward"]))]
    return (end - start) / 1000, bars


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory with trace_rank<r>.json files")
    parser.add_argument("out", type=Path, help="the picture to write (.png)")
    parser.add_argument("--step", type=int, help="which ProfilerStep (default: the second one recorded)")
    args = parser.parse_args(argv)
    traces = sorted(args.run_dir.glob("trace_rank*.json"))
    if not traces:
        parser.error(f"no trace_rank*.json in {args.run_dir}: train with profile=true")
    if args.step is None:
        names = [e["name"] for e in json.loads(traces[0].read_text())["traceEvents"] if e.get("ph") == "X"]
        args.step = sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))[1]
    fig, ax = plt.subplots(figsize=(10, 1 + 0.9 * len(traces) * len(KINDS) / 2))
    labels, longest = [], 0.0
    for rank, trace in enumerate(traces):
        length, bars = step_events(trace, args.step)
        longest = max(longest, length)
        for row, (label, colour, _) in enumerate(KINDS):
            y = (rank * len(KINDS) + row) * 10
            ax.broken_barh(bars[label], (y, 8), facecolors=colour)
            labels.append((y + 4, f"rank {rank}: {label}"))
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.invert_yaxis()
    ax.set_xlim(0, longest)
    ax.set_xlabel(f"ms since ProfilerStep#{args.step} began")
    ax.set_title(f"{args.run_dir.name}: one training step per rank")
    fig.tight_layout()
    with files.atomic(args.out) as out:
        fig.savefig(out.file, format=Path(args.out).suffix.lstrip(".") or "png", dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
