"""Per-layer recipes: `policy.overrides`, an ordered list of (regex, recipe name or 'bf16').

For each nn.Linear the layer policy would convert, the FIRST pattern that `re.search`es its dotted module name
decides: 'bf16' keeps the layer in high precision, a recipe name gives it that recipe (with the run's backend);
no match keeps the run's recipe. Overrides choose among the layers the policy converts: they never force an
excluded or misshapen layer into FP8. A pattern that matches no nn.Linear at all is an error (a plan made for
another model, or a typo), raised before any layer is swapped.
"""

from __future__ import annotations

import re

from fp8train.nn.recipes import OVERRIDE_BF16, RECIPE_NAMES

__all__ = ["OVERRIDE_BF16", "OVERRIDE_CHOICES", "normalize_overrides", "first_override", "unmatched_patterns"]

OVERRIDE_CHOICES = (OVERRIDE_BF16,) + RECIPE_NAMES


def normalize_overrides(overrides, key: str = "policy.overrides") -> tuple[tuple[str, str], ...]:
    """A mapping {regex: choice} (insertion order kept) or (regex, choice) pairs -> validated pairs."""
    pairs = list(overrides.items()) if hasattr(overrides, "items") else [tuple(p) for p in overrides]
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"{key}: each entry must map a regex to a recipe, got {pair!r}")
        pattern, choice = pair
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(f"{key}: {pattern!r} is not a valid regex: {exc}") from None
        if choice not in OVERRIDE_CHOICES:
            raise ValueError(f"{key}[{pattern!r}]={choice!r}: allowed {', '.join(OVERRIDE_CHOICES)}")
    return tuple((str(p), str(c)) for p, c in pairs)


def first_override(overrides: tuple[tuple[str, str], ...], name) -> tuple[str, str] | None:
    """The first (pattern, choice) whose pattern re.searches `name` (or any name of a tuple of the names one
    layer goes by), or None."""
    names = (name,) if isinstance(name, str) else tuple(name)
    return next(((p, c) for p, c in overrides if any(re.search(p, n) for n in names)), None)


def unmatched_patterns(overrides: tuple[tuple[str, str], ...], linear_names: list[str]) -> list[str]:
    """Patterns that match none of `linear_names`."""
    return [p for p, _ in overrides if not any(re.search(p, n) for n in linear_names)]
