"""Sphinx directives that render the ResNet benchmark CSVs as a table and as a chart.

The benchmark page shows the figures of examples/benchmark/resnet_benchmark.csv (written by
resnet_benchmark.py) beside the source figures of examples/benchmark/source_figures.csv,
averaged over the nine models as the source page did. Both directives read the files at build
time, so the page can never disagree with the committed output:

    :::{benchmark-table}
    :measured: ../../examples/benchmark/resnet_benchmark.csv
    :reference: ../../examples/benchmark/source_figures.csv
    :::

    :::{benchmark-chart}
    :measured: ...
    :reference: ...
    :mode: train
    :::

Labels (column headings, modes) are created with a source line, so Sphinx extracts them into
the page's catalog and translates them. Figures are data, written in the page's language's
number format ("5 181" in French); device names are data too, except the CPU's core count
("AMD EPYC (2 cores)"), whose words are an interface string of sphinx.po. The chart is an image
with a translated text alternative, drawn wide enough for its text to stay legible on a phone
(it scrolls sideways there, like the table).
"""

import csv
import html
import math
import re
import statistics
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.locale import _
from sphinx.util.docutils import SphinxDirective

MODELS = [
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2",
]  # fmt: skip
PRECISIONS = ["double", "float", "half", "bfloat16"]
COLOURS = {"double": "#4e79a7", "float": "#f28e2b", "half": "#e15759", "bfloat16": "#59a14f"}
MODES = {"train": "training", "inference": "inference"}


# Digit grouping per language: French groups with a narrow no-break space, as its typography does.
GROUPING = {"fr": "\u202f"}


class BenchmarkError(Exception):
    pass


def number(value, language):
    """A whole number with the language's digit grouping: 5,181 or 5 181."""
    return f"{value:,.0f}".replace(",", GROUPING.get(language, ","))


def device_label(name):
    """The device name of a CSV row, with the words around a CPU's core count translated."""
    match = re.fullmatch(r"(.*) \((\d+) cores\)", name)
    if match:
        return _("{cpu} ({cores} cores)").format(cpu=match.group(1), cores=match.group(2))
    return name


def read_rows(path):
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def summarise(measured, reference, batch_size, image_size):
    """Rows of (device, torch, origin, mode, {precision: ms per batch}), reference first.

    Measured figures are the mean over the nine models of each model's median, for runs with
    the source's batch and image size; a run that lacks a model is an error, not a smaller mean.
    """
    summary = []
    for row in reference:
        key = (row["device_name"], row["torch"], "reference", row["mode"])
        if not summary or summary[-1][:4] != key:
            summary.append((*key, {}))
        summary[-1][4][row["precision"]] = float(row["ms_per_batch"])
    groups = {}
    for row in measured:
        if int(row["batch_size"]) != batch_size or int(row["image_size"]) != image_size:
            continue
        key = (row["device_name"], row["torch"], "measured", row["mode"])
        groups.setdefault(key, {}).setdefault(row["precision"], {})[row["model"]] = float(
            row["median_ms"]
        )
    for key, by_precision in groups.items():
        figures = {}
        for precision, by_model in by_precision.items():
            missing = [model for model in MODELS if model not in by_model]
            if missing:
                raise BenchmarkError(
                    f"{key[0]} {key[3]} {precision}: no figures for {', '.join(missing)}"
                )
            figures[precision] = statistics.fmean(by_model[model] for model in MODELS)
        summary.append((*key, figures))
    return summary


class BenchmarkDirective(SphinxDirective):
    has_content = False
    option_spec = {
        "measured": directives.unchanged_required,
        "reference": directives.unchanged_required,
        "batch-size": directives.positive_int,
        "image-size": directives.positive_int,
        "mode": lambda arg: directives.choice(arg, list(MODES)),
    }

    def load(self):
        paths = {}
        for option in ("measured", "reference"):
            if option not in self.options:
                raise self.error(f"{self.name}: the :{option}: option is required")
            _, absolute = self.env.relfn2path(self.options[option], self.env.docname)
            paths[option] = Path(absolute)
            self.env.note_dependency(absolute)
        try:
            return summarise(
                read_rows(paths["measured"]),
                read_rows(paths["reference"]),
                self.options.get("batch-size", 12),
                self.options.get("image-size", 224),
            )
        except (OSError, KeyError, ValueError, BenchmarkError) as error:
            raise self.error(f"{self.name}: {error}") from error

    def label(self, text):
        """A paragraph the i18n machinery extracts and translates."""
        paragraph = nodes.paragraph(text, text)
        paragraph.source, paragraph.line = self.get_source_info()
        return paragraph


class BenchmarkTable(BenchmarkDirective):
    def run(self):
        summary = self.load()
        headings = [self.label(text) for text in ("Device", "PyTorch", "Figures", "Mode")]
        headings += [nodes.paragraph("", "", nodes.literal(p, p)) for p in PRECISIONS]
        table = nodes.table(classes=["benchmark-table"])
        group = nodes.tgroup(cols=len(headings))
        table += group
        group.extend(nodes.colspec(colwidth=1) for _ in headings)
        head, body = nodes.thead(), nodes.tbody()
        group += [head, body]
        head += nodes.row("", *(nodes.entry("", cell) for cell in headings))
        language = self.config.language
        for device, torch, origin, mode, figures in summary:
            cells = [
                nodes.paragraph("", device_label(device)),
                nodes.paragraph("", torch),
                self.label("source page" if origin == "reference" else "measured"),
                self.label(MODES[mode]),
            ]
            cells += [
                nodes.paragraph("", number(figures[p], language) if p in figures else "–")
                for p in PRECISIONS
            ]
            body += nodes.row("", *(nodes.entry("", cell) for cell in cells))
        return [table]


class BenchmarkChart(BenchmarkDirective):
    def run(self):
        mode = self.options.get("mode", "train")
        summary = [row for row in self.load() if row[3] == mode]
        title = {
            "train": _("Training: milliseconds per batch, mean of the nine models, log scale"),
            "inference": _("Inference: milliseconds per batch, mean of the nine models, log scale"),
        }[mode]
        chart = svg_chart(summary, self.config.language, title)
        # A region that scrolls sideways on a phone: keyboard users reach it too (tabindex).
        return [
            nodes.raw(
                "",
                f'<div class="benchmark-chart-scroll" tabindex="0" role="region" '
                f'aria-label="{html.escape(title)}">{chart}</div>',
                format="html",
            )
        ]


def svg_chart(summary, language="en", title=""):
    """Horizontal bars, one group per device, one bar per precision, on a log scale whose
    first decade lies below the smallest value (so no bar is drawn zero wide)."""
    values = [v for *_, figures in summary for v in figures.values()]
    if not values:
        return ""
    low = 10 ** (math.ceil(math.log10(min(values))) - 1)
    high = 10 ** math.ceil(math.log10(max(values)))
    label_w, plot_w, bar_h, gap, top = 250, 420, 11, 14, 34
    width = label_w + plot_w + 70

    def x(value):
        return label_w + plot_w * math.log10(value / low) / math.log10(high / low)

    parts = []
    y = top
    for device, torch, _origin, _mode, figures in summary:
        group_h = bar_h * len(PRECISIONS)
        parts.append(
            f'<text x="{label_w - 8}" y="{y + group_h / 2 - 2}" text-anchor="end">'
            f"{html.escape(device_label(device))}</text>"
            f'<text x="{label_w - 8}" y="{y + group_h / 2 + 12}" text-anchor="end" '
            f'class="minor">PyTorch {html.escape(torch)}</text>'
        )
        for index, precision in enumerate(PRECISIONS):
            if precision in figures:
                value, bar_y = figures[precision], y + index * bar_h
                parts.append(
                    f'<rect x="{label_w}" y="{bar_y}" width="{x(value) - label_w:.1f}" '
                    f'height="{bar_h - 2}" fill="{COLOURS[precision]}"/>'
                    f'<text x="{x(value) + 4:.1f}" y="{bar_y + bar_h - 3}" class="minor">'
                    f"{number(value, language)}</text>"
                )
        y += group_h + gap
    height = y + 14
    decade = low
    while decade <= high:
        parts.append(
            f'<line x1="{x(decade):.1f}" x2="{x(decade):.1f}" y1="{top - 6}" y2="{y - gap + 4}" '
            f'class="grid"/><text x="{x(decade):.1f}" y="{y + 6}" text-anchor="middle" '
            f'class="minor">{number(decade, language)}</text>'
        )
        decade *= 10
    for index, precision in enumerate(PRECISIONS):
        parts.append(
            f'<rect x="{label_w + index * 95}" y="6" width="12" height="12" '
            f'fill="{COLOURS[precision]}"/><text x="{label_w + index * 95 + 16}" y="16">'
            f"{precision}</text>"
        )
    return (
        f'<svg class="benchmark-chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">'
        f"<title>{html.escape(title)}</title>"
        "<style>text{font:13px sans-serif;fill:currentColor}.minor{font-size:11px}"
        ".grid{stroke:currentColor;stroke-opacity:.2}</style>"
        f"{''.join(parts)}</svg>"
    )


def setup(app):
    app.add_directive("benchmark-table", BenchmarkTable)
    app.add_directive("benchmark-chart", BenchmarkChart)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
