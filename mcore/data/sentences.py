"""Rule-based sentence splitting for ``mcore-preprocess-data --split-sentences`` (no download, no model).

Megatron-LM splits with NLTK's pretrained punkt model, which NLTK downloads at run time. mcore uses the
rules below instead, modeled on punkt's boundaries and on the way its slices treat whitespace, but
without its learned statistics (not compared against punkt output: NLTK's models are not available
here). Where the two disagree, the difference is in where a boundary falls, never in the text: the
sentences of a text concatenate back to it, less the whitespace between them (kept with
``--keep-newlines``).

A boundary follows a run of sentence-final punctuation ``. ! ? …`` plus any closing quotes or brackets
(``" ' ” ’ » ) ] }``), when whitespace comes next, unless

* the next word starts with a lower-case letter ("e.g. this", "approx. five", "... and so"), or
* the run is a single ``.`` ending a known abbreviation (:data:`ABBREVIATIONS`, case-insensitive: titles,
  "etc", "vs", "fig", "no", months ...), a single letter (an initial, "J. Smith"), or short letter
  groups joined by periods ("U.S.", "e.g.", "Ph.D."; not "3.14").

CJK full stops ``。 ！ ？ ．`` (with closing ``」 』 ） ” ’``) end a sentence whether or not whitespace follows.
Decimal numbers, URLs, e-mail addresses and "3.14" never split (no whitespace after the period).

Limits, all on purpose to keep the rules predictable: a line break alone never ends a sentence (as with
punkt: a heading without final punctuation joins the next sentence); an abbreviation that really ends a
sentence ("... in the U.S. The next") does not split; an unknown abbreviation followed by a capitalised
word ("Gen. Smith") does; no language-specific model (give ``--lang`` only ``english``).

Whitespace, as punkt's slices: without ``keep_newlines`` the whitespace between two sentences belongs to
neither (a sentence's inner line breaks stay); with ``keep_newlines`` (Megatron's ``--keep-newlines``) it
stays at the end of the sentence before it, so that the sentences concatenate back to the text, trailing
whitespace of the text excepted. Whitespace before the first sentence stays with it in both modes.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    """
    mr mrs ms mx dr prof sr jr st mt rev hon gen col capt lt sgt cmdr gov sen rep pres supt fr
    etc vs cf al approx ca esp incl viz fig figs eq eqs no nos vol vols pp ed eds ch sec dept univ
    inc ltd co corp bros assn est
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
    """.split()
)
"""Words that a following period does not end a sentence after (lower case, without the period)."""

_CLOSERS = "\"'”’»)\\]}"
_WESTERN_END = re.compile(rf"(?P<end>[.!?…]+)(?P<close>[{_CLOSERS}]*)(?P<space>\s+)(?=(?P<next>\S))")
_CJK_END = re.compile(r"(?P<end>[。！？．]+)(?P<close>[」』）”’]*)(?P<space>\s*)(?=(?P<next>\S))")
_OPENERS = "\"'“‘«([{"
_DOTTED = re.compile(r"(?:[^\W\d_]{1,4}\.)+[^\W\d_]{1,4}")  # letters with inner periods


def _is_abbreviation(text: str, period_at: int) -> bool:
    """Whether the word that ends at ``text[period_at] == '.'`` is an abbreviation or an initial."""
    start = period_at
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:period_at].lstrip(_OPENERS)
    if not word:
        return False
    if _DOTTED.fullmatch(word):  # U.S. / e.g. / Ph.D. (not 3.14)
        return True
    if len(word) == 1 and word.isalpha():  # an initial
        return True
    return word.lower() in ABBREVIATIONS


def _boundaries(text: str) -> list[re.Match[str]]:
    matches = [m for m in _WESTERN_END.finditer(text) if _ends_sentence(text, m)]
    matches += list(_CJK_END.finditer(text))
    matches.sort(key=lambda m: m.start())
    return matches


def _ends_sentence(text: str, match: re.Match[str]) -> bool:
    if match.group("next").islower():
        return False
    if match.group("end") == ".":
        return not _is_abbreviation(text, match.start("end"))
    return True


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of ``text`` by the module's rules; ``[]`` for a text that is only whitespace.

    Args:
        text: one document.
        keep_newlines: keep the whitespace after each sentence (Megatron's ``--keep-newlines``) instead
            of dropping it.
    """
    sentences: list[str] = []
    start = 0
    for match in _boundaries(text):
        if match.start() < start:  # overlapping candidates (e.g. "。" inside a western run)
            continue
        stop = match.end() if keep_newlines else match.end("close")
        if text[start:stop].strip():
            sentences.append(text[start:stop])
        start = match.end()
    last = text[start:].rstrip()
    if last.strip():
        sentences.append(last)
    return sentences
