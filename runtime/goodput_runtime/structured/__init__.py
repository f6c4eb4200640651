"""Structured output: grammars that constrain sampling (JSON, JSON Schema, regex, choices, EBNF/Lark)
and the parsers that turn a model's text into tool calls."""
