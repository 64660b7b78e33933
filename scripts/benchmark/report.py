"""The markdown report: one table writer, and the columns of each kind of run (pairs, decode settings, runtimes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """A table column: its title, its cell of a row, and whether it holds numbers (right-aligned)."""

    title: str
    cell: Callable[[dict], str]
    numbers: bool = True


def table(columns: Sequence[Column], rows: list[dict]) -> list[str]:
    """A markdown table's lines. A row with an `error` shows it after its first three cells (size, setting, what)."""
    lines = [
        "| " + " | ".join(c.title for c in columns) + " |",
        "|" + "|".join("---:" if c.numbers else "---" for c in columns) + "|",
    ]
    for row in rows:
        if "error" in row:
            named = " | ".join(c.cell(row) for c in columns[:3])
            lines.append(f"| {named} | fails: {row['error']} " + "|" * (len(columns) - 4))
        else:
            lines.append("| " + " | ".join(c.cell(row) for c in columns) + " |")
    return lines


def text(key: str) -> Column:
    return Column(key, lambda r: str(r[key]), numbers=False)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def header(machine: dict) -> str:
    """The machine's load around the run (the host is shared): load averages at the start and the end, and the cores
    other processes left free."""
    loads = [
        f"{' / '.join(f'{x:.2f}' for x in machine[key])} at the {when}"
        for key, when in (("loadavg_start", "start"), ("loadavg_end", "end"))
        if machine.get(key)
    ]
    line = f"Load average (1 / 5 / 15 min): {', '.join(loads) or 'unknown'}"
    free = machine.get("free_cores")
    if free and None not in free:
        line += f"; cores free of other work: {free[0]} at the start, {free[1]} at the end, of {machine['cpu_count']}"
    return line + "."


def bandwidth_line(bandwidth: dict) -> str:
    """The streaming bandwidth every fraction is of."""
    rates = bandwidth.get("bytes_per_s_by_kernel", {})
    kernels = ""
    if len(rates) > 1:  # which GEMV set it, for a run that timed more than MKL's
        kernels = ", the faster of " + " and ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in rates.items())
    return (
        f"Streaming bandwidth (fp32 GEMV over {bandwidth['bytes'] / 2**20:.0f} MiB{kernels}): "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Pair results: hf_tfm against the in-tree model


def _mem(side: dict) -> str:
    return f"{side['peak_mem_bytes'] / 2**20:.0f}" if "peak_mem_bytes" in side else "-"


def _matmul_frac(r: dict) -> str:
    o, t = r["ours"], r["theirs"]
    frac = f"{o['mm_frac']:.2f} / {t['mm_frac']:.2f}" if "mm_frac" in o else "-"
    if "mfu" in o:  # GPU: model FLOPs utilisation against the vendor bf16 peak
        frac += f" (MFU {o['mfu']:.2f} / {t['mfu']:.2f})"
    return frac


PAIR_COLUMNS = (
    text("size"),
    text("pair"),
    text("task"),
    Column("in-tree", lambda r: r["theirs_name"], numbers=False),
    Column("hf_tfm ms", lambda r: ms(r["ours"]["median_s"])),
    Column("in-tree ms", lambda r: ms(r["theirs"]["median_s"])),
    Column("hf_tfm tok/s", lambda r: f"{r['ours']['tokens_per_s']:.0f}"),
    Column("in-tree tok/s", lambda r: f"{r['theirs']['tokens_per_s']:.0f}"),
    Column("speedup", lambda r: f"**{r['speedup']:.2f}x**"),
    Column("hf_tfm peak MiB", lambda r: _mem(r["ours"])),
    Column("in-tree peak MiB", lambda r: _mem(r["theirs"])),
    Column("mem ratio", lambda r: f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "-"),
    Column("matmul frac (hf_tfm / in-tree)", _matmul_frac, numbers=False),
)
EXTRA_COLUMNS = (
    text("size"),
    text("pair"),
    text("what"),
    Column("hf_tfm", lambda e: e["ours"]),
    Column("in-tree", lambda e: e["theirs"]),
)


def fmt_row(r: dict) -> str:
    """One pair result as its table row."""
    return table(PAIR_COLUMNS, [r])[-1]


def markdown(results: list[dict], extra: list[dict]) -> str:
    lines = table(PAIR_COLUMNS, results)
    if extra:
        lines += ["", *table(EXTRA_COLUMNS, extra)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Decode settings: hf_tfm and in-tree Llama under each weight setting


def decode_markdown(rows: list[dict], bandwidth: dict, batches: tuple[int, int]) -> str:
    b1, b8 = batches
    columns = [
        text("size"),
        text("setting"),
        Column("weights", lambda r: r["what"], numbers=False),
        Column("MB/step", lambda r: f"{r['ours']['weight_bytes_per_step'] / 1e6:.1f}"),
        *(
            Column(f"{who} ms B={b}", lambda r, name=name, b=b: ms(r[name][f"b{b}_step_s"]))
            for b in (b1, b8)
            for who, name in (("hf_tfm", "ours"), ("in-tree", "theirs"))
        ),
        Column(
            f"vs fp32 in-tree B={b1} (hf_tfm / in-tree)",
            lambda r: (
                f"**{r['ours'][f'b{b1}_speedup_vs_fp32_in_tree']:.2f}x** / "
                f"{r['theirs'][f'b{b1}_speedup_vs_fp32_in_tree']:.2f}x"
            ),
        ),
        Column(f"vs fp32 in-tree B={b8}", lambda r: f"{r['ours'][f'b{b8}_speedup_vs_fp32_in_tree']:.2f}x"),
        Column(f"GB/s B={b1} (hf_tfm)", lambda r: f"{r['ours'][f'b{b1}_bytes_per_s'] / 1e9:.1f}"),
        Column(
            f"bandwidth frac B={b1} (hf_tfm / in-tree)",
            lambda r: f"{r['ours'][f'b{b1}_bandwidth_frac']:.2f} / {r['theirs'][f'b{b1}_bandwidth_frac']:.2f}",
        ),
    ]
    return "\n".join([bandwidth_line(bandwidth), "", *table(columns, rows)])


# ---------------------------------------------------------------------------------------------------------------------
# Runtimes: the same weights in hf_tfm and in other runtimes, each in its own process


def _speedup(r: dict, name: str) -> str:
    return f"{r.get(f'{name}_speedup_vs_hf_tfm_fp32', float('nan')):.2f}x"


def _first_token(r: dict, length: int) -> str:
    return ms(r[f"ttft_p{length}_s"]) if f"ttft_p{length}_s" in r else "fails"


def runtimes_markdown(
    rows: list[dict], bandwidth: dict, batches: tuple[int, int], ttft: Sequence[int] = (), padded: bool = False
) -> str:
    """The runtimes' table; `ttft`: the prompt lengths of its time-to-first-token columns; `padded`: its batch's
    prompts were of different lengths."""
    b1, b8 = batches
    batch = f"B={b8} padded" if padded else f"B={b8}"
    columns = [
        text("size"),
        text("setting"),
        text("what"),
        Column("weights MB/step", lambda r: f"{r['weight_bytes_per_step'] / 1e6:.1f}"),
        Column(f"ms/token B={b1}", lambda r: ms(r[f"b{b1}_step_s"])),
        Column(f"ms/token {batch}", lambda r: ms(r[f"b{b8}_step_s"])),
        Column(f"vs hf_tfm fp32 B={b1}", lambda r: f"**{_speedup(r, f'b{b1}')}**"),
        Column(f"vs hf_tfm fp32 {batch}", lambda r: _speedup(r, f"b{b8}")),
        Column(f"bandwidth frac B={b1}", lambda r: f"{r[f'b{b1}_bandwidth_frac']:.2f}"),
        *(Column(f"first token ms P={n}", lambda r, n=n: _first_token(r, n)) for n in ttft),
        *(Column(f"first token vs hf_tfm fp32 P={n}", lambda r, n=n: _speedup(r, f"ttft_p{n}")) for n in ttft),
    ]
    heading = f"{bandwidth_line(bandwidth)}. Each setting decodes in a process of its own."
    return "\n".join([heading, "", *table(columns, rows)])


def cold_markdown(rows: list[dict]) -> str:
    """Per setting, a first process (empty store of compiled steps) and a second one: seconds from the process's
    start to its weights loaded, its first and its last new token, the longest wait between two tokens; hf_tfm's
    compile beside the first; the same call warm."""
    new = next((r["new"] for r in rows), 0)

    def seconds(key: str) -> Callable[[dict], str]:
        return lambda r: "" if r.get(key) is None else f"{r[key]:.2f}"

    columns = [text("size"), text("setting")]
    for process in ("first", "second"):
        columns += [
            Column(f"{process}: loaded s", seconds(f"{process}_load_s")),
            Column(f"{process}: first token s", seconds(f"{process}_first_token_s")),
            Column(f"{process}: {new} tokens s", seconds(f"{process}_total_s")),
            Column(f"{process}: longest wait s", seconds(f"{process}_longest_gap_s")),
        ]
    columns += [
        Column("compile s (beside the first)", seconds("compile_s")),
        Column("warm call s", seconds("second_warm_s")),
    ]
    heading = (
        f"A new process's first generate() of {new} tokens, batch 1, timed from the process's start (its imports "
        "included): the first process with no compiled step stored, the second with the one the first compiled."
    )
    return "\n".join([heading, "", *table(columns, rows)])


# ---------------------------------------------------------------------------------------------------------------------
# Speculative decoding: plain, prompt-lookup and assisted generate() of one model


def speculative_markdown(rows: list[dict]) -> str:
    """Per setting: ms per new token of plain greedy decoding, and of each speculative call with its speed-up over
    plain and the tokens each target pass yielded."""
    calls = {
        "lookup_copied": "prompt lookup, copied text",
        "lookup_new": "prompt lookup, new text",
        "assisted": "assisted",
    }
    columns = [
        text("size"),
        text("setting"),
        Column("draft layers", lambda r: str(r["draft_layers"])),
        Column("plain ms/token", lambda r: ms(r["plain_token_s"])),
    ]
    for name, title in calls.items():
        columns += [
            Column(f"{title} ms/token", lambda r, name=name: ms(r[f"{name}_token_s"])),
            Column("speed-up", lambda r, name=name: f"**{r[f'{name}_speedup']:.2f}x**"),
            Column("tokens/pass", lambda r, name=name: f"{r[f'{name}_tokens_per_pass']:.1f}"),
        ]
    k = next((r["k"] for r in rows), 0)
    heading = (
        f"Greedy generate() through load_for_inference, batch 1, {k} tokens proposed a round; times of the whole "
        "call over its new tokens; every output equal to greedy decoding's."
    )
    return "\n".join([heading, "", *table(columns, rows)])
