"""JSON-schema cases for bench/grammar_backends.py: realistic structured-output schemas, each with a
document that validates against it (checked with ``jsonschema`` by ``checked_cases()``).

Every object sets ``additionalProperties: false`` and lists all its properties as required, as
OpenAI-style strict structured outputs do, so that xgrammar (strict_mode) and llguidance compile the
same language. Documents are serialized compactly (``separators=(",", ":")``, non-ASCII kept as
UTF-8) and the grammars are compiled for that same compact form, so the token sequence of a
document is one the constrained decoder could really have produced.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    what: str                 # one line for the report
    schema: dict[str, Any]
    document: Any

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, separators=(",", ":"))

    @property
    def document_text(self) -> str:
        """The compact JSON text a model would emit."""
        return json.dumps(self.document, separators=(",", ":"), ensure_ascii=False)


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}


FLAT_OBJECT = Case(
    name="flat_object",
    what="one flat object of strings, integer, number, boolean",
    schema=_obj({
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "is_subscriber": {"type": "boolean"},
        "lifetime_value": {"type": "number"},
        "bio": {"type": "string"},
    }),
    document={
        "name": "Zoë Fontaine-Okafor",
        "email": "zoe.fontaine@example.org",
        "age": 34,
        "city": "São Paulo",
        "is_subscriber": True,
        "lifetime_value": 1289.75,
        "bio": "Product designer who likes long-distance cycling, sourdough baking and "
               "restoring mid-century furniture. Speaks Portuguese, French and English.",
    },
)

NESTED_OBJECTS = Case(
    name="nested_objects",
    what="order with customer -> address and payment sub-objects (3 levels)",
    schema=_obj({
        "order_id": {"type": "string"},
        "customer": _obj({
            "name": {"type": "string"},
            "contact": _obj({"email": {"type": "string"}, "phone": {"type": "string"}}),
            "address": _obj({
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postal_code": {"type": "string"},
                "country": {"type": "string"},
            }),
        }),
        "payment": _obj({
            "method": {"type": "string"},
            "amount": {"type": "number"},
            "currency": {"type": "string"},
            "captured": {"type": "boolean"},
        }),
        "notes": {"type": ["string", "null"]},
    }),
    document={
        "order_id": "ORD-2024-118734",
        "customer": {
            "name": "Hiroshi Tanaka",
            "contact": {"email": "h.tanaka@example.jp", "phone": "+81 3-5555-0142"},
            "address": {"street": "2-11-3 Meguro, Meguro-ku", "city": "Tokyo",
                        "postal_code": "153-0063", "country": "Japan"},
        },
        "payment": {"method": "credit_card", "amount": 15480.0, "currency": "JPY", "captured": False},
        "notes": None,
    },
)

ARRAY_OF_OBJECTS = Case(
    name="array_of_objects",
    what="invoice with an array of 5 line-item objects",
    schema=_obj({
        "invoice_number": {"type": "string"},
        "items": {
            "type": "array", "minItems": 1,
            "items": _obj({
                "sku": {"type": "string"},
                "description": {"type": "string"},
                "quantity": {"type": "integer"},
                "unit_price": {"type": "number"},
            }),
        },
        "total": {"type": "number"},
    }),
    document={
        "invoice_number": "INV-88412",
        "items": [
            {"sku": "KB-101", "description": "Mechanical keyboard, brown switches", "quantity": 2,
             "unit_price": 89.99},
            {"sku": "MS-220", "description": "Wireless mouse", "quantity": 3, "unit_price": 24.5},
            {"sku": "MN-270", "description": "27-inch monitor, 1440p", "quantity": 1, "unit_price": 329.0},
            {"sku": "CB-010", "description": "USB-C cable, 2 m", "quantity": 5, "unit_price": 7.25},
            {"sku": "DK-500", "description": "Docking station with ethernet", "quantity": 1,
             "unit_price": 149.0},
        ],
        "total": 800.73,
    },
)

ENUMS = Case(
    name="enums",
    what="support-ticket classification: string enums and an array of enums",
    schema=_obj({
        "category": {"enum": ["billing", "technical", "account", "shipping", "returns", "other"]},
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "sentiment": {"enum": ["very_negative", "negative", "neutral", "positive", "very_positive"]},
        "language": {"enum": ["en", "de", "fr", "es", "it", "pt", "ja", "zh"]},
        "tags": {"type": "array", "items": {"enum": [
            "refund", "late_delivery", "damaged_item", "login", "password_reset", "invoice",
            "subscription", "bug", "feature_request", "escalated"]}},
        "needs_human": {"type": "boolean"},
        "summary": {"type": "string"},
    }),
    document={
        "category": "shipping",
        "priority": "high",
        "sentiment": "negative",
        "language": "de",
        "tags": ["late_delivery", "damaged_item", "refund", "escalated"],
        "needs_human": True,
        "summary": "Package arrived nine days late and the screen was cracked; customer wants a "
                   "full refund.",
    },
)

NUMBERS_WITH_BOUNDS = Case(
    name="numbers_bounded",
    what="sensor reading: integers and numbers with minimum/maximum bounds",
    schema=_obj({
        "sensor_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity_pct": {"type": "integer", "minimum": 0, "maximum": 100},
        "pressure_hpa": {"type": "number", "minimum": 800, "maximum": 1100},
        "battery_pct": {"type": "number", "minimum": 0, "maximum": 100},
        "samples": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}},
        "error_count": {"type": "integer", "minimum": 0},
    }),
    document={
        "sensor_id": 40217,
        "temperature_c": -12.75,
        "humidity_pct": 87,
        "pressure_hpa": 1013.25,
        "battery_pct": 64.5,
        "samples": [0.125, -0.5, 0.992188, -0.03, 0.0, 0.75],
        "error_count": 3,
    },
)

STRING_PATTERN = Case(
    name="string_pattern",
    what="booking with regex-constrained strings (codes, dates, times, phone)",
    schema=_obj({
        "booking_ref": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "departure_time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
        "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-K]$"},
        "passenger": {"type": "string"},
        "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9 ]{6,14}$"},
    }),
    document={
        "booking_ref": "QXF-482913",
        "flight": "LH2037",
        "date": "2025-03-14",
        "departure_time": "07:45",
        "seat": "23C",
        "passenger": "Amelia Rossi",
        "phone": "+39 06 5550 1234",
    },
)

CASES: tuple[Case, ...] = (FLAT_OBJECT, NESTED_OBJECTS, ARRAY_OF_OBJECTS, ENUMS, NUMBERS_WITH_BOUNDS,
                           STRING_PATTERN)


@dataclass(frozen=True)
class Probe:
    """An edge of JSON Schema / JSON itself: ``text`` is valid for ``schema``; does the library let a
    model produce it (compile, walk its tokens, EOS)?"""
    name: str
    schema: dict[str, Any]
    text: str

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, separators=(",", ":"))


PROBES: tuple[Probe, ...] = (
    Probe("bounded number, 7 decimals", {"type": "number", "minimum": -1, "maximum": 1}, "0.9921875"),
    Probe("bounded number, exponent", {"type": "number", "minimum": 0, "maximum": 1000}, "1.5e2"),
    Probe("number, exponent", {"type": "number"}, "6.02e-23"),
    Probe("bounded integer, wide range", {"type": "integer", "minimum": -1000000, "maximum": 1000000}, "-999999"),
    Probe("integer, exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 10}, "9"),
    Probe('string with "\\/" escape', {"type": "string"}, r'"http:\/\/example.com"'),
    Probe('string with "\\u00e9" escape', {"type": "string"}, r'"caf\u00e9"'),
    Probe("string with a raw DEL (0x7f)", {"type": "string"}, '"a\x7fb"'),
    Probe("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 5}, '"abcd"'),
    Probe("pattern with \\d and alternation", {"type": "string", "pattern": "^(\\d{3}|[a-z]+)$"}, '"042"'),
    Probe("format: date-time", {"type": "string", "format": "date-time"}, '"2025-03-14T07:45:00Z"'),
    Probe("format: email", {"type": "string", "format": "email"}, '"a.b@example.com"'),
    Probe("anyOf integer|string", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"x"'),
    Probe("$defs + $ref", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                            "required": ["x"], "additionalProperties": False}},
                           "$ref": "#/$defs/p"}, '{"x":1}'),
    Probe("array minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                      "maxItems": 3}, "[1,2,3]"),
)


def checked_probes() -> list[Probe]:
    """The probes, each text checked to be JSON valid for its schema (formats are not checked)."""
    import jsonschema

    for probe in PROBES:
        jsonschema.Draft202012Validator(probe.schema).validate(json.loads(probe.text))
    return list(PROBES)


def checked_cases(names: list[str] | None = None) -> list[Case]:
    """The cases (those named, in order), each document validated against its schema first."""
    import jsonschema

    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names or [] if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {list(by_name)}")
    chosen = [by_name[n] for n in names] if names else list(CASES)
    for case in chosen:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        jsonschema.Draft202012Validator(case.schema).validate(json.loads(case.document_text))
    return chosen


def main() -> None:
    import argparse

    argparse.ArgumentParser(description="Validate the cases and probes of bench/grammar_backends.py against their "
                                        "schemas (jsonschema) and list them.").parse_args()
    for case in checked_cases():
        print(f"case  {case.name:<18} {len(case.document_text):>4} chars  {case.what}")
    for probe in checked_probes():
        print(f"probe {probe.name:<36} {probe.text!r}")


if __name__ == "__main__":
    main()
