"""The sampling fields of an OpenAI (and vLLM) request body beyond temperature and top-k/p:
penalties, ``min_p``, ``logit_bias``, ``bad_words`` and the output's constraint.

The constraint comes from one of OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; two at
once are refused. A ``json_schema`` is enforced whether or not ``strict`` is set (as vLLM does).
Every value is checked for type and size here; whether it compiles is the request front's check
(engine/structured/constraints.py check_structured, off the event loop, under a deadline).
"""
from __future__ import annotations

import json
from typing import Any, Callable

from pdserve.engine.quoting import quoted
from pdserve.engine.sampling_params import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STRUCTURED_BYTES,
                                            SamplingParams, StructuredOutputsParams)
from pdserve.services.api.request_limits import InvalidRequest

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "xgrammar")   # guided_decoding_backend / structured_outputs.backend: what runs here


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}", name)
    try:
        return float(value)
    except OverflowError:
        raise InvalidRequest(f"{name} is out of range, got {quoted(value)}", name) from None


def apply_sampling_fields(body: dict, params: SamplingParams) -> tuple[list[str], str | None]:
    """Penalties, min_p, logit_bias and the constraint onto params (their ranges are the engine's
    check, SamplingParams.validate); returns (bad_words, the field the constraint came from)."""
    params.presence_penalty = _number(body, "presence_penalty", 0.0)
    params.frequency_penalty = _number(body, "frequency_penalty", 0.0)
    params.repetition_penalty = _number(body, "repetition_penalty", 1.0)
    params.min_p = _number(body, "min_p", 0.0)
    params.logit_bias = _logit_bias(body.get("logit_bias"))
    params.structured_outputs, source = structured_of(body)
    return _bad_words(body.get("bad_words")), source


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(value)} entries; the limit is {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for key, bias in value.items():   # JSON's keys are strings: "50256"
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 10:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {quoted(key)}", "logit_bias")
        tok = int(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequest(f"logit_bias[{quoted(key)}] must be a number", "logit_bias")
        out[tok] = float(bias)
    return out


def _bad_words(value: Any) -> list[str]:
    """Strings (their count and sizes: the request front's check, shared with gRPC)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise InvalidRequest("bad_words must be a list of strings", "bad_words")
    return value


def _schema_text(value: Any, name: str) -> str:
    """A JSON schema given as an object (or as its JSON text), as compact JSON text within the size limit."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, bool)):
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    else:
        raise InvalidRequest(f"{name} must be a JSON schema (an object), got {type(value).__name__}", _top(name))
    if len(text) > MAX_STRUCTURED_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_STRUCTURED_BYTES:
        raise InvalidRequest(f"{name} is larger than {MAX_STRUCTURED_BYTES} bytes", _top(name))
    return text


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string", _top(name))
    return value


def _choices(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHOICES or \
            not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(f"{name} must be a list of 1 to {MAX_CHOICES} non-empty strings", _top(name))
    return list(value)


def _top(name: str) -> str:
    """The body's field a dotted name is in (HTTP's param)."""
    return name.split(".", 1)[0]


KIND_READERS: dict[str, Callable[[Any, str], Any]] = {"json": _schema_text, "regex": _text, "choice": _choices,
                                                      "grammar": _text}


def structured_of(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint the body asks for, and the field it came from (None, None: none)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        found.append((_structured_outputs(so), "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        value = body.get(name)
        if value is not None:
            found.append((StructuredOutputsParams(**{kind: KIND_READERS[kind](value, name)}), name))
    if body.get("guided_decoding_backend") not in BACKENDS:
        raise InvalidRequest(f"guided_decoding_backend must be one of auto, xgrammar, got "
                             f"{quoted(body.get('guided_decoding_backend'))}", "guided_decoding_backend")
    if len(found) > 1:
        raise InvalidRequest(f"give one output constraint, got {', '.join(name for _, name in found)}",
                             found[1][1])
    return found[0] if found else (None, None)


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequest("response_format.json_schema must be an object with a schema", "response_format")
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest("response_format.json_schema.strict must be a boolean", "response_format")
        schema = inner.get("schema")
        if schema is None:
            schema = {"type": "object"}   # OpenAI: a name alone asks for any JSON object
        return StructuredOutputsParams(json=_schema_text(schema, "response_format.json_schema.schema"))
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {quoted(kind)}",
                         "response_format")


def _structured_outputs(so: Any) -> StructuredOutputsParams:
    name = "structured_outputs"
    if not isinstance(so, dict):
        raise InvalidRequest(f"{name} must be an object", name)
    if so.get("backend") not in BACKENDS:
        raise InvalidRequest(f"{name}.backend must be one of auto, xgrammar, got {quoted(so.get('backend'))}", name)
    given = {k: v for k, v in so.items() if v is not None and k in (*KIND_READERS, "json_object")}
    unknown = [k for k in so if k not in (*KIND_READERS, "json_object", "backend", "disable_any_whitespace",
                                          "disable_additional_properties", "whitespace_pattern")]
    if unknown:
        raise InvalidRequest(f"{name}.{quoted(unknown[0], 32)} is not supported (json, regex, choice, grammar, "
                             f"json_object)", name)
    if given.get("json_object") is False:
        given.pop("json_object")
    if len(given) != 1:
        raise InvalidRequest(f"{name} must set exactly one of json, regex, choice, grammar, json_object", name)
    kind, value = next(iter(given.items()))
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{name}.json_object must be true", name)
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(**{kind: KIND_READERS[kind](value, f"{name}.{kind}")})
