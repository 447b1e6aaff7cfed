"""Synthetic user turns for the benchmarks: neutral sentences padded to a token target."""

from __future__ import annotations

from collections.abc import Callable, Sequence

SENTENCES = (
    "The committee reviewed the quarterly figures and asked for a clearer breakdown of costs.",
    "Rivers carve valleys slowly, moving sediment from the mountains down to the sea.",
    "A good recipe lists its ingredients in the order they are used.",
    "The library extended its opening hours during the examination period.",
    "Engineers measured the bridge's vibration under different wind speeds.",
    "Migratory birds navigate using the sun, the stars and the earth's magnetic field.",
    "The museum's new wing houses a collection of early printed maps.",
    "Our team moved the weekly meeting to Thursday so everyone could attend.",
)


def padded_turn(
    encode: Callable[[str], list[int]],
    opening: str,
    closing: str,
    *,
    start: int,
    step: int = 1,
    sentences: Sequence[str] = SENTENCES,
    target: int = 100,
) -> str:
    """``opening`` + sentences (from index ``start``, every ``step``) until ``target`` tokens, + ``closing``."""
    words = [opening]
    i = start
    while len(encode(" ".join(words))) < target:
        words.append(sentences[i % len(sentences)])
        i += step
    return " ".join(words) + closing
