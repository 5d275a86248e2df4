"""Bounds on the size of what a user hands in, and how an offending value is quoted back.

A setting's range lives with the setting (``config._BOUNDS``); this module bounds what comes before any range can
be checked: the text of a value, the YAML that carries it, and the echo of a bad value in an error line. Without
these a 340-byte config of nested aliases (a "billion laughs") expands to gigabytes when it is built or printed,
an integer of 5,000 digits (or 4,000 hex digits) fails inside the YAML constructor or a record's JSON with a
traceback, ten thousand nested brackets exhaust Python's recursion while composing, and a 300-character file name
fails inside ``os.stat``. Every bound here fails before anything is expanded, loaded or launched, with one line.

``quote`` is the one way a message shows a value the user gave: at most ``QUOTE_CHARS`` of it, with its length
when it was cut, so an error line stays one short line whatever the value.
"""

from __future__ import annotations

import math
import os
import reprlib
from typing import Any

import yaml

from lp_runner.errors import ConfigError

QUOTE_CHARS = 60  # the most characters of a value an error message shows
MAX_VALUE_CHARS = 4096  # a setting's text (PATH_MAX: no path, name or address a setting holds is longer)
MAX_PATH_BYTES = 4095  # a path the kernel takes (PATH_MAX 4096 with its terminating NUL)
MAX_NAME_BYTES = 255  # one file or folder name (NAME_MAX on Linux filesystems)
MAX_INT_DIGITS = 100  # an integer setting's decimal digits, whatever base it is written in (the largest bound is
# 9 digits; a seed fits in 20)
MAX_YAML_NODES = 10_000  # values in a YAML document, its aliases expanded (the full config written out: 125)
_TOO_MANY_DIGITS = 10**MAX_INT_DIGITS  # the least integer of MAX_INT_DIGITS + 1 digits
MAX_YAML_DEPTH = 64  # nested collections in a YAML document (a config is 2 deep; Python's recursion ends near 900)
MAX_CONFIG_BYTES = 1 << 20  # a config file (the full config written out is 1.1 KB)


class _ShortRepr(reprlib.Repr):
    """``reprlib.Repr`` that never builds a long string first: an integer too long to print (Python refuses past
    4300 digits) is named by its size, a long string is cut before ``repr`` sees it; containers show 4 items, 2
    levels deep."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 2, 4, 4, 4, 4
        self.maxother = QUOTE_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() <= 3 * QUOTE_CHARS:  # up to ~54 digits: printed
            return repr(x)
        digits = int(abs(x).bit_length() * 0.30103)  # log10(2): the count, or one less
        return f"<an integer of {digits + (abs(x) >= 10**digits)} digits>"

    def repr_str(self, x: str, level: int) -> str:
        if len(x) <= QUOTE_CHARS:
            return repr(x)
        shown = repr(x[:QUOTE_CHARS])
        return f"{shown[:-1]}...{shown[-1]} ({len(x)} characters)"


_REPR = _ShortRepr()  # configured once, never changed


def quote(value: Any) -> str:
    """``value`` as an error message shows it: its ``repr`` when short, else its start and its size.

    ``quote("abc")`` -> ``'abc'``; ``quote("a" * 300)`` -> ``'aaa...a...' (300 characters)`` (60 of them shown);
    ``quote([[1, 2]] * 100)`` -> ``[[1, 2], [1, 2], [1, 2], [1, 2], ...]``; ``quote(10 ** 5000)`` -> ``<an integer
    of 5001 digits>``. Nested containers are cut at two levels, so the cost is bounded too."""
    return _REPR.repr(value)


_BASES = {"0b": 2, "0o": 8, "0x": 16}


def int_text_digits(text: str) -> tuple[int, int]:
    """(decimal digits, base) of the integer that the YAML 1.1 integer ``text`` names, read off the text without
    converting it: the value's size, not the count of characters, so ``0x`` and 4,000 ``f`` is ~4,817 digits.
    The count is exact in base 10 and at most one over elsewhere (n digits of base b are below b**n).

    ``int_text_digits("1_000")`` -> (4, 10); ``int_text_digits("0x" + "f" * 109)`` -> (132, 16);
    ``int_text_digits("010")`` -> (2, 8) (YAML 1.1 octal 8: one over); ``int_text_digits("1:30")`` -> (3, 60)
    (sexagesimal 90)."""
    body = text.replace("_", "").lstrip("+-")
    base, head = _BASES.get(body[:2].lower(), 10), 2
    if base == 10 and body.startswith("0") and len(body) > 1:
        base, head = 8, 1
    if base == 10 and ":" in body:  # 1:30 = 90: a decimal head, then base-60 places
        first, *places = body.split(":")
        return len(first.lstrip("0")) + math.ceil(len(places) * math.log10(60)), 60
    significant = len(body[head:].lstrip("0")) if base != 10 else len(body.lstrip("0"))
    if base == 10:
        return significant, 10
    return math.floor(significant * math.log10(base)) + 1 if significant else 0, base


def check_int(key: str, value: int) -> None:
    """An integer setting of at most MAX_INT_DIGITS decimal digits (ConfigError naming ``key`` otherwise): past that
    it is a mistake whatever it sets, and past 4,300 digits a record could not even write it."""
    if abs(value) >= _TOO_MANY_DIGITS:
        raise ConfigError(f"{key} must be an integer of at most {MAX_INT_DIGITS} digits, got {quote(value)}")


def check_setting_text(key: str, text: str) -> None:
    """A string setting's text: at most MAX_VALUE_CHARS characters (ConfigError naming ``key`` otherwise)."""
    if len(text) > MAX_VALUE_CHARS:
        raise ConfigError(
            f"{key} is {len(text)} characters long, more than any setting holds ({MAX_VALUE_CHARS}): {quote(text)}"
        )


def check_path_text(what: str, path: str) -> None:
    """A path the run will open: refused in one line when the kernel would refuse it as too long (ENAMETOOLONG),
    before anything is loaded. ``what``: how the message names it (``model.path``, ``--prompts``).

    ``check_path_text("model.path", "a" * 300)`` -> ConfigError (a 300-byte name; at most 255)."""
    raw = os.fsencode(path)
    if len(raw) > MAX_PATH_BYTES:
        raise ConfigError(f"{what} is a path of {len(raw)} bytes, longer than the system takes ({MAX_PATH_BYTES})")
    for name in raw.split(b"/"):
        if len(name) > MAX_NAME_BYTES:
            shown = quote(os.fsdecode(name))
            raise ConfigError(
                f"{what} has a file or folder name of {len(name)} bytes, longer than the system takes "
                f"({MAX_NAME_BYTES}): {shown}"
            )


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, as it composes and before anything is built: a document of more than
    MAX_YAML_NODES values once its aliases are expanded (a billion-laughs file: nine aliases of nine aliases ...
    compose to a few hundred nodes but expand to 9**9 values), a recursive alias, collections nested more than
    MAX_YAML_DEPTH deep (the composer recurses per level: 10,000 ``[`` end in a RecursionError), and an integer of
    more than MAX_INT_DIGITS digits in whatever base it is written (Python's own limit would end in a traceback
    inside the constructor, or in a record's JSON).

    ``where``: how messages name the document ("config file c.yaml", "--set model.path"); a file's line follows.

    Worked example: ``a: &a [x, x]`` then ``b: &b [*a, *a]``: the node of ``b`` counts 1 + 2 x 3 = 7 values (each
    ``*a`` is its list and its two items), so the count grows as the expansion would, while the composer holds each
    aliased node once."""

    def __init__(self, stream: str, where: str) -> None:
        super().__init__(stream)
        self.where = where
        self._sizes: dict[int, int] = {}  # id(node) -> values it expands to (the nodes stay alive: ids are stable)
        self._depth = 0  # collections open around the node being composed

    def _at(self, node: yaml.Node) -> str:
        return f"{self.where}:{node.start_mark.line + 1}" if self.where.startswith("config file") else self.where

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            anchored = self.anchors.get(self.peek_event().anchor)
            if anchored is not None and id(anchored) not in self._sizes:  # named while it is still being composed
                raise ConfigError(f"{self._at(anchored)}: a recursive alias (a value that contains itself)")
        opens = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if opens and self._depth >= MAX_YAML_DEPTH:  # before the composer recurses into it
            line = f":{self.peek_event().start_mark.line + 1}" if self.where.startswith("config file") else ""
            raise ConfigError(
                f"{self.where}{line}: collections nested more than {MAX_YAML_DEPTH} deep, far more than a config holds"
            )
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if id(node) not in self._sizes:  # else an alias: the node it names, counted when it was composed
            if isinstance(node, yaml.ScalarNode):
                children = []
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = [n for pair in node.value for n in pair]
            self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        if self._sizes[id(node)] > MAX_YAML_NODES:
            raise ConfigError(
                f"{self._at(node)}: more than {MAX_YAML_NODES} values once its aliases are expanded, far more "
                "than a config holds"
            )
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits, base = int_text_digits(node.value)
        if digits > MAX_INT_DIGITS:
            written = "" if base == 10 else f" (written in base {base})"
            raise ConfigError(
                f"{self._at(node)}: an integer of {digits} digits{written}, more than any setting takes "
                f"({MAX_INT_DIGITS})"
            )
        return super().construct_yaml_int(node)


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def load_yaml(text: str, where: str, loader: type[BoundedLoader] = BoundedLoader) -> Any:
    """The one YAML document in ``text``, through ``loader`` (a BoundedLoader); ``where`` names it in errors.
    Invalid YAML raises ``yaml.YAMLError`` (the caller says what it was reading); a bound, ConfigError."""
    reader = loader(text, where)
    try:
        return reader.get_single_data()
    finally:
        reader.dispose()
