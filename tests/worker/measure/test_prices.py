"""The electricity price's sanity check: a question for what no home pays, per currency."""

from __future__ import annotations

import pytest

from worker.measure.prices import HOUSEHOLD, price_doubt


@pytest.mark.parametrize(("price", "currency"), [
    (0.32, "USD"), (0.17, "usd"), (0.45, "USD"),  # mainland and Hawaii
    (30.0, "JPY"), (0.40, "EUR"), (0.25, "GBP"), (2.5, "SEK"), (7.0, "INR"),
])
def test_what_homes_pay_is_not_questioned(price: float, currency: str) -> None:
    assert price_doubt(price, currency) is None


def test_cents_typed_as_dollars_are_asked_about_with_the_price_meant() -> None:
    assert price_doubt(32.0, "USD") == (
        "$32.00 per kWh is about 200 times what most homes pay — did you mean $0.32?")


def test_the_same_figure_is_fine_in_yen_and_not_in_dollars() -> None:
    assert price_doubt(30.0, "JPY") is None
    assert price_doubt(30.0, "USD") is not None
    assert price_doubt(3000.0, "JPY") == "¥3,000.00 per kWh is about 100 times what most homes pay — did you mean ¥30.00?"


def test_a_price_far_too_low_is_asked_about_too() -> None:
    question = price_doubt(0.003, "EUR")
    assert question == "€0.003 per kWh is far below what most homes pay (about €0.28) — did you mean €0.30?"


def test_a_currency_without_a_symbol_is_written_by_its_code() -> None:
    assert price_doubt(25.0, "SEK") == "25.00 SEK per kWh is about 10 times what most homes pay — did you mean 2.50 SEK?"


def test_no_slip_explains_it_then_the_question_stays_open() -> None:
    question = price_doubt(9e9, "USD")
    assert question is not None and question.endswith("— is that right?")


def test_not_set_and_unknown_currencies_are_no_doubt() -> None:
    assert price_doubt(0.0, "USD") is None  # not set: the earnings card nudges, where power is measured
    assert price_doubt(32.0, "XYZ") is None  # nothing to judge it by
    assert price_doubt(float("nan"), "USD") is None


def test_every_usual_price_lies_in_its_own_range() -> None:
    for code, home in HOUSEHOLD.items():
        assert home.low < home.usual < home.high, code
        assert price_doubt(home.usual, code) is None
