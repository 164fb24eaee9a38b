"""Byte sizes and fractions (``lightning_ckpt.core.units``)."""

import math

import pytest

from lightning_ckpt.core.units import (
    GiB,
    KiB,
    MiB,
    format_bytes,
    parse_size,
    parse_size_or_fraction,
    to_gib,
    unit_for,
)

SIZE_HELP = "pass a size such as '18GiB', '512MiB', '2.5GB' or an int number of bytes."


def test_constants():
    assert (KiB, MiB, GiB) == (1024, 1024**2, 1024**3)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("18GiB", 18 * 1024**3),
        ("18GiB", 19_327_352_832),
        ("512MiB", 536_870_912),
        ("2.5GB", 2_500_000_000),
        ("1024", 1024),
        (1024, 1024),
        (1, 1),
        ("1B", 1),
        ("4KiB", 4096),
        ("1TiB", 1024**4),
        ("3KB", 3000),
        ("7MB", 7_000_000),
        ("1TB", 10**12),
        ("1.5GiB", 3 * 1024**3 // 2),
        (".5KiB", 512),
        ("1e3", 1000),
        ("18 GiB", 18 * GiB),  # spaces and case are forgiven
        ("  18gib  ", 18 * GiB),
        ("512mib", 512 * MiB),
    ],
)
def test_parse_size(value, expected):
    result = parse_size(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (True, TypeError, f"size=True is not a size; {SIZE_HELP}"),
        (False, TypeError, f"size=False is not a size; {SIZE_HELP}"),
        (None, TypeError, f"size=None is not a size; {SIZE_HELP}"),
        (float("nan"), TypeError, f"size=nan is not a size; {SIZE_HELP}"),
        (1.5, TypeError, f"size=1.5 is not a size; {SIZE_HELP}"),
        (b"1GiB", TypeError, f"size=b'1GiB' is not a size; {SIZE_HELP}"),
        ("nan", ValueError, f"size='nan' is not a size; {SIZE_HELP}"),
        ("inf", ValueError, f"size='inf' is not a size; {SIZE_HELP}"),
        (-1, ValueError, f"size=-1 must be a positive size; {SIZE_HELP}"),
        ("-5GiB", ValueError, f"size='-5GiB' is not a size; {SIZE_HELP}"),
        (0, ValueError, f"size=0 must be a positive size; {SIZE_HELP}"),
        ("0", ValueError, f"size='0' must be a positive size; {SIZE_HELP}"),
        ("0GiB", ValueError, f"size='0GiB' must be a positive size; {SIZE_HELP}"),
        ("1e400", ValueError, f"size='1e400' must be a positive size; {SIZE_HELP}"),
        ("", ValueError, f"size='' is not a size; {SIZE_HELP}"),
        ("GiB", ValueError, f"size='GiB' is not a size; {SIZE_HELP}"),
        ("18 Gi B", ValueError, f"size='18 Gi B' is not a size; {SIZE_HELP}"),
        (
            "18 parsecs",
            ValueError,
            "size='18 parsecs' has an unknown unit 'parsecs'; valid units are B, KiB, MiB, GiB, TiB, KB, MB, "
            "GB, TB.",
        ),
        ("2GiBs", ValueError, "size='2GiBs' has an unknown unit 'GiBs'"),
    ],
)
def test_parse_size_errors(value, error, message):
    with pytest.raises(error) as err:
        parse_size(value)
    assert str(err.value).startswith(message)


def test_parse_size_names_the_argument():
    with pytest.raises(ValueError, match=r"^auto_threshold='18 parsecs' has an unknown unit"):
        parse_size("18 parsecs", name="auto_threshold")
    with pytest.raises(TypeError, match=r"^budget=None is not a size"):
        parse_size(None, name="budget")


@pytest.mark.parametrize(
    ("value", "expected", "kind"),
    [
        (0.8, 0.8, float),
        ("0.8", 0.8, float),
        (" 0.25 ", 0.25, float),
        (1.0, 1.0, float),
        ("1.0", 1.0, float),
        ("1e-1", 0.1, float),
        (".5", 0.5, float),
        ("18GiB", 18 * GiB, int),
        ("512MiB", 512 * MiB, int),
        (2 * GiB, 2 * GiB, int),
        ("4096", 4096, int),  # no decimal point: a byte count
        (1, 1, int),  # an int is always bytes, even 1
    ],
)
def test_parse_size_or_fraction(value, expected, kind):
    result = parse_size_or_fraction(value)
    assert result == expected
    assert type(result) is kind


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            1.5,
            ValueError,
            "threshold=1.5 is not a valid fraction of capacity; a fraction must lie in (0, 1] (e.g. 0.8), "
            f"or {SIZE_HELP}",
        ),
        ("1.5", ValueError, "threshold='1.5' is not a valid fraction of capacity"),
        (float("nan"), ValueError, "threshold=nan is not a valid fraction of capacity"),
        (float("inf"), ValueError, "threshold=inf is not a valid fraction of capacity"),
        (0.0, ValueError, "threshold=0.0 is not a valid fraction of capacity"),
        (-0.5, ValueError, "threshold=-0.5 is not a valid fraction of capacity"),
        ("2e0", ValueError, "threshold='2e0' is not a valid fraction of capacity"),  # as typed
        (
            True,
            TypeError,
            "threshold=True must be a size ('18GiB') or a fraction of capacity (0.8), not a bool.",
        ),
        (False, TypeError, "threshold=False must be a size"),
        (None, TypeError, f"threshold=None is not a size; {SIZE_HELP}"),
        (0, ValueError, f"threshold=0 must be a positive size; {SIZE_HELP}"),
        ("80%", ValueError, f"threshold='80%' is not a size; {SIZE_HELP}"),
        ("18 parsecs", ValueError, "threshold='18 parsecs' has an unknown unit 'parsecs'"),
    ],
)
def test_parse_size_or_fraction_errors(value, error, message):
    with pytest.raises(error) as err:
        parse_size_or_fraction(value)
    assert str(err.value).startswith(message)


def test_parse_size_or_fraction_names_the_argument():
    with pytest.raises(ValueError, match=r"^budget=1\.5 is not a valid fraction"):
        parse_size_or_fraction(1.5, name="budget")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (MiB, "1.0 MiB"),
        (16 * MiB, "16.0 MiB"),
        (GiB - 1, "1024.0 MiB"),
        (GiB, "1.00 GiB"),
        (int(2.42 * GiB), "2.42 GiB"),
        (18 * GiB, "18.00 GiB"),
        (1024**4, "1.00 TiB"),
        (5 * 1024**4, "5.00 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(
    ("num_bytes", "unit"),
    [
        (0, ("B", 1)),
        (1023, ("B", 1)),
        (1024, ("KiB", KiB)),
        (300 * KiB, ("KiB", KiB)),
        (MiB - 1, ("KiB", KiB)),
        (MiB, ("MiB", MiB)),
        (1.5 * MiB, ("MiB", MiB)),  # floats too: tables pass GiB metrics turned back into bytes
        (GiB, ("GiB", GiB)),
        (18 * GiB, ("GiB", GiB)),
        (2 * 1024**4, ("TiB", 1024**4)),
        (-3 * MiB, ("MiB", MiB)),  # a negative margin reads in the unit of its size
    ],
)
def test_unit_for_is_the_largest_binary_unit_the_value_reaches(num_bytes, unit):
    assert unit_for(num_bytes) == unit


def test_a_table_in_its_largest_values_unit_shows_every_small_line():
    """The unit is chosen from the largest value, so the small model's lines read as numbers, not 0.000."""
    lines = {"params": 300 * KiB, "grads": 300 * KiB, "activations": 1.2 * MiB}
    unit, scale = unit_for(max(lines.values()))
    assert unit == "MiB"
    assert [f"{v / scale:.2f}" for v in lines.values()] == ["0.29", "0.29", "1.20"]


def test_to_gib():
    assert to_gib(GiB) == 1.0
    assert to_gib(3 * GiB // 2) == 1.5
    assert to_gib(0) == 0.0
    assert math.isclose(to_gib(18 * 10**9), 16.763806343078613)


def test_round_trip_through_format_and_parse():
    assert parse_size(format_bytes(18 * GiB).replace(" ", "")) == 18 * GiB
    assert parse_size(format_bytes(512 * MiB).replace(" ", "")) == 512 * MiB


# --------------------------------------------------------------------------------------------- known issues


def test_sub_byte_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        parse_size("0.5")


def test_large_int_sizes_are_exact():
    assert parse_size(2**60 + 1) == 2**60 + 1
