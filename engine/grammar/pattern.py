"""Regular expressions of JSON-schema ``pattern`` keywords, as the JSON-schema policy reads them.

A small reader for the regex subset schemas use (literals, classes, groups, alternation, quantifiers, anchors) into
a tree that the policy can measure and rewrite: fold a string's length bounds into a pattern
(:meth:`Regex.with_length`), decide whether two patterns can match one string (:meth:`Regex.disjoint`, a product
automaton with Python's search semantics), and write the pattern in the form xgrammar 0.2.9 compiles exactly
(:func:`for_xgrammar`: long repetitions in chunks, which also avoids a mask bug of xgrammar's). The policy
(``engine/grammar/schema/``) says which rewrite applies when.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# One character of a JSON string, as raw text between the quotes: an unescaped character or one escape sequence
# (a surrogate pair is one character, as Python's json counts it; a lone surrogate escape is left out, a subset).
# Flat alternatives keep xgrammar's masks fast; the DEL alternative (raw 0x7f, which the class leaves out) is not
# printable ASCII, which makes xgrammar expand the regex as written instead of building its automaton, whose
# exclusion of every backslash would forbid the escapes.
HEX = "[0-9a-fA-F]"
JSON_CHAR = (
    "(?:"
    + "|".join(
        (
            '[^"\\\\\\x00-\\x1f\\x7f]',
            "\x7f",
            '\\\\["\\\\/bfnrt]',
            "\\\\u[0-9a-cA-CefEF]" + HEX * 3,
            "\\\\u[dD][0-7]" + HEX * 2,
            "\\\\u[dD][89abAB]" + HEX * 2 + "\\\\u[dD][c-fC-F]" + HEX * 2,
        )
    )
    + ")"
)
# An unescaped character only: the bounded-length form past ``exact_length_limit`` (a subset: no escapes).
RAW_CHAR = '[^"\\\\\\x00-\\x1f]'
FORCE_EXPANSION = "\x7f{0}"  # matches nothing, but is not printable ASCII: see JSON_CHAR

SPECIAL = frozenset('"\\') | frozenset(chr(c) for c in range(0x20))


class Unsatisfiable(Exception):
    """Parts of a schema contradict each other: no instance validates against the node."""


class _RegexProblem(Exception):
    pass


_MAX_CODE = 0x10FFFF


@dataclass(frozen=True)
class _Chars:
    """A set of characters: sorted, disjoint, inclusive code point ranges."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, *spans: tuple[int, int]) -> _Chars:
        merged: list[tuple[int, int]] = []
        for low, high in sorted(spans):
            if merged and low <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], high))
            else:
                merged.append((low, high))
        return cls(tuple(merged))

    def __or__(self, other: _Chars) -> _Chars:
        return _Chars.of(*self.ranges, *other.ranges)

    def complement(self) -> _Chars:
        spans, start = [], 0
        for low, high in self.ranges:
            if low > start:
                spans.append((start, low - 1))
            start = high + 1
        if start <= _MAX_CODE:
            spans.append((start, _MAX_CODE))
        return _Chars(tuple(spans))

    def intersects(self, other: _Chars) -> bool:
        i = j = 0
        while i < len(self.ranges) and j < len(other.ranges):
            (a_low, a_high), (b_low, b_high) = self.ranges[i], other.ranges[j]
            if a_low <= b_high and b_low <= a_high:
                return True
            if a_high < b_high:
                i += 1
            else:
                j += 1
        return False


_ANY = _Chars.of((0, _MAX_CODE))
_NON_ASCII = _Chars.of((0x80, _MAX_CODE))
_SPECIAL_CHARS = _Chars.of((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_ORDINARY = _SPECIAL_CHARS.complement()
# Python's re reads \d, \w and \s on str patterns as Unicode classes: (surely in it, possibly in it).
_DIGIT = _Chars.of((0x30, 0x39))
_WORD = _Chars.of((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = _Chars.of((0x09, 0x0D), (0x20, 0x20))
_CLASS_ESCAPES = {
    "d": (_DIGIT, _DIGIT | _NON_ASCII),
    "w": (_WORD, _WORD | _NON_ASCII),
    "s": (_SPACE, _SPACE | _Chars.of((0x1C, 0x1F)) | _NON_ASCII),
}


def _class_escape(letter: str) -> tuple[_Chars, _Chars]:
    """(under, over) approximations of ``\\d``, ``\\D``, ... as Python reads them."""
    under, over = _CLASS_ESCAPES[letter.lower()]
    return (under, over) if letter.islower() else (over.complement(), under.complement())


@dataclass
class _Lit:
    char: str
    text: str


@dataclass
class _Set:
    text: str
    under: _Chars  # characters it surely matches
    over: _Chars  # characters it possibly matches


@dataclass
class _Anchor:
    kind: str  # "^" or "$"


@dataclass
class _Group:
    alt: _Alt
    capturing: bool


@dataclass
class _Quant:
    atom: _Lit | _Set | _Anchor | _Group
    low: int
    high: int | None
    lazy: bool = False
    explicit: bool = False  # written with a quantifier


@dataclass
class _Seq:
    items: list[_Quant]


@dataclass
class _Alt:
    options: list[_Seq]


_RegexNode = _Alt | _Seq | _Quant | _Lit | _Set | _Anchor | _Group


class Regex:
    """A pattern in the regex dialect ECMA-262, Python's ``re`` and xgrammar share, read into a tree.

    It answers what the policy needs: the lengths of full matches, whether the pattern can match without
    characters JSON must escape, whether two patterns can match one string, a version bounded in length. A
    construct the three read differently or xgrammar ignores is a ``problem``. ``text`` writes non-ASCII
    characters as ``\\uXXXX``, which keeps xgrammar on its exact path.
    """

    def __init__(self, pattern: str) -> None:
        self.source = pattern
        self.pos = 0
        self.problem: str | None = None
        self.tree: _Alt = _Alt([])

    @classmethod
    def parse(cls, pattern: str) -> Regex:
        shape = cls(pattern)
        try:
            shape.tree = shape._alternation()
            if shape.pos != len(pattern):
                raise _RegexProblem("an unbalanced ')'")
            _check_anchors(shape.tree, True, True)
        except _RegexProblem as problem:
            shape.problem = str(problem)
        except RecursionError:
            shape.problem = "groups nested too deeply"
        return shape

    @property
    def text(self) -> str:
        return _emit(self.tree)

    @property
    def width(self) -> tuple[int, int | None]:
        return _width(self.tree)

    @property
    def avoids_specials(self) -> bool:
        """Whether some match avoids every character JSON must escape (xgrammar then takes its exact path)."""
        return _avoids_specials(self.tree)

    @property
    def anchored(self) -> tuple[bool | None, bool | None]:
        """Whether every match starts at "^" / ends at "$" (None: some alternatives do, some do not)."""
        return _anchored(self.tree, 0), _anchored(self.tree, -1)

    # ------------------------------------------------------------------ reading

    def _peek(self, ahead: int = 0) -> str:
        index = self.pos + ahead
        return self.source[index] if index < len(self.source) else ""

    def _alternation(self) -> _Alt:
        options = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._sequence())
        return _Alt(options)

    def _sequence(self) -> _Seq:
        items = []
        while self._peek() not in ("", "|", ")"):
            atom = self._atom()
            low, high, lazy, explicit = self._quantifier()
            if isinstance(atom, _Anchor) and explicit:
                raise _RegexProblem("a repeated anchor")
            items.append(_Quant(atom, low, high, lazy, explicit))
        return _Seq(items)

    def _atom(self) -> _Lit | _Set | _Anchor | _Group:
        char = self._peek()
        if char == "(":
            return self._group()
        if char == "[":
            return self._class()
        if char == ".":
            self.pos += 1
            everything_but_newline = _Chars.of((0, 9), (11, _MAX_CODE))
            return _Set(".", everything_but_newline, everything_but_newline)
        if char in ("^", "$"):
            self.pos += 1
            return _Anchor(char)
        if char in ("*", "+", "?") or (char == "{" and self._quantifier_ahead()):
            raise _RegexProblem(f"a quantifier '{char}' with nothing to repeat")
        if char in ("{", "}", "]"):
            raise _RegexProblem(f"a bare '{char}'")
        if char == "\\":
            following = self._peek(1)
            if following and following in "dDwWsS":
                self.pos += 2
                return _Set("\\" + following, *_class_escape(following))
            if following in ("b", "B"):
                raise _RegexProblem(f"a word boundary '\\{following}', which xgrammar does not support")
            value, text = self._char_escape()
            return _Lit(value, text)
        self.pos += 1
        return _Lit(char, _char_text(char))

    def _group(self) -> _Group:
        self.pos += 1
        capturing = True
        if self._peek() == "?":
            if self._peek(1) == ":":
                self.pos += 2
                capturing = False
            elif self._peek(1) in ("=", "!") or (self._peek(1) == "<" and self._peek(2) in ("=", "!")):
                raise _RegexProblem("a lookaround, which xgrammar ignores")
            else:
                raise _RegexProblem("a group modifier '(?'")
        alt = self._alternation()
        if self._peek() != ")":
            raise _RegexProblem("an unclosed '('")
        self.pos += 1
        return _Group(alt, capturing)

    def _class(self) -> _Set:
        self.pos += 1
        negated = self._peek() == "^"
        if negated:
            self.pos += 1
        if self._peek() == "]":
            raise _RegexProblem("a class starting with ']'")
        parts = ["[^" if negated else "["]
        under, over = _Chars(()), _Chars(())
        while self._peek() not in ("]", ""):
            if self._peek() == "[":
                raise _RegexProblem("a '[' inside a class")
            low, text = self._class_member()
            if self._peek() == "-" and self._peek(1) not in ("]", ""):
                self.pos += 1
                high, high_text = self._class_member()
                if not isinstance(low, str) or not isinstance(high, str):
                    raise _RegexProblem("a class range bounded by a class escape")
                if ord(high) < ord(low):
                    raise _RegexProblem("a class range out of order")
                span = _Chars.of((ord(low), ord(high)))
                under, over = under | span, over | span
                parts.append(f"{text}-{high_text}")
                continue
            if isinstance(low, str):
                single = _Chars.of((ord(low), ord(low)))
                under, over = under | single, over | single
            else:
                under, over = under | low[0], over | low[1]
            parts.append(text)
        if self._peek() != "]":
            raise _RegexProblem("an unclosed '['")
        self.pos += 1
        parts.append("]")
        if negated:
            under, over = over.complement(), under.complement()
        return _Set("".join(parts), under, over)

    def _class_member(self) -> tuple[str | tuple[_Chars, _Chars], str]:
        """One class member: its character (or the approximations of a class escape) and its text."""
        char = self._peek()
        if char != "\\":
            self.pos += 1
            return char, _char_text(char)
        following = self._peek(1)
        if following and following in "dDwWsS":
            self.pos += 2
            return _class_escape(following), "\\" + following
        if following == "b":
            self.pos += 2
            return "\b", "\\b"
        return self._char_escape()

    def _char_escape(self) -> tuple[str, str]:
        """The escape at ``pos`` (its backslash): the character and the text to write for it."""
        following = self._peek(1)
        simple = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}
        if following in simple and following:
            if following == "0" and self._peek(2).isdigit():
                raise _RegexProblem("an octal escape")
            self.pos += 2
            return simple[following], "\\" + following
        if following in ("x", "u") and following:
            digits = 2 if following == "x" else 4
            code = self.source[self.pos + 2 : self.pos + 2 + digits]
            if len(code) != digits or any(c not in "0123456789abcdefABCDEF" for c in code):
                raise _RegexProblem(f"a malformed '\\{following}' escape")
            self.pos += 2 + digits
            return chr(int(code, 16)), "\\" + following + code
        if following == "":
            raise _RegexProblem("a trailing backslash")
        if following.isdigit():
            raise _RegexProblem("a backreference")
        if following.isalnum() or following == "_":
            raise _RegexProblem(f"the escape '\\{following}', which regex dialects read differently")
        self.pos += 2
        return following, ("\\" + following) if 0x20 <= ord(following) <= 0x7E else _char_text(following)

    def _quantifier_ahead(self) -> bool:
        return re.match(r"\{\d+(,\d*)?\}", self.source[self.pos :]) is not None

    def _quantifier(self) -> tuple[int, int | None, bool, bool]:
        """The quantifier at ``pos``: (low, high, lazy, whether there is one)."""
        char = self._peek()
        low: int
        high: int | None
        if char in ("*", "+", "?"):
            self.pos += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{":
            match = re.match(r"\{(\d+)(,(\d*))?\}", self.source[self.pos :])
            if match is None:
                raise _RegexProblem("a '{' that is not a quantifier")
            self.pos += match.end()
            low = int(match.group(1))
            high = low if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
            if high is not None and high < low:
                raise _RegexProblem("a quantifier {m,n} with n < m")
        else:
            return 1, 1, False, False
        lazy = self._peek() == "?"
        if lazy:
            self.pos += 1
        if self._peek() in ("*", "+", "?") or (self._peek() == "{" and self._quantifier_ahead()):
            raise _RegexProblem("a quantifier after a quantifier")
        return low, high, lazy, True

    # ------------------------------------------------------------------ uses

    def with_length(self, low: int, high: int | None) -> tuple[str, bool] | None:
        """The pattern narrowed to full matches of ``low`` to ``high`` characters, and whether that is exact.

        Exact when along every alternative one element carries all the variability: that element's quantifier
        bounds move (a single character under a quantifier) or the rule recurses (a group). Otherwise a subset:
        every quantifier is capped so that no match is too long, then one quantifier's minimum is raised. On
        xgrammar's exact path every matched character is one character of the JSON string. None when neither works.
        """
        if self.problem:
            return None
        tree = _bounded(self.tree, low, high)
        exact = tree is not None
        if tree is None:
            tree = capped_to(self.tree, low, high)
        if tree is None:
            return None
        text = for_xgrammar(tree)
        return None if text is None else (text, exact)

    def disjoint(self, other: Regex) -> bool:
        """True when no string matches both patterns, as the validator applies them (a search, not a full match)."""
        if self.problem or other.problem:
            return False
        try:
            return not _Automaton.of(self).meets(_Automaton.of(other))
        except _TooBig:
            return False


def _char_text(char: str) -> str:
    code = ord(char)
    if code > 0xFFFF:
        raise _RegexProblem("a character beyond U+FFFF, which xgrammar's regexes cannot name")
    if 0x20 <= code <= 0x7E:
        return char
    return f"\\u{code:04x}"


def _emit(node: _RegexNode) -> str:
    if isinstance(node, _Alt):
        return "|".join(_emit(o) for o in node.options)
    if isinstance(node, _Seq):
        return "".join(_emit(i) for i in node.items)
    if isinstance(node, _Quant):
        text = _emit(node.atom)
        if not node.explicit and node.low == node.high == 1:
            return text
        if (node.low, node.high) == (0, None):
            quant = "*"
        elif (node.low, node.high) == (1, None):
            quant = "+"
        elif (node.low, node.high) == (0, 1):
            quant = "?"
        elif node.high is None:
            quant = f"{{{node.low},}}"
        elif node.low == node.high:
            quant = f"{{{node.low}}}"
        else:
            quant = f"{{{node.low},{node.high}}}"
        return text + quant + ("?" if node.lazy else "")
    if isinstance(node, _Group):
        return ("(" if node.capturing else "(?:") + _emit(node.alt) + ")"
    if isinstance(node, _Anchor):
        return node.kind
    return node.text


def _width(node: _RegexNode) -> tuple[int, int | None]:
    if isinstance(node, _Alt):
        widths = [_width(o) for o in node.options]
        highs = [h for _, h in widths]
        return min(low for low, _ in widths), None if None in highs else max(h for h in highs if h is not None)
    if isinstance(node, _Seq):
        widths = [_width(i) for i in node.items]
        highs = [h for _, h in widths]
        return sum(low for low, _ in widths), None if None in highs else sum(h for h in highs if h is not None)
    if isinstance(node, _Quant):
        low, high = _width(node.atom)
        top = None if node.high is None or high is None else high * node.high
        return low * node.low, top
    if isinstance(node, _Group):
        return _width(node.alt)
    if isinstance(node, _Anchor):
        return 0, 0
    return 1, 1


def _avoids_specials(node: _RegexNode) -> bool:
    if isinstance(node, _Alt):
        return any(_avoids_specials(o) for o in node.options)
    if isinstance(node, _Seq):
        return all(_avoids_specials(i) for i in node.items)
    if isinstance(node, _Quant):
        return node.low == 0 or _avoids_specials(node.atom)
    if isinstance(node, _Group):
        return _avoids_specials(node.alt)
    if isinstance(node, _Lit):
        return node.char not in SPECIAL
    if isinstance(node, _Set):
        return node.over.intersects(_ORDINARY)
    return True


def _check_anchors(alt: _Alt, at_start: bool, at_end: bool) -> None:
    """Anchors only where nothing can come before ("^") or after ("$"): xgrammar drops the others, Python not."""
    for option in alt.options:
        widths = [_width(item) for item in option.items]
        for index, item in enumerate(option.items):
            before = at_start and all(high == 0 for _, high in widths[:index])
            after = at_end and all(high == 0 for _, high in widths[index + 1 :])
            atom = item.atom
            if isinstance(atom, _Anchor) and not (before if atom.kind == "^" else after):
                raise _RegexProblem(f"a '{atom.kind}' that is not at the {'start' if atom.kind == '^' else 'end'}")
            if isinstance(atom, _Group):
                single = item.high is not None and item.high <= 1
                _check_anchors(atom.alt, before and single, after and single)


def _anchored(alt: _Alt, end: int) -> bool | None:
    verdicts: set[bool | None] = set()
    for option in alt.options:
        items = [i for i in option.items if _width(i) != (0, 0) or isinstance(i.atom, _Anchor)]
        first = items[end] if items else None
        if first is not None and isinstance(first.atom, _Anchor):
            verdicts.add(first.atom.kind == ("^" if end == 0 else "$"))
        elif first is not None and isinstance(first.atom, _Group) and first.low == first.high == 1:
            verdicts.add(_anchored(first.atom.alt, end))
        else:
            verdicts.add(False)
    return verdicts.pop() if len(verdicts) == 1 else None


def _bounded(node: _Alt, low: int, high: int | None) -> _Alt | None:
    """``node`` restricted to matches of ``low`` to ``high`` characters, exactly; None when that is not simple."""
    options = []
    for option in node.options:
        for part in _split_alternatives(option):
            narrowed = _bounded_seq(part, low, high)
            if narrowed is None:
                return None
            if narrowed is not _EMPTY:
                options.append(narrowed)
    if not options:
        raise Unsatisfiable
    return _Alt(options)


def _split_alternatives(seq: _Seq, limit: int = 16) -> list[_Seq]:
    """``seq`` as several sequences, one per alternative of its groups of fixed-width alternatives (a group like
    ``(jpg|jpeg|png)``), while it has more than one element of variable length: the same strings, but each
    sequence then has fewer variable elements, which ``_bounded_seq`` can bound exactly."""
    parts = [seq]
    while len(parts) <= limit:
        split = False
        out = []
        for part in parts:
            variable = [i for i, item in enumerate(part.items) if _width(item)[0] != _width(item)[1]]
            choice = next((i for i in variable if _fixed_choice(part.items[i])), None)
            if len(variable) < 2 or choice is None:
                out.append(part)
                continue
            group = part.items[choice].atom
            assert isinstance(group, _Group)
            for option in group.alt.options:
                alone = _Quant(_Group(_Alt([option]), group.capturing), 1, 1)
                out.append(_Seq([*part.items[:choice], alone, *part.items[choice + 1 :]]))
            split = True
        parts = out
        if not split:
            return parts
    return [seq]


def _fixed_choice(item: _Quant) -> bool:
    """An unrepeated group whose alternatives each have one fixed length (the lengths differ between them)."""
    atom = item.atom
    if not isinstance(atom, _Group) or item.low != 1 or item.high != 1 or len(atom.alt.options) < 2:
        return False
    return all(_width(option)[0] == _width(option)[1] for option in atom.alt.options)


_EMPTY = _Seq([])  # an alternative no string of an allowed length matches (identity matters, not content)


def _bounded_seq(seq: _Seq, low: int, high: int | None) -> _Seq | None:
    width_low, width_high = _width(seq)
    if width_low >= low and (high is None or (width_high is not None and width_high <= high)):
        return seq
    variable = [i for i, item in enumerate(seq.items) if _width(item)[0] != _width(item)[1]]
    fixed = sum(_width(item)[0] for item in seq.items if _width(item)[0] == _width(item)[1])
    if len(variable) != 1:
        return _EMPTY if not variable else None  # all fixed and out of range: no match fits
    index = variable[0]
    item = seq.items[index]
    rest_low, rest_high = low - fixed, None if high is None else high - fixed
    if isinstance(item.atom, _Lit | _Set):
        new_low = max(item.low, rest_low)
        new_high = rest_high if item.high is None else (item.high if rest_high is None else min(item.high, rest_high))
        if new_high is not None and new_high < new_low:
            return _EMPTY
        replaced = _Quant(item.atom, new_low, new_high, item.lazy, True)
    elif isinstance(item.atom, _Group) and item.low == item.high == 1:
        try:
            inner = _bounded(item.atom.alt, max(rest_low, 0), rest_high)
        except Unsatisfiable:
            return _EMPTY
        if inner is None:
            return None
        replaced = _Quant(_Group(inner, item.atom.capturing), 1, 1)
    else:
        return None
    return _Seq([*seq.items[:index], replaced, *seq.items[index + 1 :]])


_AUTOMATON_COUNT_LIMIT = 512
_CHUNK = 64


def for_xgrammar(tree: _Alt) -> str | None:
    """The pattern text xgrammar compiles exactly and in reasonable time, or None.

    Counts above ``_CHUNK`` on one character are written as several counts (``C{1,200}`` as ``C{1,64}C{0,64}...``,
    the same strings): with a count near 150 on a large class, xgrammar 0.2.9's mask allows tokens its matcher then
    refuses (seen in JSONSchemaBench's Github_hard--o79409). Such patterns go to xgrammar's expansion rather than its
    automaton, which grows with the count (4000: seconds; 30000: no end); the expansion excludes nothing itself, so
    there every character set leaves out what JSON must escape explicitly. Where that is not a simple rewrite (``\\S``
    and its kin), the automaton takes counts up to ``_AUTOMATON_COUNT_LIMIT``; beyond, None.
    """
    largest = _largest_count(tree)
    if largest <= _CHUNK:
        return _emit(tree)
    chunked = _chunked(tree)
    expanded = _expansion_text(chunked)
    if expanded is not None:  # also the faster compile: ~1 s against ~13 s for o79409's chunked class
        return f"(?:{expanded}){FORCE_EXPANSION}"
    return _emit(chunked) if largest <= _AUTOMATON_COUNT_LIMIT else None


def _chunked(node: Any) -> Any:
    if isinstance(node, _Alt):
        return _Alt([_chunked(o) for o in node.options])
    if isinstance(node, _Group):
        return _Group(_chunked(node.alt), node.capturing)
    if not isinstance(node, _Seq):
        return node
    items: list[_Quant] = []
    for item in node.items:
        atom = _chunked(item.atom)
        top = item.low if item.high is None else item.high
        if not isinstance(atom, _Lit | _Set) or top <= _CHUNK:
            items.append(_Quant(atom, item.low, item.high, item.lazy, item.explicit))
            continue
        low, high = item.low, item.high
        while (high is None and low > _CHUNK) or (high is not None and high > 0):
            size = _CHUNK if high is None else min(_CHUNK, high)
            part_low = min(low, size)
            items.append(_Quant(atom, part_low, size, False, True))
            low -= part_low
            high = None if high is None else high - size
            if high is None and low <= _CHUNK:
                break
        if high is None:
            items.append(_Quant(atom, low, None, False, True))
    return _Seq(items)


def _largest_count(node: _RegexNode) -> int:
    if isinstance(node, _Alt):
        return max((_largest_count(o) for o in node.options), default=0)
    if isinstance(node, _Seq):
        return max((_largest_count(i) for i in node.items), default=0)
    if isinstance(node, _Quant):
        return max(node.low, node.high or 0, _largest_count(node.atom))
    if isinstance(node, _Group):
        return _largest_count(node.alt)
    return 0


def _expansion_text(node: _RegexNode) -> str | None:
    """The pattern for xgrammar's unrestricted expansion, each character set narrowed to characters that need no
    escaping in JSON (what its automaton would have matched); None where that is not a simple rewrite."""
    if isinstance(node, _Alt | _Seq):
        parts = [_expansion_text(p) for p in (node.options if isinstance(node, _Alt) else node.items)]
        if None in parts:
            return None
        return ("|" if isinstance(node, _Alt) else "").join(p for p in parts if p is not None)
    if isinstance(node, _Quant):
        inner = _expansion_text(node.atom)
        return None if inner is None else _emit(_Quant(_Lit("", inner), node.low, node.high, node.lazy, node.explicit))
    if isinstance(node, _Group):
        inner = _expansion_text(node.alt)
        return None if inner is None else ("(" if node.capturing else "(?:") + inner + ")"
    if isinstance(node, _Anchor):
        return node.kind
    if isinstance(node, _Lit):
        return None if node.char in SPECIAL else node.text
    if node.text == ".":
        return '[^\\x00-\\x1f"\\\\]'
    if node.text.startswith("[^"):
        return node.text[:-1] + '\\x00-\\x1f"\\\\]'
    return None if node.over.intersects(_SPECIAL_CHARS) else node.text


def capped_to(node: _Alt, low: int, high: int | None) -> _Alt | None:
    """A subset of ``node`` whose matches all have ``low`` to ``high`` characters, or None.

    Every quantifier is capped at the largest count that keeps the longest match within ``high``; then, if the
    shortest match is too short, the last quantified single character of a one-alternative pattern repeats more.
    """
    tree = node
    if high is not None:
        best = None
        lo_k, hi_k = 0, max(high, 1)
        while lo_k <= hi_k:
            k = (lo_k + hi_k) // 2
            candidate = _cap_all(node, k)
            top = _width(candidate)[1]
            if top is not None and top <= high:
                best, lo_k = candidate, k + 1
            else:
                hi_k = k - 1
        if best is None:
            return None
        tree = best
    shortest = _width(tree)[0]
    if shortest < low:
        if len(tree.options) != 1:
            return None
        items = tree.options[0].items
        for index in range(len(items) - 1, -1, -1):
            item = items[index]
            if isinstance(item.atom, _Lit | _Set) and item.explicit:
                raised = item.low + (low - shortest)
                if item.high is not None and raised > item.high:
                    continue
                items = [*items[:index], _Quant(item.atom, raised, item.high, item.lazy, True), *items[index + 1 :]]
                tree = _Alt([_Seq(items)])
                break
        else:
            return None
    width_low, width_high = _width(tree)
    if width_low < low or (high is not None and (width_high is None or width_high > high)):
        return None
    return tree


def _cap_all(node: _RegexNode, k: int) -> Any:
    if isinstance(node, _Alt):
        return _Alt([_cap_all(o, k) for o in node.options])
    if isinstance(node, _Seq):
        return _Seq([_cap_all(i, k) for i in node.items])
    if isinstance(node, _Quant):
        atom = _cap_all(node.atom, k)
        if not node.explicit:
            return _Quant(atom, node.low, node.high, node.lazy, node.explicit)
        high = max(node.low, k) if node.high is None else max(node.low, min(node.high, k))
        return _Quant(atom, node.low, high, node.lazy, True)
    if isinstance(node, _Group):
        return _Group(_cap_all(node.alt, k), node.capturing)
    return node


class _TooBig(Exception):
    pass


@dataclass
class _Automaton:
    """A nondeterministic automaton over character sets, for the question "can one string match both?"."""

    edges: list[list[tuple[_Chars | None, int]]]  # state -> [(characters, or None for a free move; target)]
    start: int = 0
    accept: int = 0

    _LIMIT = 4000

    @classmethod
    def of(cls, regex: Regex) -> _Automaton:
        """The strings ``regex`` finds (Python's re.search): free text around an unanchored side, "\\n" after "$"."""
        at_start, at_end = regex.anchored
        if at_start is None or at_end is None:
            raise _TooBig  # mixed anchoring: not worth modelling
        machine = cls([[]])
        state = machine.start
        if not at_start:
            state = machine._loop(state, _ANY)
        state = machine._build(regex.tree, state)
        if at_end:
            final = machine._new()
            machine.edges[state].append((None, final))
            machine.edges[state].append((_Chars.of((10, 10)), final))
            state = final
        else:
            state = machine._loop(state, _ANY)
        machine.accept = state
        return machine

    def _new(self) -> int:
        if len(self.edges) >= self._LIMIT:
            raise _TooBig
        self.edges.append([])
        return len(self.edges) - 1

    def _loop(self, state: int, chars: _Chars) -> int:
        after = self._new()
        self.edges[state].append((None, after))
        self.edges[after].append((chars, after))
        return after

    def _build(self, node: _RegexNode, state: int) -> int:
        if isinstance(node, _Alt):
            end = self._new()
            for option in node.options:
                self.edges[self._build(option, state)].append((None, end))
            return end
        if isinstance(node, _Seq):
            for item in node.items:
                state = self._build(item, state)
            return state
        if isinstance(node, _Quant):
            for _ in range(node.low):
                state = self._build(node.atom, state)
            if node.high is None:
                loop = self._new()
                self.edges[state].append((None, loop))
                self.edges[self._build(node.atom, loop)].append((None, loop))
                return loop
            end = self._new()
            for _ in range(node.high - node.low):
                self.edges[state].append((None, end))
                state = self._build(node.atom, state)
            self.edges[state].append((None, end))
            return end
        if isinstance(node, _Group):
            return self._build(node.alt, state)
        if isinstance(node, _Anchor):
            return state  # checked to sit at the very start or end
        chars = _Chars.of((ord(node.char), ord(node.char))) if isinstance(node, _Lit) else node.over
        end = self._new()
        self.edges[state].append((chars, end))
        return end

    def _closure(self, states: set[int]) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for chars, target in self.edges[stack.pop()]:
                if chars is None and target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)

    def meets(self, other: _Automaton) -> bool:
        """Whether some string is accepted by both automata (over-approximated character sets: may say yes)."""
        start = (self._closure({self.start}), other._closure({other.start}))
        seen, queue = {start}, [start]
        while queue:
            mine, theirs = queue.pop()
            if self.accept in mine and other.accept in theirs:
                return True
            if len(seen) > 20_000:
                raise _TooBig
            for a in mine:
                for chars_a, target_a in self.edges[a]:
                    if chars_a is None:
                        continue
                    for b in theirs:
                        for chars_b, target_b in other.edges[b]:
                            if chars_b is None or not chars_a.intersects(chars_b):
                                continue
                            pair = (self._closure({target_a}), other._closure({target_b}))
                            if pair not in seen:
                                seen.add(pair)
                                queue.append(pair)
        return False


def nested_optional(count: int) -> str:
    """Up to ``count`` JSON characters as nested optionals: xgrammar's masks stay fast, unlike with ``{0,n}``."""
    text = ""
    for _ in range(count):
        text = f"(?:{JSON_CHAR}{text})?"
    return text


# ==================================================================================================== helpers
