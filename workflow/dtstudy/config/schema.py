"""The config's JSON schema (workflow/schemas/config.schema.yaml): loading it, a strict validator, and the messages.
The other schemas of workflow/schemas/ (hardware.schema.yaml) are read and checked with the same machinery.

The schema is the one source of truth of every config key and of every strategy's knobs
(`strategy_params.<name>.<knob>`: type, default, range). The validator differs from plain
jsonschema in two ways: it writes the schema's `default`s into the instance, and its
"integer" refuses floats such as 64.0 (jsonschema, following JSON Schema, counts 64.0 as an
integer; a batch size or a worker count of 64.0 would then fail inside every job, or name
run folders `n2.0` that no rule matches). Every error names the config key, the value and
what is allowed. A schema may refer to another file of workflow/schemas/
(`$ref: "config.schema.yaml#/properties/stragglers"`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from dtstudy.errors import ConfigError

SCHEMAS_DIR = Path(__file__).resolve().parents[2] / "schemas"
SCHEMA_PATH = SCHEMAS_DIR / "config.schema.yaml"


def _is_integer(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.lru_cache(maxsize=2)
def validator_class(fill_defaults: bool):
    """The strict validator class, filling defaults or not. jsonschema is imported here, on
    the first validation (an import that takes a noticeable share of a light process's
    start), not by every process that only reads the schema (a run's submitit task, the
    evaluate client)."""
    import jsonschema

    # jsonschema's documented way to change what a type means: redefine it in the type checker
    strict_types = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer)
    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=strict_types)
    if not fill_defaults:
        return strict
    # jsonschema's documented recipe: a validator that also writes `default`s into the instance
    validate_properties = strict.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema:
                    instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(strict, {"properties": set_defaults})


@functools.lru_cache(maxsize=4)
def _parsed(name: str) -> dict:
    # parsed once: every run's knob check reads it (validation copies defaults, never writes it);
    # libyaml's loader where PyYAML has it: several times faster in every launcher and client
    return yaml.load((SCHEMAS_DIR / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _parsed_schema() -> dict:
    return _parsed(SCHEMA_PATH.name)


def load_schema_file(name: str) -> dict:
    """A schema of workflow/schemas/ by file name, "hardware.schema.yaml" (a copy)."""
    return copy.deepcopy(_parsed(name))


@functools.lru_cache(maxsize=1)
def _registry():
    """Where a `$ref` to another schema file ("config.schema.yaml#/...") is read: workflow/schemas/."""
    from referencing import Registry, Resource

    return Registry(retrieve=lambda name: Resource.from_contents(_parsed(name)))


def load_schema() -> dict:
    """The config schema (a copy of the parsed one, the caller may change it)."""
    return copy.deepcopy(_parsed_schema())


def knob_schemas() -> dict[str, dict]:
    """{strategy name: the schema of its knobs, strategy_params.properties.<name>} (a copy)."""
    return copy.deepcopy(_parsed_schema()["properties"]["strategy_params"]["properties"])


def validate_config(config: dict) -> dict:
    """The whole config against the schema, defaults filled in place; returns it."""
    check(config, _parsed_schema(), fill_defaults=True)
    return config


# ----- messages -------------------------------------------------------------------------

_NOUNS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "array": "a list",
    "object": "a mapping",
    "null": "null",
}
_BOUNDED_BY = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern")


def _numeric_range(schema: dict) -> str:
    low = ("[", schema["minimum"]) if "minimum" in schema else ("(", schema.get("exclusiveMinimum"))
    high = ("]", schema["maximum"]) if "maximum" in schema else (")", schema.get("exclusiveMaximum"))
    if low[1] is not None and high[1] is not None:
        return f" in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low[1] is not None:
        return f" {'>=' if low[0] == '[' else '>'} {low[1]}"
    if high[1] is not None:
        return f" {'<=' if high[0] == ']' else '<'} {high[1]}"
    return ""


def allowed(schema: dict) -> str:
    """What `schema` allows, in words: 'an integer >= 1 or null', 'a number in (0, 1]'."""
    if "enum" in schema:
        return "one of " + ", ".join("null" if value is None else str(value) for value in schema["enum"])
    if "oneOf" in schema:
        return " or ".join(allowed(alternative) for alternative in schema["oneOf"])
    types = schema.get("type", [])
    words = []
    for kind in [types] if isinstance(types, str) else types:
        word = _NOUNS[kind]
        if kind in ("integer", "number"):
            word += _numeric_range(schema)
        elif kind == "string" and re.fullmatch(r"\^(\w+)\$", schema.get("pattern", "")):
            word = repr(schema["pattern"][1:-1])  # a pattern of one word is that word
        elif kind == "array" and allowed(schema.get("items", {})):
            word += f" (each item {allowed(schema['items'])})"
        elif kind == "object" and schema.get("required"):
            word += f" with {', '.join(schema['required'])}"
        words.append(word)
    return " or ".join(words)


def _types_in_words(types: str | list[str]) -> str:
    return " or ".join(_NOUNS[kind] for kind in ([types] if isinstance(types, str) else types))


def key_path(path: Iterable[Any]) -> str:
    """('workers', 0) -> 'workers[0]'; ('train', 'batch_size') -> 'train.batch_size'."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    return text or "<top level>"


def _unknown_key(path: tuple, key: str) -> str:
    """How a key the schema does not know is named: a strategy, a strategy's knob, or a key."""
    if path == ("strategy_params",):
        return f"unknown strategy {key!r}"
    if len(path) == 2 and path[0] == "strategy_params":
        return f"unknown knob for strategy {path[1]!r}"
    return f"unknown key {key!r}"


def messages(error, prefix: tuple = (), subject: str = "config key") -> list[str]:
    """One line per problem: "config key 'train.batch_size': 64.0 is not an integer; allowed: ..."
    (`subject`: what names the key, "hardware profile <file>: key")."""
    path = (*prefix, *error.absolute_path)
    value, schema = error.instance, error.schema
    if error.validator == "additionalProperties" and isinstance(value, dict):
        names = sorted(schema.get("properties", {}))
        extras = sorted(set(value) - set(names), key=str)
        return [
            f"{subject} '{key_path((*path, key))}': {_unknown_key(path, key)}; allowed: {', '.join(names) or 'none'}"
            for key in extras
        ]
    if error.validator == "required":
        return [
            f"{subject} '{key_path((*path, key))}' is missing; allowed: "
            f"{allowed(schema.get('properties', {}).get(key, {})) or 'any value'}"
            for key in error.validator_value
            if key not in value
        ]
    if error.validator == "type":
        text = f"{value!r} is not {_types_in_words(error.validator_value)}"
        if allowed(schema) != _types_in_words(error.validator_value):
            text += f"; allowed: {allowed(schema)}"
    elif error.validator in _BOUNDED_BY:
        text = f"{error.message}; allowed: {allowed(schema)}"
    elif error.validator == "oneOf":  # none of the alternatives, or (no context) several
        text = f"{value!r} is not allowed; allowed: {allowed(schema)}{'' if error.context else ', only one of them'}"
    else:
        text = error.message
    return [f"{subject} '{key_path(path)}': {text}"]


def problems(
    instance: Any, schema: dict, prefix: tuple = (), fill_defaults: bool = False, subject: str = "config key"
) -> list[str]:
    """Every problem of `instance` (found at config key `prefix`) against `schema`, one line
    each with its key; `fill_defaults`: also write the defaults in, in place."""
    validator = validator_class(fill_defaults)(schema, registry=_registry())
    errors = sorted(validator.iter_errors(instance), key=lambda e: [str(part) for part in e.absolute_path])
    # a value of the wrong type needs no second line on its range or enum, nor a misspelt
    # key a second one on the required key it was meant to be
    mistyped = {tuple(e.absolute_path) for e in errors if e.validator == "type"}
    misspelt = {tuple(e.absolute_path) for e in errors if e.validator == "additionalProperties"}
    errors = [
        e
        for e in errors
        if (e.validator == "type" or tuple(e.absolute_path) not in mistyped)
        and not (e.validator == "required" and tuple(e.absolute_path) in misspelt)
    ]
    lines = [line for error in errors for line in messages(error, prefix, subject)]
    return list(dict.fromkeys(lines))  # a `required` error per missing key, each listing them all


def check(
    instance: Any,
    schema: dict,
    prefix: tuple = (),
    fill_defaults: bool = False,
    subject: str = "config key",
    title: str = "invalid config",
) -> None:
    """Raise ConfigError listing every problem of `instance` (see `problems`), under `title`
    when there are several."""
    lines = problems(instance, schema, prefix, fill_defaults, subject)
    if len(lines) == 1:
        raise ConfigError(lines[0])
    if lines:
        raise ConfigError(f"{title}:\n  " + "\n  ".join(lines))
