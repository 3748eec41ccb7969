"""The status page's 24-hour timeline (vacancyd.core.timeline): well-formed SVG with the rows
the owner reads, escaped names, honest gaps, words for screen readers, local-time labels."""

from __future__ import annotations

import datetime as dt
import re
import xml.etree.ElementTree as ET
from zoneinfo import ZoneInfo

from vacancyd.core.history import VALID_FOR_S, HistorySample, ResourceSample
from vacancyd.core.timeline import SPAN_S, borrower_label, duration_words, render_timeline
from vacancyd.core.usage import borrower_label as usage_label

NS = "{http://www.w3.org/2000/svg}"
BERLIN = ZoneInfo("Europe/Berlin")
# 2026-12-02 12:00 UTC = 13:00 in Berlin (CET, UTC+1)
NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC).timestamp()


def minutes(
    start: float,
    count: int,
    *,
    present: bool = False,
    lending: bool = True,
    borrowers: dict[str, int] | None = None,
    used: float | None = 2048.0,
    temp: float | None = 55.0,
) -> list[HistorySample]:
    return [
        HistorySample(
            start + 60 * i,
            present,
            lending,
            {"gpu0": ResourceSample(used, 24576.0, temp)},
            dict(borrowers or {}),
        )
        for i in range(count)
    ]


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # raises on anything not well-formed
    assert root.tag == NS + "svg"
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(NS + "text")]


def tips(root: ET.Element, tag: str) -> list[str]:
    out = []
    for el in root.iter(NS + tag):
        title = el.find(NS + "title")
        if title is not None and title.text:
            out.append(title.text)
    return out


def test_a_full_day_draws_every_row_with_title_and_description() -> None:
    day = minutes(NOW - SPAN_S, 24 * 60, borrowers={"alice": 1})
    root = parse(render_timeline(day, now_wall=NOW, tz=BERLIN, zone_name="Europe/Berlin"))
    assert root.get("role") == "img"
    assert root.get("aria-labelledby") == "tl-title tl-desc"
    title = root.find(NS + "title")
    desc = root.find(NS + "desc")
    assert title is not None and title.text == "Lending over the last 24 hours"
    assert desc is not None and desc.text is not None
    assert "alice 24 h" in desc.text and "present for under a minute" in desc.text
    assert "gpu0: memory used up to 2 GiB, up to 55 °C." in desc.text
    shown = texts(root)
    for row in ("Owner", "Lending", "Borrowed work", "GPU memory", "GPU temperature"):
        assert row in shown
    assert "alice" in shown and "gpu0" in shown  # the legend
    # one level run per row, however many samples: 1440 samples are not 1440 shapes
    assert len(tips(root, "rect")) < 10
    lines = list(root.iter(NS + "polyline"))
    assert len(lines) == 2  # memory and temperature of gpu0
    for line in lines:
        assert len(line.get("points", "").split()) == 2


def test_nothing_uses_style_or_script_so_a_strict_csp_draws_it() -> None:
    svg = render_timeline(minutes(NOW - 3600, 60), now_wall=NOW, tz=BERLIN)
    assert "style" not in svg and "<script" not in svg and "href" not in svg
    assert "http://" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_borrowers_are_stacked_bands_with_a_colour_each() -> None:
    hour = minutes(NOW - 3600, 30, borrowers={"alice": 2, "bob": 1}) + minutes(
        NOW - 1800, 30, borrowers={"bob": 1}
    )
    root = parse(render_timeline(hour, now_wall=NOW, tz=BERLIN))
    bands = [
        (t, r)
        for r in root.iter(NS + "rect")
        for t in [r.find(NS + "title")]
        if t is not None and t.text and "job" in t.text
    ]
    by_who = {t.text.split(":")[0] for t, _ in bands if t.text}
    assert by_who == {"alice", "bob"}
    alice = [r for t, r in bands if t.text and t.text.startswith("alice")]
    bob = [r for t, r in bands if t.text and t.text.startswith("bob")]
    assert len(alice) == 1 and len(bob) == 2  # bob's band changes height when alice leaves
    assert alice[0].get("fill") != bob[0].get("fill")
    # stacked: in the first half bob sits on alice (the most work at the bottom), 2:1 of
    # the peak of 3 jobs
    assert float(alice[0].get("height", 0)) == 2 * float(bob[0].get("height", 0))
    assert float(alice[0].get("y", 0)) > float(bob[0].get("y", 0))
    assert "peak 3 jobs" in texts(root)


def test_the_unnamed_borrower_and_many_borrowers_have_a_bounded_legend() -> None:
    many = {f"b{i:02}": i + 1 for i in range(12)} | {"": 1}
    root = parse(render_timeline(minutes(NOW - 600, 10, borrowers=many), now_wall=NOW, tz=BERLIN))
    shown = texts(root)
    assert "6 other borrowers" not in shown  # 13 borrowers: 6 named, 7 others
    assert "7 other borrowers" in shown
    assert "b11" in shown and "b00" not in shown
    assert borrower_label("") in render_timeline(
        minutes(NOW - 600, 10, borrowers={"": 1}), now_wall=NOW, tz=BERLIN
    )


def test_borrower_and_resource_names_are_escaped() -> None:
    evil = '<script>alert("x")</script>&\x01'
    samples = [
        HistorySample(
            NOW - 120 + i * 60, False, True, {evil: ResourceSample(100.0, 200.0, 40.0)}, {evil: 1}
        )
        for i in range(2)
    ]
    svg = render_timeline(samples, now_wall=NOW, tz=BERLIN, zone_name="<zone>")
    assert "<script" not in svg and "<zone>" not in svg
    root = parse(svg)  # still well-formed, the control character replaced
    shown = " ".join(texts(root))
    assert "<zone>" in shown  # read back as text, not markup
    assert '<script>alert("x")' in " ".join(tips(root, "rect"))
    assert "\x01" not in svg


def test_no_history_says_so_inside_the_svg() -> None:
    root = parse(render_timeline([], now_wall=NOW, tz=BERLIN))
    assert any(t.startswith("No history recorded yet") for t in texts(root))
    desc = root.find(NS + "desc")
    assert desc is not None and desc.text == "No history recorded yet."
    assert not list(root.iter(NS + "polyline"))
    # and samples older than the day count as none
    old = render_timeline(minutes(NOW - 2 * SPAN_S, 10), now_wall=NOW, tz=BERLIN)
    assert "No history recorded yet" in old


def test_a_short_history_draws_what_there_is_on_the_right() -> None:
    root = parse(render_timeline(minutes(NOW - 7200, 120, present=True), now_wall=NOW, tz=BERLIN))
    shown = texts(root)
    assert "no history before 11:00" in shown  # 10:00 UTC in Berlin
    owner = [
        r
        for r in root.iter(NS + "rect")
        if (t := r.find(NS + "title")) is not None and t.text and t.text.startswith("owner")
    ]
    assert len(owner) == 1 and owner[0].get("fill") == "#cf222e"
    x, w = float(owner[0].get("x", 0)), float(owner[0].get("width", 0))
    assert x > 112 + 0.9 * (960 - 128)  # the last two hours of 24: the right twelfth
    assert abs((x + w) - (960 - 16)) < 0.5  # up to now
    desc = root.find(NS + "desc")
    assert desc is not None and desc.text is not None
    assert "History covers 2 h." in desc.text and "present for 2 h" in desc.text


def test_a_gap_in_history_stays_blank_and_breaks_the_lines() -> None:
    before = minutes(NOW - 6 * 3600, 60)
    after = minutes(NOW - 2 * 3600, 120)  # three hours with no sample: the daemon was down
    root = parse(render_timeline(before + after, now_wall=NOW, tz=BERLIN))
    lending = [
        r
        for r in root.iter(NS + "rect")
        if (t := r.find(NS + "title")) is not None and t.text and t.text.startswith("lending")
    ]
    assert len(lending) == 2
    first_end = float(lending[0].get("x", 0)) + float(lending[0].get("width", 0))
    assert first_end < float(lending[1].get("x", 0)) - 100
    assert len(list(root.iter(NS + "polyline"))) == 4  # two pieces each, memory and heat
    # a sample stands for at most VALID_FOR_S after it
    assert VALID_FOR_S == 180


def test_missing_temperature_is_said_not_drawn() -> None:
    root = parse(render_timeline(minutes(NOW - 3600, 60, temp=None), now_wall=NOW, tz=BERLIN))
    assert "no GPU temperature reading" in texts(root)
    assert len(list(root.iter(NS + "polyline"))) == 1
    bare = parse(render_timeline([HistorySample(NOW - 60, False, True)], now_wall=NOW, tz=BERLIN))
    assert texts(bare).count("no GPU resource declared") == 2


def test_axis_labels_are_local_time_across_a_dst_change() -> None:
    # Berlin leaves summer time on 2026-10-25 at 03:00 CEST -> 02:00 CET
    now = dt.datetime(2026, 10, 25, 12, 0, tzinfo=dt.UTC).timestamp()
    root = parse(
        render_timeline(minutes(now - 3600, 60), now_wall=now, tz=BERLIN, zone_name="Europe/Berlin")
    )
    labels = [t for t in texts(root) if re.fullmatch(r"\d\d:00|\w{3} \d\d \w{3}", t)]
    assert "Sun 25 Oct" in labels  # local midnight gets the date
    assert "12:00" in labels and "03:00" in labels and "06:00" in labels
    assert any(t.endswith("until 13:00, times in Europe/Berlin") for t in texts(root))
    utc = parse(render_timeline(minutes(now - 3600, 60), now_wall=now, tz=dt.UTC))
    assert any(t.endswith("until 12:00") for t in texts(utc))


def test_durations_in_words() -> None:
    assert duration_words(30) == "under a minute"
    assert duration_words(45 * 60) == "45 min"
    assert duration_words(3 * 3600) == "3 h"
    assert duration_words(3 * 3600 + 600) == "3 h 10 min"
    assert borrower_label("x" * 40).endswith("…") and len(borrower_label("x" * 40)) == 28


def test_the_unnamed_borrower_is_named_as_everywhere_else() -> None:
    assert borrower_label("") == usage_label("") == "default"


def test_a_flood_of_samples_draws_a_bounded_picture_with_its_peaks() -> None:
    """A day of samples every 15 s, each different (a flapping switch): no more shapes than
    the plot has pixels, and a one-sample peak still shows."""
    samples = [
        HistorySample(
            NOW - SPAN_S + 15 * i,
            i % 2 == 0,
            i % 3 == 0,
            {"gpu0": ResourceSample(1000.0 + i % 5, 24576.0, 95.0 if i == 3000 else 40.0)},
            {"alice": 1 + i % 2, "bob": i % 3},
        )
        for i in range(5760)
    ]
    svg = render_timeline(samples, now_wall=NOW, tz=BERLIN)
    root = parse(svg)
    assert len(svg) < 200_000
    assert len(list(root.iter(NS + "rect"))) < 4 * 416 + 40
    for line in root.iter(NS + "polyline"):
        assert len(line.get("points", "").split()) <= 2 * 416
    desc = root.find(NS + "desc")
    assert desc is not None and desc.text is not None and "up to 95 °C" in desc.text
    ys = [
        float(p.split(",")[1])
        for line in root.iter(NS + "polyline")
        if "temperature" in "".join(line.itertext())
        for p in line.get("points", "").split()
    ]
    assert "95 °C" in " ".join(tips(root, "polyline"))
    assert max(ys) - min(ys) > 30  # the peak's column stands out over the 40 °C level
