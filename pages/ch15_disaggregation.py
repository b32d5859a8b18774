"""15 · prefill/decode disaggregation and the KV cache's tiers: the K/V bytes one request hands
from a prefill engine to a decode engine, and their time over a chosen link."""

from ui.labs.ch15 import bytes_section, tier_section
from ui.lesson import render_chapter

SIDE_KEY = "ch15_colocated"


def lab() -> None:
    bytes_section(SIDE_KEY, {})
    tier_section(SIDE_KEY, {})


render_chapter("15", lab)
