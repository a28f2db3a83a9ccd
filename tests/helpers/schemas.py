"""A small JSON schema a random-weight model finishes within a few dozen tokens: a
bounded string, a bounded integer and an enum (tests of structured outputs)."""

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "blue"]},
    },
    "required": ["name", "n", "color"],
    "additionalProperties": False,
}
