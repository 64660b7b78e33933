"""Charts of a run's output (``--charts DIR``, or ``--charts DIR --from-json bench.json``): PNGs of the run,
``speedup.png`` (in-tree time / hf_tfm time per pair and task) and, for a decode-settings run, ``decode_settings.png``
(ms per decode step and fraction of the streaming bandwidth per setting), for a runtimes run ``runtimes.png``;
``--charts DIR --from-json bench.json`` draws them from a saved ``--json`` output without running anything.
"""

from __future__ import annotations

from pathlib import Path

CHART_WIDTH_IN, CHART_DPI = 9.0, 150  # 1350 px, readable shown 900 px wide
SIDES = {"ours": "hf_tfm", "theirs": "in-tree"}


def write_charts(out: dict, directory: Path) -> list[Path]:
    """PNG charts of a run's output (as `--json` writes it): `speedup.png` when it has pair results,
    `decode_settings.png` when it has decode-setting results, `runtimes.png` for a runtimes run. Returns the paths
    written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    title = run_title(out)
    # train_compiled times hf_tfm compiled against hf_tfm eager, not against the in-tree model
    rows = [r for r in out.get("results", []) if r["task"] != "train_compiled"]
    figures = {}
    if rows:
        figures["speedup.png"] = speedup_chart(rows, title)
    if out.get("decode"):
        figures["decode_settings.png"] = decode_chart(out["decode"], out["bandwidth"], title)
    if out.get("runtimes"):  # one series per batch size: each row is one runtime's own numbers
        rows = [{**r, "ours": {k: v for k, v in r.items() if k.startswith("b")}} for r in out["runtimes"]]
        heading = "The same weights decoding in hf_tfm and in other runtimes, each in its own process"
        figures["runtimes.png"] = decode_chart(rows, out["bandwidth"], title, {"ours": "greedy"}, heading)
    paths = []
    for name, fig in figures.items():
        FigureCanvasAgg(fig).print_png(directory / name, metadata={"Software": "hf_tfm scripts/bench.py"})
        paths.append(directory / name)
    return paths


def run_title(out: dict) -> str:
    """Where and how the run measured: size, threads, dtype, machine."""
    args, machine = out.get("args", {}), out.get("machine", {})
    sizes = "/".join(args.get("sizes") or [str(args.get("size"))])
    n = machine.get("torch_threads", args.get("threads"))
    threads = "GPU" if machine.get("device") == "cuda" else f"{n} thread{'' if n == 1 else 's'}"
    where = machine.get("gpu") or machine.get("cpu") or machine.get("processor", "?")
    return f"size {sizes}, {threads}, {args.get('dtype')}, {where}, torch {machine.get('torch')}"


def new_figure(height_in: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(CHART_WIDTH_IN, height_in), dpi=CHART_DPI, layout="constrained")


def speedup_chart(rows: list[dict], title: str):
    """Horizontal bars of in-tree time / hf_tfm time, one group per pair (and size), one bar per task, a line at 1.0
    (equal time) and the values in a column at the right."""
    import matplotlib

    several_sizes = len({r["size"] for r in rows}) > 1
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['size']} {r['pair']}" if several_sizes else r["pair"], []).append(r)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    colours = dict(zip(tasks, matplotlib.colormaps["tab10" if len(tasks) <= 10 else "tab20"].colors, strict=False))
    slots = len(rows) + len(groups)  # a heading slot above each group's bars
    fig = new_figure(1.4 + 0.3 * slots)
    ax = fig.subplots()
    y, ticks, labels = 0, [], []
    top = max(max(r["speedup"] for r in rows), 1.0) * 1.2  # room for the column of values
    for name, members in groups.items():
        heading = f"{name} ({members[0]['theirs_name']})"
        over_line = {"facecolor": "white", "edgecolor": "none", "pad": 1}  # hides the line at 1.0 behind it
        ax.text(0.005, y, heading, transform=ax.get_yaxis_transform(), va="center", fontweight="bold", bbox=over_line)
        for r in members:
            y += 1
            ax.barh(y, r["speedup"], height=0.75, color=colours[r["task"]])
            ax.text(0.995, y, f"{r['speedup']:.2f}x", transform=ax.get_yaxis_transform(), va="center", ha="right")
            ticks.append(y)
            labels.append(r["task"])
        y += 1
        if y < slots:
            ax.axhline(y - 0.5, color="0.85", linewidth=0.8)
    ax.axvline(1.0, color="0.2", linestyle="--", linewidth=1)
    ax.set_yticks(ticks, labels)
    ax.set_ylim(slots - 0.5, -0.6)
    ax.set_xlim(0, top)
    ax.set_xlabel("in-tree time / hf_tfm time (> 1: hf_tfm faster; dashed: equal time)")
    fig.suptitle(f"hf_tfm speedup over the in-tree transformers model (medians)\n{title}", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    return fig


def decode_chart(rows: list[dict], bandwidth: dict, title: str, sides: dict = SIDES, heading: str = ""):
    """Per weight setting: ms per decode step and the fraction of the streaming bandwidth, for each of `sides` (hf_tfm
    and in-tree), per batch size; a setting that failed here is named with its error."""
    import matplotlib

    step_keys = {k for r in rows if "error" not in r for k in r["ours"] if k.endswith("_step_s")}  # b1_step_s, ...
    batches = sorted(int(k.removeprefix("b").removesuffix("_step_s")) for k in step_keys)
    series = [(side, batch) for batch in batches for side in sides]
    colours = matplotlib.colormaps["tab20"].colors  # dark/light pairs: hf_tfm/in-tree, one hue per batch
    height = 0.8 / max(len(series), 1)
    fig = new_figure(1.8 + 0.45 * len(rows))
    ax_ms, ax_bw = fig.subplots(1, 2, sharey=True)
    ms_values = []
    for k, (side, batch) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * height
        ok = [(i + offset, r[side]) for i, r in enumerate(rows) if "error" not in r]
        style = {"height": height, "color": colours[k], "label": f"{sides[side]} B={batch}"}
        ms = [d[f"b{batch}_step_s"] * 1e3 for _, d in ok]
        ms_values += ms
        ax_ms.barh([y for y, _ in ok], ms, **style)
        ax_bw.barh([y for y, _ in ok], [d[f"b{batch}_bandwidth_frac"] for _, d in ok], **style)
    for i, r in enumerate(rows):
        if "error" in r:
            why = f"fails here: {r['error'].split(':')[0]} (see the table)"
            ax_ms.text(0.01, i, why, transform=ax_ms.get_yaxis_transform(), va="center", color="0.4")
    if ms_values and max(ms_values) > 20 * min(ms_values):
        _log_scale(ax_ms)
    _label(ax_ms, ax_bw, [r["setting"] for r in rows], bandwidth)
    if series:
        fig.legend(*ax_ms.get_legend_handles_labels(), loc="outside lower center", ncols=len(series))
    heading = heading or "Decoding under each weight setting, hf_tfm and in-tree Llama"
    fig.suptitle(f"{heading}\n{title}", fontsize=11)
    return fig


def _log_scale(ax) -> None:
    """A log x axis labelled at 1, 2, 5 x 10^k as plain numbers (matplotlib's minor labels overlapped)."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _label(ax_ms, ax_bw, settings: list[str], bandwidth: dict) -> None:
    """The decode chart's two axes: settings down the side, ms per step and the bandwidth fraction (a dashed line at
    all of it) across."""
    ax_bw.axvline(1.0, color="0.2", linestyle="--", linewidth=1)
    ax_ms.set_yticks(range(len(settings)), settings)
    ax_ms.set_ylim(len(settings) - 0.5, -0.5)
    ax_ms.set_xlabel("ms per decode step (lower is faster)")
    ax_bw.set_xlabel("bytes per step / step time / bandwidth")
    ax_ms.set_title("one new token per sequence", fontsize=10)
    ax_bw.set_title(f"fraction of {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s streaming (dashed)", fontsize=10)
    for ax in (ax_ms, ax_bw):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", color="0.9")
        ax.set_axisbelow(True)
