"""Is an electricity price one a household pays? A question before a typo is saved: $32 per kWh
(cents typed as dollars) turns every day into a loss, and the node would stop serving for it.

Pure: a table of household tariffs per currency, and the question. A currency not in the table is
never doubted (there is nothing to judge it by); 0 is "not set", which the app nudges about where
power is measured, and is no doubt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Household:
    """What homes pay per kWh in one currency: a usual price, and the range no home falls outside
    (2024-25 tariffs, with room for islands, peaks and subsidies)."""

    usual: float
    low: float
    high: float


HOUSEHOLD: dict[str, Household] = {
    "USD": Household(0.17, 0.04, 1.00),
    "EUR": Household(0.28, 0.05, 1.00),
    "GBP": Household(0.25, 0.05, 1.00),
    "CHF": Household(0.30, 0.08, 1.00),
    "JPY": Household(31.0, 10.0, 100.0),
    "CAD": Household(0.17, 0.04, 0.80),
    "AUD": Household(0.30, 0.08, 1.00),
    "NZD": Household(0.32, 0.10, 1.00),
    "SEK": Household(2.0, 0.3, 8.0),
    "NOK": Household(1.5, 0.2, 8.0),
    "DKK": Household(2.5, 0.5, 8.0),
    "PLN": Household(1.0, 0.3, 3.0),
    "CZK": Household(6.0, 1.5, 15.0),
    "HUF": Household(40.0, 15.0, 150.0),
    "INR": Household(7.0, 2.0, 20.0),
    "CNY": Household(0.55, 0.2, 2.0),
    "KRW": Household(150.0, 50.0, 500.0),
    "BRL": Household(0.9, 0.3, 3.0),
    "MXN": Household(2.0, 0.5, 8.0),
    "ZAR": Household(3.0, 1.0, 10.0),
    "SGD": Household(0.30, 0.10, 1.00),
    "HKD": Household(1.4, 0.5, 4.0),
    "TWD": Household(3.0, 1.0, 10.0),
    "ILS": Household(0.6, 0.2, 2.0),
}
SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥"}  # as the app writes money
SLIPS = (1, 2, 3)  # powers of ten a price is typed off by: a zero, cents as dollars, per MWh or Wh


def price_doubt(price_per_kwh: float, currency: str) -> str | None:
    """A question for a price far outside what homes pay, with the price it was likely meant to
    be; None for a plausible one, for 0 (not set) and for a currency not in `HOUSEHOLD`."""
    code = currency.strip().upper()
    home = HOUSEHOLD.get(code)
    if home is None or not math.isfinite(price_per_kwh) or price_per_kwh <= 0:
        return None
    if home.low <= price_per_kwh <= home.high:
        return None
    said = f"{_amount(price_per_kwh, code)} per kWh"
    if price_per_kwh > home.high:
        times = _round_figure(price_per_kwh / home.usual)
        doubt = f"{said} is about {times} times what most homes pay"
    else:
        doubt = f"{said} is far below what most homes pay (about {_amount(home.usual, code)})"
    meant = _meant(price_per_kwh, home)
    return f"{doubt} — did you mean {_amount(meant, code)}?" if meant is not None else f"{doubt} — is that right?"


def _meant(price: float, home: Household) -> float | None:
    """The price moved by a slip (`SLIPS`) into what homes pay, nearest the usual price."""
    candidates = [price / 10**power if price > home.high else price * 10**power for power in SLIPS]
    fitting = [c for c in candidates if home.low <= c <= home.high]
    return min(fitting, key=lambda c: abs(math.log(c / home.usual)), default=None)


def _round_figure(ratio: float) -> str:
    """One significant figure, as a person says it: 188 → "200", 5.3 → "5"."""
    digits = max(0, math.floor(math.log10(ratio)))
    return f"{round(ratio, -digits):,.0f}"


def _amount(value: float, code: str) -> str:
    """A price as the app writes money ("$0.32", "0.30 SEK"); a tiny one keeps its digits."""
    figure = f"{value:,.2f}" if value >= 0.01 else f"{value:.2g}"
    symbol = SYMBOLS.get(code)
    return f"{symbol}{figure}" if symbol else f"{figure} {code}"
