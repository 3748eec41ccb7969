"""Numbers people type (CLI arguments, admin API paths) are ASCII digits only."""

from __future__ import annotations

import pytest

from vacancyd.cli import build_parser
from vacancyd.core.numbers import parse_decimal, parse_int

# Arabic-Indic three, fullwidth three, Devanagari three: int(), float() and \d take them all.
OTHER_DIGITS = ["\u0663", "\uff13", "\u0969"]


@pytest.mark.parametrize("digit", OTHER_DIGITS)
def test_other_scripts_digits_are_refused_naming_the_value(digit: str) -> None:
    assert int(digit) == 3  # what the loose parse would have accepted
    with pytest.raises(ValueError, match=f"job id '{digit}' is not a whole number in ASCII"):
        parse_int(digit, "job id")
    with pytest.raises(ValueError, match=f"seconds '1{digit}' is not a number in ASCII"):
        parse_decimal(f"1{digit}", "seconds")


@pytest.mark.parametrize("text", ["-1", "+1", "1e3", "1_000", "nan", "inf", "", "1.", "0x10"])
def test_signs_exponents_and_specials_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="ASCII digits 0-9"):
        parse_decimal(text, "seconds")


def test_plain_numbers_parse() -> None:
    assert parse_int(" 42 ", "n") == 42
    assert (parse_decimal("2.5", "s"), parse_decimal(".5", "s"), parse_decimal("7", "s")) == (
        2.5,
        0.5,
        7.0,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["check-config", "x.toml", "--signal", "\u0663"],
        ["init", "--probe-timeout", "\u0662"],
        ["k8s", "mark-stale", "--node", "n", "--stale-after-s", "\u0663\u0660"],
        ["k8s", "cleanup", "--namespace", "ns", "--stand-down-s", "\u0665"],
        ["measure", "--num-ctx", "\u0664\u0660\u0669\u0666"],
        ["measure", "--headroom-mib", "\u0665\u0660\u0660"],
    ],
)
def test_cli_number_arguments_refuse_other_scripts_digits(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert f"{argv[-1]!r} is not a" in capsys.readouterr().err
