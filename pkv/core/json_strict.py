"""Strict JSON for request files: numbers kept as their text where an integer rule must judge
them (a float token, an integer of more than MAX_DIGITS digits: Python's int() of a 5000-digit
token fails naming no field), keys given twice refused, nesting bounded (MAX_JSON_DEPTH).
pkv.core.trace_files turns each fault into a message naming file, line and field."""

from __future__ import annotations

import json

MAX_JSON_DEPTH = 64         # nesting of a request file's JSON (a request object is depth 2 or 3)
MAX_DIGITS = 30             # an integer field longer than this is refused before it is converted


class JsonNumber(str):
    """A JSON number that is not an integer token (100.0, 1e3, 2.5), kept as its text."""


class JsonLongInt(str):
    """A JSON integer token of more than MAX_DIGITS digits, kept as its text."""


def json_int(text: str):
    return int(text) if len(text) <= MAX_DIGITS else JsonLongInt(text)


class DuplicateKey(Exception):
    pass


def unique_object(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def strict_loads(text: str):
    doc = json.loads(text, object_pairs_hook=unique_object, parse_float=JsonNumber, parse_constant=JsonNumber,
                     parse_int=json_int)
    if depth(doc) > MAX_JSON_DEPTH:
        raise TooDeep()
    return doc


class TooDeep(Exception):
    pass


def depth(value, level: int = 1) -> int:
    """Nesting depth of a parsed JSON value, stopping once it passes MAX_JSON_DEPTH."""
    if level > MAX_JSON_DEPTH or not isinstance(value, (dict, list)):
        return level
    subs = value.values() if isinstance(value, dict) else value
    return max((depth(v, level + 1) for v in subs), default=level)
