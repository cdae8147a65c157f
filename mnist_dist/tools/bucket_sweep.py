"""Bucket size against throughput and exposed communication, our DDP and torch's side by side, on 2 ranks.

    python -m mnist_dist.tools.bench --bucket-sweep                        # about 7 minutes on 2 CPU cores
    python -m mnist_dist.tools.bench --bucket-sweep --sizes 0.25,4 --repeats 3 --steps 150
    python -m mnist_dist.tools.docs_numbers --sweep outputs/bench/<time>   # the table into docs/performance.md

Every run is one of bench's: a fresh trainer process on bench's generated data (the classic convnet),
timed by the trainer itself. Runs are interleaved (for each repeat, for each size: ddp, then torch_ddp), so
drift in the machine's speed hits both alike. A size is in MB as torch counts them (MiB), given to both as
``mode.bucket_cap_mb=<MB>``: both cut the same buckets. Per size and DDP:
images/s (median of the repeats), ddp's paired ratio to torch_ddp, and rank 0's backward counters from
results.json ``ddp_backward_ms`` (compute, communication, overlapped: ms per backward) with exposed =
communication - overlapped, also as a share of the step (1000 * batch / images/s ms). The counters
average the backwards each samples: ours the step timer's (every ``log_every``-th step), torch's every one
on a CPU (on CUDA the first 10 and every 100th), warm-up included. Writes sweep.md, sweep.json and
sweep.png (images/s and exposed communication against bucket size, log scale).

Defaults: 5 sizes x 2 DDPs x 2 repeats = 20 runs of 10 warm-up + 100 timed steps at global batch 64. On
2 CPU cores a run takes about 20 s (~110 ms a step at ~580 images/s, plus ~8 s to start the ranks and
evaluate), so the sweep takes about 7 minutes, within the 8 it may; each further repeat adds ~3.5 minutes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no backend or global figure state

from mnist_dist.operations import files, machine
from mnist_dist.tools.run import loadavg, median_counters, paired_ratio, run_trainer, summarize, write_data

SIZES_MB = (0.05, 0.25, 1.0, 4.0, 25.0)  # 25: torch's bucket_cap_mb default; this convnet is 4.6 MiB in all
STEPS = 100  # timed steps per run: with REPEATS, what fits the sweep in 8 minutes on 2 CPU cores
REPEATS = 2  # the fewest that pair ddp with torch_ddp twice; a third would take the sweep past 8 minutes
DDPS = ("ddp", "torch_ddp")


def parse_sizes(text: str | None) -> list[float]:
    """``--sizes`` ("0.25,4") as MB; SIZES_MB when not given."""
    if not text:
        return list(SIZES_MB)
    try:
        sizes = [float(word) for word in text.split(",")]
    except ValueError:
        sys.exit(f"bench: --sizes={text}: give bucket sizes in MB, comma-separated, e.g. 0.25,4")
    if any(size <= 0 for size in sizes):
        sys.exit(f"bench: --sizes={text}: bucket sizes must be positive")
    return sizes


def overrides(ddp: str, mb: float) -> list[str]:
    """The trainer overrides that run ``ddp`` with buckets of ``mb`` MB (both cut buckets as torch does)."""
    return [f"mode={ddp}", f"mode.bucket_cap_mb={mb}"]


def exposed(run: dict, batch: int) -> tuple[float, float]:
    """One run's exposed communication: ms per backward, and its share of the step."""
    counters = run["ddp_backward_ms"]
    ms = counters["backward_comm"] - counters["backward_overlap"]
    return ms, ms / (1000 * batch / run["images_per_s"])


def report(samples: list[dict], batch: int) -> list[dict]:
    """One row per size and DDP, in sweep order: the medians over its repeats."""
    rows = []
    for size in dict.fromkeys(sample["size_mb"] for sample in samples):
        runs = {ddp: [s for s in samples if s["size_mb"] == size and s["ddp"] == ddp] for ddp in DDPS}
        for ddp in DDPS:
            speeds = [run["images_per_s"] for run in runs[ddp]]
            row = {"size_mb": size, "ddp": ddp, **summarize(speeds), "counters_ms": median_counters(runs[ddp])}
            if ddp == "ddp" and runs["torch_ddp"]:  # round i of both ran back to back
                row["vs_torch_ddp"] = paired_ratio(speeds, [run["images_per_s"] for run in runs["torch_ddp"]])
            if row["counters_ms"]:
                ms, shares = zip(*(exposed(run, batch) for run in runs[ddp]))
                row.update(exposed_ms=statistics.median(ms), exposed_share=statistics.median(shares))
            rows.append(row)
    return rows


def markdown(rows: list[dict], settings: dict, machine_info: dict, load: str) -> str:
    lines = [
        machine.summary_line(machine_info) + f"; load average {load} (1, 5, 15 min)",
        "",
        f"{settings['device']}, {settings['gpus']} ranks, global batch {settings['batch']}, {settings['steps']} timed "
        f"steps per run, {settings['repeats']} interleaved rounds; counters: rank 0's, ms per backward, medians of "
        "the rounds; exposed = communication - overlapped",
        "",
        "| bucket (MB) | DDP | images/s (median) | min – max | ddp / torch_ddp | backward compute | communication "
        "| overlapped | exposed | exposed / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = row["ddp"]
        ratio = row.get("vs_torch_ddp")
        cells = [f"{row['size_mb']:g}", name, f"{row['median']:,.0f}", f"{row['min']:,.0f} – {row['max']:,.0f}"]
        cells.append(f"{ratio['median']:.2f} ({ratio['min']:.2f} – {ratio['max']:.2f})" if ratio else "")
        c = row["counters_ms"]
        if c:
            cells += [f"{c['backward_compute']:.1f}", f"{c['backward_comm']:.1f}", f"{c['backward_overlap']:.1f}"]
            cells += [f"{row['exposed_ms']:.1f}", f"{row['exposed_share']:.1%}"]
        else:
            cells += ["—"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path, machine_info: dict, ranks: int) -> None:
    figure = Figure(figsize=(7, 6))
    speed, comm = figure.subplots(2, 1, sharex=True)
    for ddp, color in zip(DDPS, ("tab:blue", "tab:orange")):
        mine = [row for row in rows if row["ddp"] == ddp]
        sizes = [row["size_mb"] for row in mine]
        errors = [[row["median"] - row["min"] for row in mine], [row["max"] - row["median"] for row in mine]]
        speed.errorbar(sizes, [row["median"] for row in mine], yerr=errors, marker="o", capsize=3, color=color)
        shares = [100 * row.get("exposed_share", float("nan")) for row in mine]
        comm.plot(sizes, shares, marker="o", color=color, label=ddp)
    speed.set(ylabel="images/s (median, min–max)")
    comm.set(xscale="log", xlabel="bucket size (MB)", ylabel="exposed communication (% of step)")
    sizes = sorted({row["size_mb"] for row in rows})
    comm.set_xticks(sizes, [f"{size:g}" for size in sizes])
    comm.minorticks_off()
    comm.legend()
    where = machine_info.get("gpu") or machine_info["cpu"]
    figure.suptitle(f"bucket size sweep, {ranks} ranks: {where}, {machine_info['cores']} cores")
    figure.tight_layout()
    with files.atomic(path) as out:
        figure.savefig(out.file, format="png", dpi=110)


def run(settings: dict, sizes: list[float], out: Path, work: Path) -> int:
    """The whole sweep: every repeat, size and DDP interleaved, in ``work``; sweep.md, sweep.json and sweep.png
    in ``out``."""
    load_before, started = loadavg(), time.monotonic()
    write_data(work, settings)
    samples = []
    for round_ in range(settings["repeats"]):
        for size in sizes:
            for ddp in DDPS:
                measured = run_trainer(f"{ddp}_{size:g}MB", overrides(ddp, size), work, settings, round_)
                samples.append({"size_mb": size, "ddp": ddp, "round": round_, **measured})
                print(
                    f"round {round_ + 1}/{settings['repeats']} {ddp} {size:g} MB: "
                    f"{measured['images_per_s']:,.0f} images/s",
                    flush=True,
                )
    rows = report(samples, settings["batch"])
    info, load = machine.describe(), f"{load_before} before, {loadavg()} after"
    table = markdown(rows, settings, info, load)
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / "sweep.md", table)
    saved = {"machine": info, "load": load, "settings": {**settings, "sizes_mb": sizes}, "rows": rows}
    files.write_text(out / "sweep.json", json.dumps({**saved, "samples": samples}, indent=2) + "\n")
    chart(rows, out / "sweep.png", info, settings["gpus"])
    minutes = (time.monotonic() - started) / 60
    print("\n" + table + f"\nwrote {out}/sweep.md, sweep.json, sweep.png ({minutes:.1f} minutes)")
    return 0
