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


def test_the_one_bisection_lands_on_the_threshold_within_its_steps_and_stops_on_a_time_limit():
    from bonsai_core.budget import smallest_meeting

    assert smallest_meeting(lambda b: b >= 300, 0, 1024) == 300  # until adjacent
    assert smallest_meeting(lambda b: b >= 300, 0, 1024, steps=3) == 384  # 512, 256 (no), 384
    asked = []

    def meets(b: int) -> bool:
        asked.append(b)
        if len(asked) == 3:
            raise TimeoutError
        return b >= 300

    assert smallest_meeting(meets, 0, 1024, stop=TimeoutError) == 512 and asked == [512, 256, 384]
