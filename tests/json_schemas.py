"""Fifty different JSON schemas (nested objects, arrays, enums, required fields, numbers with
bounds, strings of bounded length) made from a seed, for the structured-output tests: each one is
what an application would hand ``response_format``, and every output must validate against it."""
from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "city", "color", "size", "score", "count", "price", "title", "kind", "level", "age", "tags",
         "owner", "status", "rating", "items", "width", "height", "label", "active"]
ENUMS = [["red", "green", "blue"], ["small", "medium", "large"], ["open", "closed"], ["cat", "dog", "bird", "fish"],
         ["low", "high"]]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "number", "boolean", "enum", "string", "int_array", "enum_array"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 200)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.choice(ENUMS)}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 16)}
    if kind == "int_array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 4)}
    return {"type": "array", "items": {"type": "string", "enum": rng.choice(ENUMS)}, "maxItems": 3}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: (_object(rng, depth + 1) if depth < 2 and rng.random() < 0.25 else _leaf(rng)) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """n distinct schemas (their JSON texts differ)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        s = _object(rng, 0)
        key = repr(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
