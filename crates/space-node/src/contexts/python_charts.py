# What a matplotlib figure draws, as data: `chart_of(figure)` gives the
# `e2b/chart` result E2B's code interpreter answers (its SDK reads it into
# `result.chart`): a line, scatter, bar, pie or box-and-whisker chart of
# one Axes, a `superchart` of several, `unknown` for anything else (with
# its title). The Python driver runs this file before its own code.
import re

UNIT = re.compile(r"[(\[]([^()\[\]]+)[)\]]\s*$")


def plain(value):
    """A numpy scalar as Python's own number."""
    return value.item() if hasattr(value, "item") else value


def axis_kind(axis):
    """`datetime`, `categorical`, or the axis's scale (`linear`, `log`, ...)."""
    import matplotlib.category
    import matplotlib.dates

    get = getattr(axis, "get_converter", None)
    converter = get() if get is not None else getattr(axis, "converter", None)
    if isinstance(converter, matplotlib.dates.DateConverter) or isinstance(
        axis.get_major_formatter(), (matplotlib.dates.AutoDateFormatter, matplotlib.dates.ConciseDateFormatter,
                                     matplotlib.dates.DateFormatter)):
        return "datetime"
    if isinstance(converter, matplotlib.category.StrCategoryConverter):
        return "categorical"
    return axis.get_scale()


def value_on(axis, kind, number):
    """A data coordinate as the axis shows it: a date as ISO text, a
    category as its name."""
    import matplotlib.dates

    number = plain(number)
    if kind == "datetime":
        return matplotlib.dates.num2date(number).isoformat()
    if kind == "categorical":
        names = {index: name for name, index in getattr(axis.units, "_mapping", {}).items()}
        return str(names.get(round(number), number))
    return float(number)


def label_and_unit(text):
    if not text:
        return None, None
    unit = UNIT.search(text)
    return text, unit.group(1).strip() if unit else None


def two_d(ax, kind):
    x_label, x_unit = label_and_unit(ax.get_xlabel())
    y_label, y_unit = label_and_unit(ax.get_ylabel())
    return {"type": kind, "title": ax.get_title() or None, "x_label": x_label, "y_label": y_label,
            "x_unit": x_unit, "y_unit": y_unit}


def ticks(axis, kind):
    locations = [plain(t) for t in axis.get_majorticklocs()]
    try:
        labels = [str(t) for t in axis.get_major_formatter().format_ticks(locations)]
    except Exception:  # noqa: BLE001
        labels = [str(t) for t in locations]
    values = [value_on(axis, "datetime", t) if kind == "datetime" else float(t) for t in locations]
    return values, labels


def series_label(artist):
    label = artist.get_label()
    return label if label and not label.startswith("_") else None


def point_chart(ax, kind, series):
    x_kind, y_kind = axis_kind(ax.xaxis), axis_kind(ax.yaxis)
    chart = two_d(ax, kind)
    chart["x_scale"], chart["y_scale"] = x_kind, y_kind
    chart["x_ticks"], chart["x_tick_labels"] = ticks(ax.xaxis, x_kind)
    chart["y_ticks"], chart["y_tick_labels"] = ticks(ax.yaxis, y_kind)
    chart["elements"] = [
        {"label": series_label(artist),
         "points": [[value_on(ax.xaxis, x_kind, x), value_on(ax.yaxis, y_kind, y)] for x, y in points]}
        for artist, points in series
    ]
    return chart


def axes_chart(ax):
    import matplotlib.container
    import matplotlib.patches

    wedges = [p for p in ax.patches if isinstance(p, matplotlib.patches.Wedge)]
    if wedges:
        return {"type": "pie", "title": ax.get_title() or None, "elements": [
            {"label": w.get_label(), "angle": round(abs(plain(w.theta2) - plain(w.theta1)), 4),
             "radius": plain(w.r)} for w in wedges]}
    boxes = getattr(ax, "_space_boxes", None)
    if boxes:
        chart = two_d(ax, "box_and_whisker")
        chart["elements"] = [
            {"label": str(box.get("label", n + 1)), "min": plain(box["whislo"]), "first_quartile": plain(box["q1"]),
             "median": plain(box["med"]), "third_quartile": plain(box["q3"]), "max": plain(box["whishi"]),
             "outliers": [plain(v) for v in box.get("fliers", [])]}
            for n, box in enumerate(boxes)
        ]
        return chart
    bars = [c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)]
    if bars:
        chart = two_d(ax, "bar")
        elements = []
        for container in bars:
            horizontal = getattr(container, "orientation", "vertical") == "horizontal"
            axis = ax.yaxis if horizontal else ax.xaxis
            formatter = axis.get_major_formatter()
            for rect in container.patches:
                at = rect.get_y() + rect.get_height() / 2 if horizontal else rect.get_x() + rect.get_width() / 2
                try:
                    label = str(formatter.format_ticks([at])[0])
                except Exception:  # noqa: BLE001
                    label = str(at)
                elements.append({"label": label, "group": series_label(container),
                                 "value": plain(rect.get_width() if horizontal else rect.get_height())})
        chart["elements"] = elements
        return chart
    lines = [line for line in ax.get_lines() if line.get_visible() and len(line.get_xydata())]
    if lines:
        return point_chart(ax, "line", [(line, line.get_xydata()) for line in lines])
    import matplotlib.collections

    dots = [c for c in ax.collections
            if isinstance(c, matplotlib.collections.PathCollection) and len(c.get_offsets())]
    if dots:
        return point_chart(ax, "scatter", [(c, c.get_offsets()) for c in dots])
    return {"type": "unknown", "title": ax.get_title() or None, "elements": []}


def chart_of(figure):
    axes = [ax for ax in figure.axes if ax.get_visible()]
    suptitle = getattr(figure, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None and suptitle.get_text() else None
    if not axes:
        return {}
    if len(axes) == 1:
        chart = axes_chart(axes[0])
        if chart.get("title") is None:
            chart["title"] = title
        return chart
    return {"type": "superchart", "title": title, "elements": [axes_chart(ax) for ax in axes]}


def keep_box_stats(module):
    """`Axes.bxp` draws what `boxplot` computed: the Axes keeps the
    statistics for `chart_of`."""
    drawn = module.Axes.bxp

    def bxp(self, bxpstats, *args, **kwargs):
        stats = list(bxpstats)
        self._space_boxes = getattr(self, "_space_boxes", []) + [dict(s) for s in stats]
        return drawn(self, stats, *args, **kwargs)

    module.Axes.bxp = bxp
