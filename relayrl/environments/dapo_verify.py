r"""DAPO's answer check (`env.math.math_verify_impl: dapo_math_verify`), relayrl's own implementation.

DAPO (and NeMo RL's `dapo_math_verify`, after verl's `math_dapo`) does not parse mathematics: the response's last
`Answer: ...` line, read from its final 300 characters, and the ground truth are both normalised the way the Minerva
paper normalises final answers (units and filler words dropped, `\text{}` / `\boxed{}` unwrapped, `\frac12` spelt
out, thousands separators removed) and must then be the same string. Pure string work: no sympy, no child process,
nothing that can hang, so it runs inline. Prompts that ask for `Answer: $X` (DAPO-Math-17k's do) fit it.
"""

from __future__ import annotations

import re

__all__ = ["dapo_answer", "dapo_score", "normalize_final_answer"]

#: Only the end of a response is read: long chains of thought often contain earlier, wrong `Answer:` lines.
TAIL_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
#: (old, new) replacements, in order: articles, dollar signs, spaces, spelt-out `and` between list items.
_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
#: Units, filler words and LaTeX spacing removed outright (after _REPLACE).
_REMOVE = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents degrees cm "
    "gm pounds meters meals edges students childrentickets multiples"
).split() + [
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
]
#: (pattern, replacement) applied in order: keep the math between dollars, unwrap text-like commands, expand
#: shorthand fractions and roots.
_REWRITE = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def normalize_final_answer(text: str) -> str:
    """A final answer in the canonical string form both sides are compared in (see the module docstring)."""
    text = text.split("=")[-1]  # `x = 5` answers 5
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for word in _REMOVE:
        text = text.replace(word, "")
    for pattern, repl in _REWRITE:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():  # 1,000 -> 1000
        text = text.replace(",", "")
    return text.strip()


def dapo_answer(response: str) -> str | None:
    """The normalised content of the last `Answer:` line of the response's tail, or None when it has none."""
    found = _ANSWER.findall(response[-TAIL_CHARS:])
    return normalize_final_answer(found[-1]) if found else None


def dapo_score(response: str, ground_truth: str) -> tuple[float, str | None]:
    """(1.0 or 0.0, the extracted answer): 1.0 when the answer equals the normalised ground truth."""
    answer = dapo_answer(response)
    if answer is None:  # DAPO compares the placeholder "[INVALID]", which no real ground truth equals
        return 0.0, None
    return (1.0 if answer == normalize_final_answer(ground_truth) else 0.0), answer
