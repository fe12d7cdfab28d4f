"""Inline SVG charts for the run report (page.py, compare.py): line charts, stacked bars, the
before/after tool-share bars, and the HTML figure around each (title, legend, one line
of explanation).

Hand-written SVG instead of a plotting library: the report must stay one self-contained
file with no dependency and nothing fetched. What it simplifies: no zoom, no
interaction beyond a <title> tooltip per point or bar, fixed sizes that the page's CSS
scales. Every text that reaches the markup goes through `esc` (html.escape); callers
pass plain text, never HTML, except `explain`, which is the report's own HTML.
"""

import html
import math


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def num(v) -> float | None:
    """A finite float, or None (missing, not a number, NaN, inf)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def pct(v) -> str:
    v = num(v)
    return "—" if v is None else f"{100 * v:.1f}%"


def light(color: str) -> bool:
    """Is this #rrggbb colour light enough that text on it should be dark?"""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b > 150


# Inline SVG charts. Axis ranges get "nice" round ticks; titles and legends live in the
# HTML around the SVG, so nothing inside the plot can overlap them.

W, H = 460, 230
ML, MR, MT, MB = 64, 14, 12, 40  # margins: left (tick labels + y label), right, top, bottom


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> tuple[float, float, list[float]]:
    """Round bounds that contain [lo, hi] and about n evenly spaced ticks between them."""
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or (1.0 if integer else 0.1)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (m * mag) <= n)
    if integer:
        step = max(1.0, round(step))
    start, end = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks = [start + i * step for i in range(int(round((end - start) / step)) + 1)]
    return start, end, ticks


def tick_exponent(ticks: list[float]) -> int:
    """e such that the ticks read best as multiples of 10^e (0 for ordinary ranges)."""
    top = max(abs(t) for t in ticks)
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else top
    if top == 0 or (step >= 1e-3 and top < 1e5):
        return 0
    return math.floor(math.log10(top))


def tick_label(v: float, ticks: list[float]) -> str:
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    if abs(v) < step * 1e-6:
        return "0"
    decimals = next((d for d in range(7) if abs(round(step, d) - step) < step * 1e-6), 6)
    return f"{v:,.{decimals}f}"


def _axes(x0, x1, xt, y0, y1, yt, x_label, y_label, y_fmt=None):
    """The plot's frame, grid, ticks and axis labels, and the two maps from data to SVG
    coordinates: (parts, sx, sy)."""
    pw, ph = W - ML - MR, H - MT - MB
    sx = lambda x: ML + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: MT + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    out = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" class="plot"/>']
    e = 0 if y_fmt else tick_exponent(yt)  # tiny or huge values: ticks in units of 10^e
    scaled = [t / 10 ** e for t in yt]
    for t, st in zip(yt, scaled):
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>')
        label = y_fmt(t) if y_fmt else tick_label(st, scaled)
        out.append(f'<text x="{ML - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{esc(label)}</text>')
    for t in xt:
        if x0 - 1e-9 <= t <= x1 + 1e-9:
            out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" class="axis"/>')
            out.append(f'<text x="{sx(t):.1f}" y="{MT + ph + 16}" class="tick" text-anchor="middle">'
                       f'{esc(tick_label(t, xt))}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 6}" class="alabel" text-anchor="middle">{esc(x_label)}</text>')
    unit = f' (×10<tspan dy="-5" font-size="9">{e}</tspan><tspan dy="5"> </tspan>)' if e else ""
    out.append(f'<text transform="translate(13 {MT + ph / 2}) rotate(-90)" class="alabel" '
               f'text-anchor="middle">{esc(y_label)}{unit}</text>')
    return out, sx, sy


def _scales(xs, ys, y_min, y_max, zero, x_range=None, y_cap=None):
    x0, x1 = min(xs), max(xs)
    if x_range is not None:  # small multiples share one x-range, whatever each one's data covers
        x0, x1 = min(x0, x_range[0]), max(x1, x_range[1])
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    _, _, xt = nice_ticks(x0, x1, n=6, integer=True)
    lo, hi = min(ys), max(ys)
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if lo == hi == 0.0:
            hi = 1.0  # all zero: draw the line on a 0..1 axis, not around it
    if y_min is not None and y_max is not None:
        y0, y1 = y_min, y_max
        _, _, yt = nice_ticks(y0, y1)
    else:
        y0, y1, yt = nice_ticks(lo, hi)
        if y_cap is not None and y1 > y_cap:  # a rate: never an axis beyond 100%
            y0, y1, yt = nice_ticks(y0, y_cap)
    return x0, x1, xt, y0, y1, yt


SMOOTH_FROM = 30  # longer series: a faint raw line under a moving average, no dots


def smooth_window(n: int) -> int:
    """Width of the centred moving average drawn over a series of n steps (odd)."""
    return max(3, n // 15) | 1


def moving_average(ys: list, w: int) -> list:
    """Centred moving average over the values present in each window (None stays None)."""
    out = []
    for i, y in enumerate(ys):
        window = [v for v in ys[max(0, i - w // 2):i + w // 2 + 1] if v is not None]
        out.append(None if y is None else sum(window) / len(window))
    return out


def _polylines(data: list, sx, sy, attrs: str) -> list[str]:
    """One <polyline> per run of present values (None breaks the line)."""
    out, segment = [], []
    for x, y in data + [(None, None)]:
        if y is None:
            if len(segment) > 1:
                out.append(f'<polyline points="{" ".join(segment)}" fill="none" {attrs}/>')
            segment = []
        else:
            segment.append(f"{sx(x):.1f},{sy(y):.1f}")
    return out


def line_chart(series: list[dict], y_label: str, x_label: str = "step", y_min=None, y_max=None,
               zero: bool = False, y_fmt=None, x_range=None, y_cap=None) -> str | None:
    """series: [{name, xs, ys, color, dash?, points?}]; None values break a line. None if no data.
    points: markers only (held-out evaluations); dash: True or an SVG dash pattern. Over
    SMOOTH_FROM values, a line is drawn faint with its moving average on top.
    y_min/y_max fix the y-axis; otherwise it fits the data (with 0 in view if `zero`), at
    most up to y_cap. x_range: the x-axis covers at least this (lo, hi)."""
    pts = [(x, y) for s in series for x, y in zip(s["xs"], s["ys"]) if y is not None]
    if not pts:
        return None
    x0, x1, xt, y0, y1, yt = _scales([p[0] for p in pts], [p[1] for p in pts], y_min, y_max, zero, x_range,
                                     y_cap)
    out, sx, sy_axis = _axes(x0, x1, xt, y0, y1, yt, x_label, y_label, y_fmt)
    sy = lambda y: sy_axis(min(max(y, y0), y1))  # noqa: E731  (a value off a fixed axis sits on its edge)
    for s in series:
        color, name = esc(s["color"]), s["name"]
        data = list(zip(s["xs"], s["ys"]))
        present = [(x, y) for x, y in data if y is not None]
        pattern = s.get("dash")
        dash = f' stroke-dasharray="{esc("6 4" if pattern is True else pattern)}"' if pattern else ""
        points = s.get("points")
        if not points and len(present) > SMOOTH_FROM:
            out += _polylines(data, sx, sy, f'stroke="{color}" stroke-width="1" stroke-opacity="0.35"')
            smooth = moving_average(list(s["ys"]), smooth_window(len(present)))
            out += _polylines(list(zip(s["xs"], smooth)), sx, sy, f'stroke="{color}" stroke-width="2.2"{dash}')
        elif not points:
            out += _polylines(data, sx, sy, f'stroke="{color}" stroke-width="2"{dash}')
        if points or len(present) <= SMOOTH_FROM:  # dots with a hover tooltip
            r = 4.5 if points else (2.5 if len(present) > 1 else 3.5)
            for x, y in present:
                tip = f"{name}, {x_label} {x:g}: {y:.4g}"
                fill = "#fff" if points else color
                out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{r}" fill="{fill}" stroke="{color}" '
                           f'stroke-width="2"><title>{esc(tip)}</title></circle>')
    return _svg(out)


def stacked_bar_chart(xs: list, stacks: list[dict], y_label: str, x_label: str = "step", unit: str = "s",
                      x_range=None) -> str | None:
    """One bar per x, split into stacks [{name, ys, color}] (missing values count 0)."""
    if not xs or not stacks:
        return None
    totals = [sum(num(s["ys"][i]) or 0.0 for s in stacks) for i in range(len(xs))]
    x0, x1, xt, y0, y1, yt = _scales([x - 0.5 for x in xs] + [x + 0.5 for x in xs], totals, None, None, True,
                                     x_range)
    out, sx, sy = _axes(x0, x1, xt, y0, y1, yt, x_label, y_label)
    bw = max(1.0, 0.8 * (W - ML - MR) / max(1.0, x1 - x0))
    for i, x in enumerate(xs):
        base = 0.0
        for s in stacks:
            v, name = num(s["ys"][i]) or 0.0, s["name"]
            if v > 0:
                out.append(f'<rect x="{sx(x) - bw / 2:.1f}" y="{sy(base + v):.1f}" width="{bw:.1f}" '
                           f'height="{max(0.0, sy(base) - sy(base + v)):.1f}" fill="{esc(s["color"])}">'
                           f'<title>{esc(f"{x_label} {x}: {name} {v:.1f} {unit}")}</title></rect>')
            base += v
    return _svg(out)


def _svg(parts: list[str], width: int = W, height: int = H) -> str:
    return (f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg" role="img">' + "".join(parts) + "</svg>")


def legend(items: list[tuple[str, str, str]]) -> str:
    """items: (name, colour, style) with style 'line' | 'dash' | 'dot' | 'box'."""
    spans = "".join(f'<span class="key"><i class="sw {esc(style)}" style="--c:{esc(color)}"></i>{esc(name)}</span>'
                    for name, color, style in items)
    return f'<div class="legend">{spans}</div>'


def figure(title: str, svg: str | None, explain: str, keys: list[tuple[str, str, str]] | None = None,
           missing: str = "") -> str:
    """A chart with its title, legend and one line saying what it shows. With no data, the
    figure says so instead of drawing empty axes."""
    body = svg if svg else f'<div class="empty">No data: {esc(missing or "nothing recorded yet")}.</div>'
    return (f'<figure class="chart"><figcaption><b>{esc(title)}</b></figcaption>'
            f'{legend(keys) if keys and svg else ""}{body}<p class="explain">{explain}</p></figure>')


def shift_chart(sb: dict, sa: dict, colors: dict[str, str], acc: dict | None = None) -> str | None:
    """Two stacked bars (before, after) per task kind; each bar splits 100% of tool calls.
    acc: {kind: (accuracy before, accuracy after)}, written under each kind's name."""
    kinds = ["all"] + [k for k in sorted(set(sb) | set(sa)) if k != "all"]
    kinds = [k for k in kinds if sb.get(k) or sa.get(k)]
    if not kinds:
        return None
    bw, gap, group_gap, ml, mt, mb, ph = 46, 8, 40, 52, 12, 64, 220
    width = ml + len(kinds) * (2 * bw + gap + group_gap) + 10
    height = mt + ph + mb
    sy = lambda v: mt + ph - v * ph  # noqa: E731
    out = []
    for t in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line x1="{ml}" x2="{width - 10}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{ml - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{100 * t:.0f}%</text>')
    out.append(f'<text transform="translate(13 {mt + ph / 2}) rotate(-90)" class="alabel" '
               f'text-anchor="middle">share of tool calls</text>')
    for i, kind in enumerate(kinds):
        gx = ml + group_gap / 2 + i * (2 * bw + gap + group_gap)
        for j, (label, shares) in enumerate((("before", sb.get(kind)), ("after", sa.get(kind)))):
            x = gx + j * (bw + gap)
            out.append(f'<text x="{x + bw / 2}" y="{mt + ph + 14}" class="tick" text-anchor="middle">{label}</text>')
            if not shares:  # that evaluation does not exist yet, or had no tool call of this kind
                missing = "not yet" if not (sb if label == "before" else sa) else "no calls"
                out.append(f'<text x="{x + bw / 2}" y="{sy(0.5)}" class="tick" text-anchor="middle">{missing}</text>')
                continue
            base = 0.0
            for tool in colors:
                share, calls = shares.get(tool, (0.0, 0))
                if share <= 0:
                    continue
                y_top, h = sy(base + share), share * ph
                tip = f"{kind}, {label}: {tool} {100 * share:.1f}%" + (f" ({calls} calls)" if calls else "")
                out.append(f'<rect x="{x}" y="{y_top:.1f}" width="{bw}" height="{h:.1f}" fill="{esc(colors[tool])}" '
                           f'stroke="#fff" stroke-width="0.5"><title>{esc(tip)}</title></rect>')
                if h >= 15:
                    out.append(f'<text x="{x + bw / 2}" y="{y_top + h / 2 + 4:.1f}" class="inbar" '
                               f'fill="{"#1d2125" if light(colors[tool]) else "#fff"}" '
                               f'text-anchor="middle">{100 * share:.0f}%</text>')
                base += share
        out.append(f'<text x="{gx + bw + gap / 2}" y="{mt + ph + 34}" class="alabel" text-anchor="middle">'
                   f'{esc(kind)}</text>')
        b_acc, a_acc = (acc or {}).get(kind, (None, None))
        if b_acc is not None or a_acc is not None:
            out.append(f'<text x="{gx + bw + gap / 2}" y="{mt + ph + 50}" class="tick" text-anchor="middle">'
                       f'acc {esc(pct(b_acc))} → {esc(pct(a_acc))}</text>')
    return _svg(out, int(width), height)
