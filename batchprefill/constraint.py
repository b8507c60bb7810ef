"""What a request's output must match: a JSON Schema, any JSON object, a regex or a choice list, as plain data.

`SamplingParams` (sampling_params.py) carries a `Constraint`; only `engine/grammar.py` turns one into an xgrammar
matcher, so reading settings and partitions never imports the grammar engine, nor any other engine module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

KINDS = ("json_schema", "json_object", "regex", "choice")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message goes into the request's error row."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match, in a canonical text form so equal constraints share one compile."""

    kind: str
    spec: str = ""

    @staticmethod
    def json_schema(schema: str | dict) -> Constraint:
        """A JSON Schema given as a dict or a JSON string, re-serialised compactly so that formatting never
        recompiles. Key order is kept: the grammar writes properties in the schema's order, and a labelling
        schema often puts a reasoning field before the answer on purpose."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise GrammarError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, not {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex must be a non-empty string")
        return Constraint("regex", pattern)

    @staticmethod
    def choice(options: Sequence[str]) -> Constraint:
        options = list(options) if not isinstance(options, str) else [options]
        if not options or not all(isinstance(option, str) and option for option in options):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return Constraint("choice", json.dumps(options))

    @staticmethod
    def from_response_format(response_format: dict | None) -> Constraint | None:
        """OpenAI's `response_format`: `text` (or none) is unconstrained; `json_object` and `json_schema` are."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise GrammarError("response_format must be an object")
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, dict) or "schema" not in body:
                raise GrammarError("response_format json_schema needs json_schema.schema")
            return Constraint.json_schema(body["schema"])
        raise GrammarError(f"response_format type {kind!r}: choose text, json_object or json_schema")


def job_constraint(json_schema: str | None, regex: str | None, choice: Sequence[str] | None) -> Constraint | None:
    """The job-wide constraint of `sampling.json_schema` (a `.json` path or inline JSON), `sampling.regex` or
    `sampling.choice`; at most one may be set. Raises GrammarError, which the entry point turns into a JobError.
    """
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
             if value is not None]
    if len(given) > 1:
        raise GrammarError(f"sampling.{' and sampling.'.join(given)} are both set: choose one constraint")
    if json_schema is not None:
        path = Path(json_schema).expanduser()
        if path.suffix == ".json":
            if not path.is_file():
                raise GrammarError(f"sampling.json_schema file {path} does not exist")
            json_schema = path.read_text()
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint.regex(regex)
    if choice is not None:
        return Constraint.choice(choice)
    return None
