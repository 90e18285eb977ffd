"""Class labels against a fleet's model spec, on the client side: names, parsing, the wire field.

    class_names(spec)            -> ["airplane", ...] ("0", "1", ... for a class spec without names; [])
    name_of(spec, label)         -> "airplane" ("?" for -1, the label unknown)
    parse_labels("cat,dog,?", spec) -> [3, 5, -1]  (names or indices; ValueError naming the bad entry)
    label_field(spec)            -> "digits" for a ten-class fleet (v1), else "labels"
    job_labels(spec, classes)    -> {"digits": classes} or {"labels": classes}: JobRequest keywords

Which field a job request names its labels with: `digits` on a fleet of ten classes (every label fits the
v1 field, and a coordinator older than `labels` refuses unknown keys), `labels` for any other class count
(only a coordinator that knows `labels` serves such a fleet). Needs only `schemas`.
"""

from __future__ import annotations

import re

from schemas.messages import UNCONDITIONAL
from schemas.spec import ModelSpec

#: Tokens that mean "label unknown" (-1: an unconditional image; the router alone picks the experts).
UNKNOWN_TOKENS = ("?", "-1")


def class_names(spec: ModelSpec) -> list[str]:
    """The spec's class names; "0", "1", ... for a class spec without names; [] when unconditional."""
    cond = spec.conditioning
    if cond.kind != "class":
        return []
    return list(cond.class_names) if cond.class_names is not None else [str(i) for i in range(cond.num_classes)]


def name_of(spec: ModelSpec, label: int, names: list[str] | None = None) -> str:
    """The display name of class `label` of `spec` ("?" for -1, the label unknown); `names`: class_names(spec)
    when already at hand."""
    if label < 0:
        return "?"
    names = class_names(spec) if names is None else names
    return names[label] if label < len(names) else str(label)


def label_field(spec: ModelSpec) -> str:
    """ "digits" for a fleet of ten classes (v1-compatible), else "labels" (see the module docstring)."""
    return "digits" if spec.conditioning.kind == "class" and spec.num_classes == 10 else "labels"


def job_labels(spec: ModelSpec, classes: list[int]) -> dict[str, list[int]]:
    """JobRequest keywords carrying `classes` under the field the fleet takes: {"digits": ...} or {"labels": ...}."""
    return {label_field(spec): [int(c) for c in classes]}


def parse_labels(text: str, spec: ModelSpec) -> list[int]:
    """ "3,7,?" or "cat, dog" -> class indices (-1 for "?" or "-1") of `spec`'s classes.

    Entries are separated by commas or semicolons (names may then hold spaces), else by spaces. An entry is
    looked up as a class name (exactly, then ignoring case when that is unambiguous), then read as an index
    0..num_classes-1. Raises ValueError naming the first entry that is no class of the fleet."""
    text = text.strip()
    tokens = re.split(r"\s*[,;]\s*", text) if ("," in text or ";" in text) else text.split()
    tokens = [t.strip() for t in tokens if t.strip()]
    names = class_names(spec)
    if not tokens:
        raise ValueError(f"give at least one class, e.g. --labels {','.join(names[:3]) or '?'}")
    exact = {n: i for i, n in reversed(list(enumerate(names)))}
    folded: dict[str, int | None] = {}
    for i, n in enumerate(names):
        folded[n.casefold()] = None if n.casefold() in folded else i
    out = []
    for tok in tokens:
        if tok in UNKNOWN_TOKENS:
            out.append(UNCONDITIONAL)
        elif tok in exact:
            out.append(exact[tok])
        elif folded.get(tok.casefold()) is not None:
            out.append(folded[tok.casefold()])
        elif tok.isascii() and tok.isdigit() and int(tok) < len(names):
            out.append(int(tok))
        elif not names:
            raise ValueError(f"{tok!r}: this fleet is unconditional (no classes): use ? or --unconditional --count N")
        else:
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            raise ValueError(
                f"{tok!r} is not a class of this fleet: give class names ({shown}) or indices 0-{len(names) - 1}, "
                "separated by commas (? = label unknown)"
            )
    return out
