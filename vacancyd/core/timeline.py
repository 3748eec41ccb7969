"""The owner's 24-hour timeline: history samples (:mod:`vacancyd.core.history`) drawn as one
self-contained SVG document for the status page (issue 23, item 7).

Pure: the samples, the current wall time and the zone to label the axis in are arguments;
the result is text. Rows, top to bottom: the owner present or away, lending on or off,
borrowed work as bands stacked by borrower, memory used per GPU resource as lines, GPU
temperature as lines; then the time axis in local time and a legend.

The SVG is safe to put into a page: every text from outside (borrower and resource names,
the zone's name) is escaped, characters XML cannot carry are replaced, and it uses only
presentation attributes (``fill``, ``stroke``), never ``style`` or ``<script>``, so a
Content-Security-Policy without ``'unsafe-inline'`` draws it as it is. It has a ``<title>``
and a ``<desc>`` that says in words what the picture shows, for screen readers.

A sample stands for the lender's state until the next one, for at most
:data:`~vacancyd.core.history.VALID_FOR_S`; longer gaps (the daemon was stopped) and the
time before the first sample are left blank, never filled with a guess. With no sample at
all the SVG says so in text.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from vacancyd.core.history import UNNAMED, VALID_FOR_S, HistorySample, ResourceSample

#: What the page draws (seconds).
SPAN_S = 24 * 3600.0

WIDTH = 960
_LEFT = 112  # row labels
_RIGHT = 16
_TOP = 8
_OWNER_H = 16
_LENDING_H = 16
_WORK_H = 44
_MEM_H = 72
_TEMP_H = 56
_GAP = 10
_TICK_STEPS_H = (1, 2, 3, 4, 6, 12, 24)

#: Borrower colours (Okabe-Ito, readable with the common colour-vision deficiencies); the
#: borrowers with the most work get one each, the rest share :data:`_OTHERS_COLOUR`.
_BORROWER_COLOURS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442")
_OTHERS_COLOUR = "#6e7781"
_RESOURCE_COLOURS = ("#0969da", "#bc4c00", "#1a7f37", "#8250df", "#bf3989", "#4d2d00")
_PRESENT, _AWAY = "#cf222e", "#d8dee4"
_LENDING_ON, _LENDING_OFF = "#1a7f37", "#afb8c1"
_TEXT, _MUTE, _GRID = "#1f2328", "#57606a", "#d0d7de"
_NAME_CHARS = 28

# Characters XML 1.0 cannot carry at all (a DOMParser would refuse the whole document).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _text(value: str) -> str:
    """``value`` as XML character data or an attribute value (quotes escaped too)."""
    return html.escape(_NOT_XML.sub("\ufffd", value), quote=True)


def _num(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def borrower_label(name: str) -> str:
    """How a borrower is named on the timeline: the unnamed borrower (the shared borrow
    token) as ``default``, as everywhere else (:data:`vacancyd.core.usage.UNNAMED_LABEL`),
    long names cut to :data:`_NAME_CHARS` characters."""
    if name == UNNAMED:
        return "default"
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 1] + "…"


def duration_words(seconds: float) -> str:
    """``3 h 10 min``, ``45 min``, ``under a minute``."""
    minutes = int(seconds // 60)
    if minutes < 1:
        return "under a minute"
    h, m = divmod(minutes, 60)
    if not h:
        return f"{m} min"
    return f"{h} h" if not m else f"{h} h {m} min"


def _mib_words(mib: float) -> str:
    return f"{_num(mib / 1024)} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


@dataclass(frozen=True, slots=True)
class _Segment:
    start: float
    end: float
    sample: HistorySample


def _segments(samples: Iterable[HistorySample], start: float, end: float) -> list[_Segment]:
    """Each sample's stretch of [start, end]: until the next sample, at most VALID_FOR_S."""
    ordered = sorted((s for s in samples if s.at_wall <= end), key=lambda s: s.at_wall)
    out: list[_Segment] = []
    for i, s in enumerate(ordered):
        following = ordered[i + 1].at_wall if i + 1 < len(ordered) else end
        seg_end = min(following, s.at_wall + VALID_FOR_S, end)
        seg_start = max(s.at_wall, start)
        if seg_end > seg_start:
            out.append(_Segment(seg_start, seg_end, s))
    return out


def _coarsen(
    segments: Sequence[_Segment], start: float, end: float, columns: int
) -> list[_Segment]:
    """``segments`` (sorted, not overlapping) reduced to at most ``columns`` equal columns
    of [start, end]: each column shows the sample that covers most of it (none when less
    than half of it is covered), with each resource's highest memory use and temperature
    within the column, so a short peak still shows."""
    width = (end - start) / columns
    out: list[_Segment] = []
    j = 0
    for c in range(columns):
        a, b = start + c * width, start + (c + 1) * width
        while j < len(segments) and segments[j].end <= a:
            j += 1
        best: HistorySample | None = None
        best_s = covered = 0.0
        peaks: dict[str, list[float | None]] = {}
        k = j
        while k < len(segments) and segments[k].start < b:
            seg = segments[k]
            overlap = min(b, seg.end) - max(a, seg.start)
            if overlap > 0:
                covered += overlap
                if overlap > best_s:
                    best, best_s = seg.sample, overlap
                for name, r in seg.sample.resources.items():
                    top = peaks.setdefault(name, [None, None, None])
                    for i, v in enumerate((r.used_mib, r.total_mib, r.temperature_c)):
                        current = top[i]
                        if v is not None and (current is None or v > current):
                            top[i] = v
            k += 1
        if best is not None and covered >= width / 2:
            resources = {n: ResourceSample(*v) for n, v in peaks.items()}
            out.append(_Segment(a, b, replace(best, resources=resources)))
    return out


def _runs(
    segments: Sequence[_Segment], key: Mapping[int, object]
) -> list[tuple[float, float, object]]:
    """Contiguous segments with equal ``key[index]`` merged into (start, end, key) runs."""
    runs: list[tuple[float, float, object]] = []
    for i, seg in enumerate(segments):
        k = key[i]
        if runs and runs[-1][2] == k and math.isclose(runs[-1][1], seg.start):
            runs[-1] = (runs[-1][0], seg.end, k)
        else:
            runs.append((seg.start, seg.end, k))
    return runs


class _Frame:
    """The plot's geometry: wall time -> x, and the rows' vertical positions."""

    def __init__(self, start: float, span_s: float, width: int) -> None:
        self.start = start
        self.span_s = span_s
        self.left = _LEFT
        self.plot_w = width - _LEFT - _RIGHT
        y = _TOP
        self.owner = (y, _OWNER_H)
        y += _OWNER_H + 6
        self.lending = (y, _LENDING_H)
        y += _LENDING_H + _GAP
        self.work = (y, _WORK_H)
        y += _WORK_H + _GAP
        self.memory = (y, _MEM_H)
        y += _MEM_H + _GAP
        self.temperature = (y, _TEMP_H)
        y += _TEMP_H
        self.axis_y = y
        self.bottom = y + 36  # tick labels and the caption

    def x(self, t: float) -> float:
        return self.left + (t - self.start) / self.span_s * self.plot_w


def _rect(x0: float, x1: float, y: float, h: float, fill: str, tip: str = "") -> str:
    w = max(x1 - x0, 0.5)
    inner = f"<title>{_text(tip)}</title>" if tip else ""
    end = f">{inner}</rect>" if inner else "/>"
    return (
        f'<rect x="{_num(x0)}" y="{_num(y)}" width="{_num(w)}" height="{_num(h)}" '
        f'fill="{fill}"{end}'
    )


def _label(x: float, y: float, text: str, *, anchor: str = "start", fill: str = _TEXT) -> str:
    return (
        f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="{anchor}" fill="{fill}">'
        f"{_text(text)}</text>"
    )


def _clock(t: float, tz: dt.tzinfo) -> str:
    return dt.datetime.fromtimestamp(t, tz).strftime("%H:%M")


def _ticks(start: float, end: float, tz: dt.tzinfo) -> list[tuple[float, str]]:
    """Wall times on whole local hours, every few hours, with their labels (a local
    midnight is labelled with its weekday and date)."""
    span_h = (end - start) / 3600
    step = next((s for s in _TICK_STEPS_H if span_h / s <= 8), 24)
    # every zone's offset is a whole number of quarter hours: try each UTC quarter hour
    t = math.ceil(start / 900) * 900
    out: list[tuple[float, str]] = []
    while t <= end:
        local = dt.datetime.fromtimestamp(t, tz)
        if local.minute == 0 and local.hour % step == 0:
            text = local.strftime("%a %d %b") if local.hour == 0 else local.strftime("%H:%M")
            out.append((float(t), text))
        t += 900
    return out


def _lines(
    frame: _Frame,
    segments: Sequence[_Segment],
    value: Mapping[int, float | None],
    y_of: Mapping[str, float],
) -> list[list[tuple[float, float]]]:
    """Polylines through each segment's value (held level over the segment), broken where
    the value is missing or the segments are not contiguous."""
    lo, hi, top, height = y_of["lo"], y_of["hi"], y_of["top"], y_of["height"]
    lines: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    previous_end: float | None = None
    for i, seg in enumerate(segments):
        v = value.get(i)
        if v is None:
            if current:
                lines.append(current)
            current, previous_end = [], None
            continue
        clamped = min(max(v, lo), hi)
        y = top + height - (clamped - lo) / (hi - lo) * height
        if previous_end is None or not math.isclose(previous_end, seg.start):
            if current:
                lines.append(current)
            current = []
        points = [(frame.x(seg.start), y), (frame.x(seg.end), y)]
        for p in points:
            if len(current) >= 2 and current[-1][1] == p[1] == current[-2][1]:
                current[-1] = p  # a level run is one segment, however many samples
            else:
                current.append(p)
        previous_end = seg.end
    if current:
        lines.append(current)
    return lines


def _polyline(points: Sequence[tuple[float, float]], colour: str, tip: str) -> str:
    coords = " ".join(f"{_num(x)},{_num(y)}" for x, y in points)
    return (
        f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5" '
        f'stroke-linejoin="round"><title>{_text(tip)}</title></polyline>'
    )


def render_timeline(
    samples: Sequence[HistorySample],
    *,
    now_wall: float,
    tz: dt.tzinfo,
    zone_name: str = "",
    span_s: float = SPAN_S,
    width: int = WIDTH,
) -> str:
    """The SVG document (text, no XML declaration) for the ``span_s`` seconds before
    ``now_wall`` (wall seconds since the epoch), with axis labels in ``tz`` (named
    ``zone_name`` in the caption). ``samples`` in any order; those outside the span are
    ignored. Never raises for finite times; an empty or short history draws what there is
    and says the rest in text."""
    start = now_wall - span_s
    frame = _Frame(start, span_s, width)
    segments = _segments(samples, start, now_wall)
    # what is drawn: at most one shape per two pixels, however many samples
    columns = frame.plot_w // 2
    drawn = segments if len(segments) <= columns else _coarsen(segments, start, now_wall, columns)
    borrowers = _Borrowers.rank(segments)
    gauges = _Gauges.of(segments)
    parts = _draw_rows(frame)
    parts += _draw_owner_and_lending(frame, drawn, tz)
    parts += _draw_work(frame, segments, drawn, borrowers, tz)
    parts += _draw_gauges(frame, segments, drawn, gauges)
    parts += _draw_gaps(frame, segments, tz)
    parts += _draw_axis(frame, now_wall, span_s, tz, zone_name)
    legend, height = _draw_legend(frame, borrowers, gauges)
    owner_s = sum(seg.end - seg.start for seg in segments if seg.sample.owner_present)
    lending_s = sum(seg.end - seg.start for seg in segments if seg.sample.lending)
    desc = _describe(
        segments,
        owner_s,
        lending_s,
        borrowers.job_s,
        gauges.peaks,
        gauges.hottest,
        borrowers.ranked,
    )
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="vacancyd-timeline" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-labelledby="tl-title tl-desc" font-family="system-ui, sans-serif" '
        f'font-size="12">'
        f'<title id="tl-title">Lending over the last {_num(span_s / 3600)} hours</title>'
        f'<desc id="tl-desc">{_text(desc)}</desc>'
    )
    return head + "".join(parts) + "".join(legend) + "</svg>"


def _draw_rows(frame: _Frame) -> list[str]:
    """Each row's label and its empty frame."""
    parts: list[str] = []
    for (y, h), name in (
        (frame.owner, "Owner"),
        (frame.lending, "Lending"),
        (frame.work, "Borrowed work"),
        (frame.memory, "GPU memory"),
        (frame.temperature, "GPU temperature"),
    ):
        parts.append(_label(8, y + (h - 4 if h <= 20 else h // 2 + 4), name, fill=_MUTE))
        parts.append(
            f'<rect x="{frame.left}" y="{y}" width="{frame.plot_w}" height="{h}" '
            f'fill="none" stroke="{_GRID}"/>'
        )
    return parts


def _draw_owner_and_lending(frame: _Frame, drawn: Sequence[_Segment], tz: dt.tzinfo) -> list[str]:
    """The owner row (present or away) and the lending row (on or off), one box per run."""
    parts: list[str] = []
    owner_key = {i: seg.sample.owner_present for i, seg in enumerate(drawn)}
    lending_key = {i: seg.sample.lending for i, seg in enumerate(drawn)}
    for a, b, present in _runs(drawn, owner_key):
        what = "owner present" if present else "owner away"
        parts.append(
            _rect(
                frame.x(a),
                frame.x(b),
                frame.owner[0],
                frame.owner[1],
                _PRESENT if present else _AWAY,
                f"{what} {_clock(a, tz)}–{_clock(b, tz)}",
            )
        )
    for a, b, on in _runs(drawn, lending_key):
        what = "lending on" if on else "lending off"
        parts.append(
            _rect(
                frame.x(a),
                frame.x(b),
                frame.lending[0],
                frame.lending[1],
                _LENDING_ON if on else _LENDING_OFF,
                f"{what} {_clock(a, tz)}–{_clock(b, tz)}",
            )
        )
    return parts


@dataclass(frozen=True, slots=True)
class _Borrowers:
    """Who borrowed: job-seconds per borrower, ranked most first; the first few ``named``
    with a colour each, the ``others`` sharing one."""

    job_s: dict[str, float]
    ranked: list[str]
    named: list[str]
    others: list[str]
    colour: dict[str, str]

    @classmethod
    def rank(cls, segments: Sequence[_Segment]) -> _Borrowers:
        job_s: dict[str, float] = {}
        for seg in segments:
            for name, n in seg.sample.borrowers.items():
                job_s[name] = job_s.get(name, 0.0) + n * (seg.end - seg.start)
        ranked = sorted(job_s, key=lambda n: (-job_s[n], n))
        named = (
            ranked[: len(_BORROWER_COLOURS)]
            if len(ranked) <= len(_BORROWER_COLOURS)
            else (ranked[: len(_BORROWER_COLOURS) - 1])
        )
        others = [n for n in ranked if n not in named]
        colour = {n: _BORROWER_COLOURS[i] for i, n in enumerate(named)}
        return cls(job_s, ranked, named, others, colour)

    def grouped(self, counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
        """(borrower, jobs) of the named ones, then ("", -jobs) of the others together."""
        out = [(n, counts.get(n, 0)) for n in self.named if counts.get(n, 0)]
        rest = sum(counts.get(n, 0) for n in self.others)
        if rest:
            out.append(("", -rest))  # negative: the others' share, drawn last
        return tuple(out)


def _draw_work(
    frame: _Frame,
    segments: Sequence[_Segment],
    drawn: Sequence[_Segment],
    borrowers: _Borrowers,
    tz: dt.tzinfo,
) -> list[str]:
    """The borrowed-work row: bands stacked by borrower, and the peak number of jobs."""
    parts: list[str] = []
    work_key = {i: borrowers.grouped(seg.sample.borrowers) for i, seg in enumerate(drawn)}
    peak = max((seg.sample.jobs for seg in segments), default=0)
    scale_jobs = max((seg.sample.jobs for seg in drawn), default=0)
    wy, wh = frame.work
    for a, b, key in _runs(drawn, work_key):
        assert isinstance(key, tuple)
        y = wy + wh
        for name, n in key:
            h = abs(n) / max(scale_jobs, 1) * (wh - 2)
            y -= h
            who = f"{len(borrowers.others)} other borrowers" if n < 0 else borrower_label(name)
            tip = (
                f"{who}: {abs(n)} job{'s' if abs(n) != 1 else ''}, {_clock(a, tz)}–{_clock(b, tz)}"
            )
            fill = _OTHERS_COLOUR if n < 0 else borrowers.colour[name]
            parts.append(_rect(frame.x(a), frame.x(b), y, h, fill, tip))
    if segments and peak:
        parts.append(
            _label(8, wy + wh - 2, f"peak {peak} job{'s' if peak != 1 else ''}", fill=_MUTE)
        )
    return parts


@dataclass(slots=True)
class _Gauges:
    """The GPU resources' lines: their names (sorted) and colours, the memory scale's top
    (MiB) and the temperature scale (°C); ``peaks`` (MiB) and ``hottest`` (°C) per resource
    with a reading, filled while drawing."""

    names: list[str]
    colour: dict[str, str]
    mem_top: float
    temp_lo: float
    temp_hi: float
    peaks: dict[str, float]
    hottest: dict[str, float]

    @classmethod
    def of(cls, segments: Sequence[_Segment]) -> _Gauges:
        names = sorted({n for seg in segments for n in seg.sample.resources})
        colour = {n: _RESOURCE_COLOURS[i % len(_RESOURCE_COLOURS)] for i, n in enumerate(names)}
        totals = [
            r.total_mib if r.total_mib is not None else r.used_mib
            for seg in segments
            for r in seg.sample.resources.values()
            if (r.total_mib if r.total_mib is not None else r.used_mib) is not None
        ]
        mem_top = max((t for t in totals if t is not None), default=0.0)
        temps = [
            r.temperature_c
            for seg in segments
            for r in seg.sample.resources.values()
            if r.temperature_c is not None
        ]
        temp_lo = min(30.0, math.floor((min(temps) - 5) / 10) * 10) if temps else 30.0
        temp_hi = max(90.0, math.ceil((max(temps) + 5) / 10) * 10) if temps else 90.0
        return cls(names, colour, mem_top, temp_lo, temp_hi, {}, {})


def _draw_gauges(
    frame: _Frame, segments: Sequence[_Segment], drawn: Sequence[_Segment], gauges: _Gauges
) -> list[str]:
    """Memory used and temperature per GPU resource as lines, with their scales' labels
    (or a word saying there is no reading). Fills ``gauges.peaks`` and ``gauges.hottest``."""
    parts: list[str] = []
    my, mh = frame.memory
    ty, th = frame.temperature
    for name in gauges.names:
        used = {
            i: seg.sample.resources[name].used_mib
            for i, seg in enumerate(drawn)
            if name in seg.sample.resources
        }
        temp = {
            i: seg.sample.resources[name].temperature_c
            for i, seg in enumerate(drawn)
            if name in seg.sample.resources
        }
        seen_used = [v for v in used.values() if v is not None]
        seen_temp = [v for v in temp.values() if v is not None]
        if seen_used and gauges.mem_top > 0:
            gauges.peaks[name] = max(seen_used)
            scale = {"lo": 0.0, "hi": gauges.mem_top, "top": my + 2, "height": mh - 4}
            tip = f"{name}: memory used, peak {_mib_words(gauges.peaks[name])}"
            for line in _lines(frame, drawn, used, scale):
                parts.append(_polyline(line, gauges.colour[name], tip))
        if seen_temp:
            gauges.hottest[name] = max(seen_temp)
            scale = {"lo": gauges.temp_lo, "hi": gauges.temp_hi, "top": ty + 2, "height": th - 4}
            tip = f"{name}: temperature, highest {gauges.hottest[name]:.0f} °C"
            for line in _lines(frame, drawn, temp, scale):
                parts.append(_polyline(line, gauges.colour[name], tip))
    if gauges.peaks:
        top = _mib_words(gauges.mem_top)
        parts.append(_label(frame.left - 4, my + 10, top, anchor="end", fill=_MUTE))
        parts.append(_label(frame.left - 4, my + mh, "0", anchor="end", fill=_MUTE))
    elif segments:
        what = "no GPU memory reading" if gauges.names else "no GPU resource declared"
        parts.append(_label(frame.left + 8, my + mh / 2 + 4, what, fill=_MUTE))
    if gauges.hottest:
        hi, lo = f"{gauges.temp_hi:.0f} °C", f"{gauges.temp_lo:.0f} °C"
        parts.append(_label(frame.left - 4, ty + 10, hi, anchor="end", fill=_MUTE))
        parts.append(_label(frame.left - 4, ty + th, lo, anchor="end", fill=_MUTE))
    elif segments:
        what = "no GPU temperature reading" if gauges.names else "no GPU resource declared"
        parts.append(_label(frame.left + 8, ty + th / 2 + 4, what, fill=_MUTE))
    return parts


def _draw_gaps(frame: _Frame, segments: Sequence[_Segment], tz: dt.tzinfo) -> list[str]:
    """What has no data, in words: no history at all, or none before the first sample."""
    wy, wh = frame.work
    if not segments:
        return [
            _label(
                frame.left + frame.plot_w / 2,
                wy + wh / 2 + 4,
                "No history recorded yet: vacancyd records the lender's state every minute.",
                anchor="middle",
            )
        ]
    first = segments[0].start
    if frame.x(first) - frame.left > 170:
        return [
            _label(
                (frame.left + frame.x(first)) / 2,
                wy + wh / 2 + 4,
                f"no history before {_clock(first, tz)}",
                anchor="middle",
                fill=_MUTE,
            )
        ]
    return []


def _draw_axis(
    frame: _Frame, now_wall: float, span_s: float, tz: dt.tzinfo, zone_name: str
) -> list[str]:
    """The time axis: whole local hours as dashed lines with labels, and the caption."""
    right = frame.left + frame.plot_w
    ay = frame.axis_y
    parts = [f'<line x1="{frame.left}" y1="{ay}" x2="{right}" y2="{ay}" stroke="{_MUTE}"/>']
    for t, text in _ticks(now_wall - span_s, now_wall, tz):
        x = frame.x(t)
        parts.append(
            f'<line x1="{_num(x)}" y1="{frame.owner[0]}" x2="{_num(x)}" y2="{ay + 4}" '
            f'stroke="{_GRID}" stroke-dasharray="2 3"/>'
        )
        parts.append(_label(x, ay + 16, text, anchor="middle", fill=_MUTE))
    caption = f"last {_num(span_s / 3600)} h until {_clock(now_wall, tz)}"
    if zone_name:
        caption += f", times in {zone_name}"
    parts.append(_label(right, ay + 32, caption, anchor="end", fill=_MUTE))
    return parts


def _draw_legend(frame: _Frame, borrowers: _Borrowers, gauges: _Gauges) -> tuple[list[str], int]:
    """(the legend's shapes, the document's height in px): its entries wrap to the plot's
    width."""
    right = frame.left + frame.plot_w
    entries: list[tuple[str, str, str]] = [  # (kind, colour, text)
        ("box", _PRESENT, "owner present"),
        ("box", _AWAY, "owner away"),
        ("box", _LENDING_ON, "lending on"),
        ("box", _LENDING_OFF, "lending off"),
    ]
    entries += [("box", borrowers.colour[n], borrower_label(n)) for n in borrowers.named]
    if borrowers.others:
        entries.append(("box", _OTHERS_COLOUR, f"{len(borrowers.others)} other borrowers"))
    entries += [("line", gauges.colour[n], n) for n in gauges.names]
    lx, ly = float(frame.left), frame.bottom + 8.0
    legend: list[str] = []
    for kind, fill, text in entries:
        w = 22 + 7 * len(text)
        if lx + w > right and lx > frame.left:
            lx, ly = float(frame.left), ly + 18
        if kind == "box":
            legend.append(_rect(lx, lx + 12, ly - 10, 12, fill))
        else:
            legend.append(
                f'<line x1="{_num(lx)}" y1="{_num(ly - 4)}" x2="{_num(lx + 12)}" '
                f'y2="{_num(ly - 4)}" stroke="{fill}" stroke-width="2"/>'
            )
        legend.append(_label(lx + 16, ly, text, fill=_TEXT))
        lx += w
    return legend, int(ly + 10)


def _describe(
    segments: Sequence[_Segment],
    owner_s: float,
    lending_s: float,
    job_s: Mapping[str, float],
    peaks: Mapping[str, float],
    hottest: Mapping[str, float],
    ranked: Sequence[str],
) -> str:
    """The timeline in words, for screen readers (the SVG's ``<desc>``)."""
    if not segments:
        return "No history recorded yet."
    covered = sum(seg.end - seg.start for seg in segments)
    words = [
        f"History covers {duration_words(covered)}.",
        f"The owner was present for {duration_words(owner_s)};"
        f" lending was on for {duration_words(lending_s)}.",
    ]
    if ranked:
        words.append(
            "Borrowed work: "
            + ", ".join(f"{borrower_label(n)} {duration_words(job_s[n])}" for n in ranked)
            + "."
        )
    else:
        words.append("Nobody borrowed the machine.")
    for name in sorted(set(peaks) | set(hottest)):
        bits = []
        if name in peaks:
            bits.append(f"memory used up to {_mib_words(peaks[name])}")
        if name in hottest:
            bits.append(f"up to {hottest[name]:.0f} °C")
        words.append(f"{name}: {', '.join(bits)}.")
    return " ".join(words)
