import pytest

from bonsai_core.budget import parse_budget
from bonsai_core.errors import BudgetError
from bonsai_core.units import format_bytes


@pytest.mark.parametrize("text, reference, expected", [
    ("123456789", 0, 123456789),
    ("800MiB", 0, 800 * 2**20),
    ("2.5GB", 0, 2_500_000_000),
    ("1 KiB", 0, 1024),
    ("60%", 1000, 600),
    ("100%", 31, 31),
    ("1e6", 0, 1_000_000),
])
def test_accepted_forms(text, reference, expected):
    assert parse_budget(text).resolve(reference) == expected


@pytest.mark.parametrize("text", ["abc", "-1", "0", "0%", "1e400", "12 GB GB", "", "5 parsecs", "%", "0.1"])
def test_nonsense_is_refused_with_the_accepted_forms(text):
    with pytest.raises(BudgetError, match="budget"):
        parse_budget(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**20) == "3.00 MiB"
