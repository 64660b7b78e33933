#!/usr/bin/env python
"""Draw the transformer block of hf_tfm and where each family of `TfmConfig` knobs acts (docs/img/block.svg, .png).

Matplotlib only (no graphviz). The drawing is laid out in inches, top to bottom: embeddings, the repeated block
(pre-norm as drawn, with its residual connections), the final norm and the heads. Beside each box, in monospace, the
knobs that act there, coloured by family. Every knob named is checked against `TfmConfig` / `TfmSeq2SeqConfig`.

Usage: ``python scripts/diagram.py`` (or ``--out DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Patch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_tfm.configuration import EXPERT_KNOBS, TfmConfig, TfmSeq2SeqConfig

FAMILIES = {  # family: (colour, legend label)
    "sizes": ("#4b5563", "sizes"),
    "embed": ("#2563eb", "embeddings and positions"),
    "norm": ("#059669", "normalisation"),
    "attn": ("#ea580c", "attention"),
    "ffn": ("#7c3aed", "feed-forward"),
    "moe": ("#db2777", "mixture of experts"),
    "resid": ("#a16207", "residual layout"),
    "heads": ("#0e7490", "heads and tying"),
}
INK, ARROW = "#111827", "#374151"
WIDTH = 11.5  # inches; the drawing's coordinates are inches, y going down from 0
MAIN_X, BOX_W = 4.0, 2.5  # centre and width of the main column
RES_X = MAIN_X + BOX_W / 2 + 0.25  # residual connections run down here, between the boxes and their knobs
KNOB_X = RES_X + 0.25  # knob labels start here
ROW_H = 0.29  # one row of knob labels
GAP = 0.32  # the arrow between stages
MONO, SANS = {"family": "monospace", "fontsize": 9}, {"family": "sans-serif", "fontsize": 10.5}


def tint(colour: str, amount: float) -> tuple[float, float, float]:
    """`colour` mixed with white: amount 0 is white, 1 the colour."""
    return tuple(1 - amount * (1 - c) for c in to_rgb(colour))


def knob_names(item: str) -> list[str]:
    """The knob an item of a knob row names ("knob", "knob=a|b", "knob (note)"); a "(note)" names none."""
    return [] if item.startswith("(") else [item.split("=")[0].split(" ")[0]]


class Drawing:
    def __init__(self) -> None:
        self.fig = Figure(figsize=(WIDTH, 10))
        FigureCanvasAgg(self.fig)
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_axis_off()
        self.knobs: set[str] = set()

    # --- primitives, in inches
    def box(self, x, y, w, h, title: str, family: str, dashed=False, sub=None, size=10.5, sub_size=8.5) -> None:
        """A rounded box with its top-left corner at (x, y), its title centred (and a smaller line under it)."""
        colour = FAMILIES[family][0]
        patch = FancyBboxPatch(
            (x, y - h),
            w,
            h,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=tint(colour, 0.1),
            edgecolor=colour,
            linewidth=1.6,
            linestyle=(0, (4, 2)) if dashed else "-",
            zorder=2,
        )
        self.ax.add_patch(patch)
        if sub is None:
            self.text(x + w / 2, y - h / 2, title, ha="center", va="center", fontweight="bold", fontsize=size)
        else:
            self.text(x + w / 2, y - h / 2 + 0.09, title, ha="center", va="center", fontweight="bold", fontsize=size)
            self.text(x + w / 2, y - h / 2 - 0.13, sub, ha="center", va="center", fontsize=sub_size, color="#374151")

    def text(self, x: float, y: float, s: str, **kwargs) -> None:
        self.ax.text(x, y, s, **({"color": INK, **SANS} | kwargs))

    def knob_rows(self, x: float, y_centre: float, rows: list[tuple[str, list[str]]]) -> None:
        """Rows of knob labels (one family each) stacked around `y_centre`, left-aligned at `x`."""
        y = y_centre + (len(rows) - 1) * ROW_H / 2
        for family, items in rows:
            self.pill(x, y, "  ".join(items), family, va="center")
            for item in items:
                self.knobs.update(knob_names(item))
            y -= ROW_H

    def pill(self, x: float, y: float, s: str, family: str, **kwargs) -> None:
        colour = FAMILIES[family][0]
        bbox = {"boxstyle": "round,pad=0.25,rounding_size=0.3", "facecolor": tint(colour, 0.14), "edgecolor": colour}
        self.ax.text(x, y, s, color=INK, bbox={**bbox, "linewidth": 0.9}, zorder=4, **(MONO | kwargs))

    def arrow(self, p0, p1, dashed=False) -> None:
        dash = (0, (4, 2)) if dashed else "-"
        style = {"arrowstyle": "-|>", "mutation_scale": 12, "color": ARROW, "linewidth": 1.3, "linestyle": dash}
        self.ax.add_patch(FancyArrowPatch(p0, p1, shrinkA=0, shrinkB=0, zorder=1, **style))

    def line(self, xs, ys, **kwargs) -> None:
        self.ax.plot(xs, ys, **({"color": ARROW, "linewidth": 1.3, "zorder": 1, "solid_capstyle": "butt"} | kwargs))

    def plus(self, x: float, y: float, r: float = 0.13) -> None:
        self.ax.add_patch(Circle((x, y), r, facecolor="white", edgecolor=ARROW, linewidth=1.3, zorder=2))
        self.line([x - r * 0.6, x + r * 0.6], [y, y], zorder=3)
        self.line([x, x], [y - r * 0.6, y + r * 0.6], zorder=3)

    # --- parts
    def stage(self, y: float, h: float, title: str, family: str, rows, dashed=False, sub=None) -> float:
        """A main-column box whose top is `y`, its knobs beside it; returns its bottom."""
        self.box(MAIN_X - BOX_W / 2, y, BOX_W, h, title, family, dashed, sub)
        self.knob_rows(KNOB_X, y - h / 2, rows)
        return y - h

    def residual(self, y_from: float, y_plus: float) -> None:
        """A residual connection: branch at `y_from` on the main path, rejoin at the + at `y_plus`."""
        self.ax.add_patch(Circle((MAIN_X, y_from), 0.045, color=ARROW, zorder=3))
        self.line([MAIN_X, RES_X, RES_X], [y_from, y_from, y_plus])
        self.arrow((RES_X, y_plus), (MAIN_X + 0.13, y_plus))
        self.plus(MAIN_X, y_plus)


def draw() -> tuple[Figure, set[str]]:
    """The figure and the knob names it labels."""
    d = Drawing()
    title_and_legend(d)
    emb_top, y = embeddings(d, -1.55)
    block_top, y_plus = self_attention(d, y)
    y_plus = cross_attention(d, y_plus)
    ffn_top, y_plus = feed_forward(d, y_plus)
    block_bottom = y_plus - 0.3
    block_frame(d, block_top, block_bottom)
    parallel(d, 0.6, ffn_top - 0.1)  # the parallel_residual form, inside the frame beside the block
    y = final_norm(d, y_plus, block_bottom)
    bottom = heads(d, y, emb_top)
    d.fig.set_size_inches(WIDTH, -bottom)
    d.ax.set_xlim(0, WIDTH)
    d.ax.set_ylim(bottom, 0)
    return d.fig, d.knobs


def title_and_legend(d: Drawing) -> None:
    """The title, and under it the legend of the knob families' colours."""
    title = "hf_tfm: the transformer block, and where each TfmConfig knob acts"
    d.text(WIDTH / 2, -0.4, title, ha="center", va="center", fontsize=14, fontweight="bold")
    handles = [Patch(facecolor=tint(c, 0.14), edgecolor=c, label=label) for c, label in FAMILIES.values()]
    d.ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(WIDTH / 2, -0.65),
        bbox_transform=d.ax.transData,
        ncols=4,
        frameon=False,
        fontsize=9.5,
    )


def embeddings(d: Drawing, y: float) -> tuple[float, float]:
    """The inputs at `y`, the token embeddings, the positions and the optional embedding norm under them. Returns
    the top of the token embeddings' box (where the tied LM heads' line starts) and the bottom of the last box."""
    d.text(MAIN_X, y, "input_ids  (+ token_type_ids)", ha="center", va="center", family="monospace", fontsize=9.5)
    d.arrow((MAIN_X, y - 0.15), (MAIN_X, y - GAP - 0.05))
    y -= GAP + 0.05
    emb_top = y
    y = d.stage(
        y,
        0.8,
        "token embeddings",
        "embed",
        [
            ("sizes", ["vocab_size", "hidden_size"]),
            ("embed", ["embedding_scale (\N{MULTIPLICATION SIGN} the token vectors)"]),
            ("embed", ["type_vocab_size (> 0: + segment embeddings)"]),
        ],
        sub="\N{MULTIPLICATION SIGN} scale, + segments",
    )
    d.arrow((MAIN_X, y), (MAIN_X, y - GAP))
    y = d.stage(
        y - GAP,
        1.05,
        "+ positions",
        "embed",
        [
            ("embed", ["position_embedding_type=sinusoidal|learned: added here"]),
            ("embed", ["(rope|alibi: inside attention, below)"]),
            ("embed", ["max_position_embeddings", "position_offset"]),
            ("embed", ["sinusoidal_layout"]),
        ],
        sub="sinusoidal or learned",
    )
    d.arrow((MAIN_X, y), (MAIN_X, y - GAP))
    y = d.stage(
        y - GAP, 0.55, "embedding norm", "norm", [("norm", ["embedding_norm (BERT, ModernBERT)"])], dashed=True
    )
    return emb_top, y


def self_attention(d: Drawing, y: float) -> tuple[float, float]:
    """The block's first sub-layer under `y`: norm, self-attention and their residual connection. Returns the top of
    the block's frame and the y of the residual's +."""
    d.arrow((MAIN_X, y), (MAIN_X, y - GAP - 0.25))
    y -= GAP + 0.25
    block_top = y + 0.12
    y -= 0.2
    attn_in = y
    y = d.stage(
        y - 0.2,
        0.8,
        "norm",
        "norm",
        [
            ("norm", ["norm_type=layernorm|rmsnorm", "norm_eps", "norm_bias"]),
            ("norm", ["norm_position=pre (drawn)|post (after each +)"]),
            ("norm", ["first_layer_attn_norm"]),
        ],
    )
    d.line([MAIN_X, MAIN_X], [attn_in, attn_in - 0.2])
    d.arrow((MAIN_X, y), (MAIN_X, y - GAP))
    attn_top = y - GAP
    y = d.stage(
        attn_top,
        2.3,
        "self-attention",
        "attn",
        [
            ("attn", ["num_attention_heads", "head_dim"]),
            ("attn", ["num_key_value_heads (< heads: GQA, 1: MQA)"]),
            ("attn", ["qk_norm", "qk_norm_scope=head|projection"]),
            ("attn", ["attention_bias", "attention_out_bias"]),
            ("attn", ["is_causal", "attention_dropout"]),
            ("attn", ["sliding_window", "layer_types=full|sliding per layer"]),
            ("embed", ["position_embedding_type=rope (q, k)|alibi (scores)"]),
            ("embed", ["rope_parameters (theta, scaling)"]),
        ],
        sub="q, k, v -> scores -> o",
    )
    y_plus = y - GAP
    d.arrow((MAIN_X, y), (MAIN_X, y_plus + 0.13))
    d.residual(attn_in, y_plus)
    d.knob_rows(KNOB_X, y_plus, [("resid", ["hidden_dropout (on each branch)"])])
    return block_top, y_plus


def cross_attention(d: Drawing, y_plus: float) -> float:
    """A seq2seq decoder's cross-attention sub-layer (dashed: optional) after the + at `y_plus`, the encoder output
    coming in from the left, and its residual connection. Returns the y of its +."""
    y = y_plus - 0.13
    cross_in = y - 0.22
    d.line([MAIN_X, MAIN_X], [y, cross_in])
    cross_top = cross_in - GAP
    d.arrow((MAIN_X, cross_in), (MAIN_X, cross_top))
    y = d.stage(
        cross_top,
        0.8,
        "norm + cross-attention",
        "attn",
        [
            ("attn", ["add_cross_attention (the decoder of a TfmSeq2SeqConfig)"]),
            ("attn", ["(queries here; keys, values: the encoder output)"]),
        ],
        dashed=True,
        sub="over the encoder output",
    )
    enc_y = cross_top - 0.4
    d.text(0.7, enc_y + 0.2, "encoder output", fontsize=9.5, va="center")
    d.arrow((0.7, enc_y), (MAIN_X - BOX_W / 2, enc_y), dashed=True)
    y_plus = y - GAP
    d.arrow((MAIN_X, y), (MAIN_X, y_plus + 0.13))
    d.residual(cross_in, y_plus)
    return y_plus


def feed_forward(d: Drawing, y_plus: float) -> tuple[float, float]:
    """The feed-forward sub-layer after the + at `y_plus`: norm, then an MLP | GLU or the experts side by side, and
    its residual connection. Returns the top of the two boxes and the y of its +."""
    y = y_plus - 0.13
    ffn_in = y - 0.22
    d.line([MAIN_X, MAIN_X], [y, ffn_in])
    d.arrow((MAIN_X, ffn_in), (MAIN_X, ffn_in - GAP))
    y = d.stage(ffn_in - GAP, 0.55, "norm", "norm", [("norm", ["norm_type", "norm_position (as above)"])])
    ffn_top = y - GAP
    half = (BOX_W - 0.2) / 2
    d.arrow((MAIN_X, y), (MAIN_X - BOX_W / 4 - 0.05, ffn_top))
    d.arrow((MAIN_X, y), (MAIN_X + BOX_W / 4 + 0.05, ffn_top))
    ffn_h = 2.4
    d.box(MAIN_X - BOX_W / 2, ffn_top, half, ffn_h, "MLP | GLU", "ffn", sub="up, act, down")
    d.box(MAIN_X + 0.1, ffn_top, half, ffn_h, "experts", "moe", sub="router, top-k")
    d.text(MAIN_X, ffn_top - ffn_h / 2, "or", ha="center", va="center", fontsize=9, color="#374151")
    d.knob_rows(
        KNOB_X,
        ffn_top - ffn_h / 2,
        [
            ("ffn", ["ffn_type=mlp|glu", "hidden_act"]),
            ("ffn", ["intermediate_size", "mlp_bias"]),
            ("moe", ["num_experts (not None: experts)"]),
            ("moe", ["num_experts_per_tok (top-k)"]),
            ("moe", ["moe_intermediate_size", "shared_expert_intermediate_size"]),
            ("moe", ["norm_topk_prob", "router_weights_fp32", "router_jitter_noise"]),
            ("moe", ["decoder_sparse_step", "mlp_only_layers (which layers)"]),
            ("moe", ["router_aux_loss_coef", "output_router_logits"]),
        ],
    )
    y = ffn_top - ffn_h
    y_plus = y - GAP
    d.arrow((MAIN_X - BOX_W / 4 - 0.05, y), (MAIN_X - 0.1, y_plus + 0.1))
    d.arrow((MAIN_X + BOX_W / 4 + 0.05, y), (MAIN_X + 0.1, y_plus + 0.1))
    d.residual(ffn_in, y_plus)
    return ffn_top, y_plus


def block_frame(d: Drawing, block_top: float, block_bottom: float) -> None:
    """The frame around the repeated block, and its repeat count."""
    frame = FancyBboxPatch(
        (0.35, block_bottom),
        WIDTH - 0.7,
        block_top - block_bottom,
        boxstyle="round,pad=0,rounding_size=0.15",
        facecolor="#f9fafb",
        edgecolor="#9ca3af",
        linewidth=1.2,
        zorder=0,
    )
    d.ax.add_patch(frame)
    d.pill(0.5, block_top - 0.25, "\N{MULTIPLICATION SIGN} num_hidden_layers", "sizes", va="center", fontsize=9.5)
    d.knobs.add("num_hidden_layers")


def final_norm(d: Drawing, y_plus: float, block_bottom: float) -> float:
    """The final norm under the block, from the block's last + at `y_plus`; returns its bottom."""
    d.arrow((MAIN_X, y_plus - 0.13), (MAIN_X, block_bottom - GAP))
    rows = [("norm", ["final_norm (default: pre-norm only)"]), ("heads", ["add_pooling_layer (TfmModel's pooler)"])]
    return d.stage(block_bottom - GAP, 0.6, "final norm", "norm", rows)


def parallel(d: Drawing, x: float, y: float) -> None:
    """The `parallel_residual` form: both sub-layers read the same input, summed with it."""
    w, colour = 1.9, FAMILIES["resid"][0]
    frame = FancyBboxPatch(
        (x - 0.12, y - 2.6),
        w + 0.24,
        2.72,
        boxstyle="round,pad=0,rounding_size=0.1",
        facecolor="white",
        edgecolor=colour,
        linewidth=1,
        linestyle=(0, (4, 2)),
        zorder=0.5,
    )
    d.ax.add_patch(frame)
    d.pill(x, y, "parallel_residual=True", "resid", va="top")
    d.knobs.add("parallel_residual")
    top = y - 0.45
    formula = "x + attn(norm(x))\n  + ffn(norm(x))"
    d.text(x + 0.05, top, formula, va="top", fontsize=9, family="monospace", color=colour, linespacing=1.3)
    fork, bw = top - 0.7, 0.8
    d.ax.add_patch(Circle((x + w / 2, fork), 0.045, color=ARROW, zorder=3))
    sub_top, sub_h = fork - 0.3, 0.45
    for cx, title, family in ((x + w / 2 - 0.45, "norm\nattn", "attn"), (x + w / 2 + 0.45, "norm\nFFN", "ffn")):
        d.arrow((x + w / 2, fork), (cx, sub_top))
        d.box(cx - bw / 2 + 0.06, sub_top, bw - 0.12, sub_h, "", family)
        d.text(cx, sub_top - sub_h / 2, title, ha="center", va="center", fontsize=9, linespacing=1.1)
    plus_y = sub_top - sub_h - 0.35
    for cx in (x + w / 2 - 0.45, x + w / 2 + 0.45):
        d.arrow((cx, sub_top - sub_h), (x + w / 2 + (0.08 if cx > x + w / 2 else -0.08), plus_y + 0.1))
    d.arrow((x + w / 2, fork), (x + w / 2, plus_y + 0.13))
    d.plus(x + w / 2, plus_y)


HEADS = [  # title, class, knobs
    ("causal LM", "TfmForCausalLM", ["tie_word_embeddings", "lm_head_bias"]),
    (
        "sequence cls.",
        "TfmForSequenceClassification",
        [
            "classifier_pooling",
            "classifier_dense",
            "classifier_activation",
            "classifier_norm",
            "classifier_dropout",
            "classifier_bias",
        ],
    ),
    ("token cls.", "TfmForTokenClassification", ["classifier_dropout", "classifier_bias"]),
    ("masked LM", "TfmForMaskedLM", ["tie_word_embeddings", "mlm_head_activation", "head_dense_bias"]),
    ("question answering", "TfmForQuestionAnswering", []),
    (
        "seq2seq LM",
        "TfmForConditionalGeneration",
        ["encoder", "decoder", "share_encoder_decoder_embeddings", "tie_word_embeddings"],
    ),
]


def heads(d: Drawing, y: float, emb_top: float) -> float:
    """The heads on the backbone, side by side, their knobs under them; the tied embeddings. Returns the bottom."""
    n, margin, gap = len(HEADS), 0.35, 0.12
    w = (WIDTH - 2 * margin - (n - 1) * gap) / n
    bus = y - 0.3
    d.line([MAIN_X, MAIN_X], [y, bus])
    xs = [margin + i * (w + gap) + w / 2 for i in range(n)]
    d.line([xs[0], xs[-1]], [bus, bus])
    top, h = bus - 0.3, 0.6
    for cx, (title, cls, knobs) in zip(xs, HEADS, strict=True):
        d.arrow((cx, bus), (cx, top))
        d.box(cx - w / 2, top, w, h, title, "heads", sub=cls, size=9.5, sub_size=7.5)
        if knobs:  # the last list lines up with its box's right edge: the one before has none
            last = cx == xs[-1]
            x = cx + w / 2 - 0.03 if last else cx - w / 2 + 0.03
            lines = "\n".join(knobs)
            align = {"ha": "right" if last else "left", "multialignment": "left"}
            d.pill(x, top - h - 0.2, lines, "heads", va="top", linespacing=1.35, fontsize=8.5, **align)
        for knob in knobs:
            d.knobs.update(knob_names(knob))
    # the LM heads' projection shares the token table: a dashed line from the embeddings to the causal LM head
    left = 0.15
    d.line([MAIN_X - BOX_W / 2, left, left], [emb_top - 0.4, emb_top - 0.4, top - h / 2], linestyle=(0, (4, 2)))
    d.arrow((left, top - h / 2), (margin, top - h / 2), dashed=True)
    d.text(
        left + 0.05,
        (emb_top + top) / 2,
        "tie_word_embeddings: the LM heads' output layer is the token table",
        rotation=90,
        va="center",
        fontsize=8,
        family="monospace",
        color=FAMILIES["heads"][0],
    )
    return top - h - 0.2 - max(len(knobs) for *_, knobs in HEADS) * 0.165 - 0.3


def check_knobs(knobs: set[str]) -> None:
    """Every label names a real knob."""
    real = {f.name for f in dataclasses.fields(TfmConfig)} | {f.name for f in dataclasses.fields(TfmSeq2SeqConfig)}
    real |= set(EXPERT_KNOBS)  # set on a config with experts only
    if unknown := sorted(knobs - real):
        raise SystemExit(f"labels name knobs TfmConfig does not have: {unknown}")


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img"), help="output folder")
    args = p.parse_args(argv)
    fig, knobs = draw()
    check_knobs(knobs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "block.svg", out / "block.png"]
    with matplotlib.rc_context({"svg.hashsalt": "hf_tfm"}):  # the same SVG from the same drawing
        for path in paths:
            fig.savefig(path, dpi=150, metadata={"Date": None} if path.suffix == ".svg" else None)
    return paths


if __name__ == "__main__":
    for written in main():
        print(written)
