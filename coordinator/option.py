"""One declared setting of the coordinator: its dataclass field, flag, help, bounds or choices, and
what they generate: the argparse flag, the range check with its error message, and the flag's value
for a child's command line. `coordinator.config` declares every setting once with `option(...)`;
nothing else retypes a flag name or a bound.

    @dataclass
    class EngineSettings(Settings):
        route_every: int = option(1, "ask the router every N evaluations ...", metavar="N", number=int, low=1)

Building a group (`EngineSettings(route_every=0)`) checks every field and raises ValueError naming the
flag: "--route-every must be an integer >= 1, got 0". The flag is the field's name with dashes
(`--route-every`) unless `flag=` spells it otherwise (`step_timeout`: `--step-timeout-s`, seconds
said in the name like `--lease-s`); `deprecated=` lists older spellings, still accepted with a warning
(bus.options.add_deprecated_alias). A setting with `kind="none"` has no flag and its errors name the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The key of a field's `Option` in its dataclass metadata.
_KEY = "coordinator_option"


@dataclass(frozen=True)
class Option:
    """How one setting is checked and offered on the command line (see the module docstring)."""

    help: str
    kind: str = "value"  # "value" | "switch" (--x / --no-x) | "flag" (store_true) | "nats" | "none" (no flag)
    metavar: str | None = None
    number: type | None = None  # int, float (never a bool) or bool: the value must be one of that kind
    low: float | None = None  # the least value (a string's shortest length)
    high: float | None = None  # the largest value (a string's longest length)
    above: bool = False  # the value must exceed `low`
    unit: str = ""  # "seconds": "must be a number of seconds > 0"
    why: str = ""  # what the bounds mean, said in the error
    choices: tuple = ()
    none: str = ""  # what None means; None is refused when ""
    zero_is_none: bool = False  # on the command line 0 means None
    parse: Callable | None = None  # the argparse `type` (default: `number`)
    convert: Callable | None = None  # normalizes the value before the check; its ValueError names the flag
    spelled: str = ""  # the flag, when it is not the field's name with dashes (given as `flag=` to `option`)
    deprecated: tuple[str, ...] = ()  # older spellings of the flag (kind "value"), accepted with a warning
    name: str = ""  # the field's name (filled in by `options_of`)

    @property
    def flag(self) -> str:
        if self.kind == "none":
            return ""
        return self.spelled or "--" + self.name.replace("_", "-")

    @property
    def label(self) -> str:
        """What an error names: the flag, or the field of a setting without one."""
        return self.flag or self.name

    # ------------------------------------------------------------ the check
    def checked(self, value: Any) -> Any:
        """`value`, normalized by `convert`; ValueError naming the flag when it is out of bounds."""
        if self.convert is not None:
            try:
                value = self.convert(value)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{self.label}: {err}") from None
        if value is None and self.none:
            return value
        if not self._fits(value):
            raise ValueError(f"{self.label} must be {self.wanted()}, got {value!r:.80}")
        return value

    def _fits(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if self.kind in ("switch", "flag") or self.number is bool:
            return isinstance(value, bool)
        if self.number is not None:
            kinds = (int,) if self.number is int else (int, float)
            return not isinstance(value, bool) and isinstance(value, kinds) and self._within(value)
        if self.low is not None:  # a string of bounded length
            return isinstance(value, str) and self._within(len(value))
        return True

    def _within(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.above else value >= self.low)
        return low_ok and (self.high is None or value <= self.high)

    def wanted(self) -> str:
        """What the value must be, as the error says it: "an integer >= 1", "a number of seconds > 0 (...)"."""
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        elif self.kind in ("switch", "flag") or self.number is bool:
            text = "True or False"
        elif self.number is int:
            text = f"an integer >= {self.low}" if self.high is None else f"an integer in {self.low}-{self.high}"
        elif self.number is float:
            text = "a number" + (f" of {self.unit}" if self.unit else "")
            if self.high is not None:
                text += f" in [{self.low:g}, {self.high:g}]"
            else:
                text += f" {'>' if self.above else '>='} {self.low:g}"
        else:
            text = f"{self.low}-{self.high} characters"
        notes = [
            self.why,
            f"{self.flag} / --no-{self.flag[2:]}" if self.kind == "switch" else "",
            f"0 on the command line: {self.none}" if self.zero_is_none else "",
        ]
        notes_text = "; ".join(n for n in notes if n)
        return text + (f" ({notes_text})" if notes_text else "")

    # ------------------------------------------------------------ the command line
    def add(self, parser: argparse.ArgumentParser, default: Any) -> None:
        """Declare the flag on `parser` with `default` (in the flag's terms, `to_cli`)."""
        from bus.options import add_deprecated_alias, add_nats_option, add_switch

        if self.deprecated and self.kind != "value":
            raise TypeError(f"{self.flag}: only a flag that takes a value has deprecated spellings")
        if self.kind == "nats":
            add_nats_option(parser) if default is None else add_nats_option(parser, default=default)
        elif self.kind == "switch":
            add_switch(parser, self.flag[2:], default=bool(default), help=self.help, dest=self.name)
        elif self.kind == "flag":
            parser.add_argument(self.flag, action="store_true", default=bool(default), dest=self.name, help=self.help)
        else:
            kwargs: dict[str, Any] = dict(default=default, dest=self.name, help=self.help)
            if self.parse or self.number:
                kwargs["type"] = self.parse or self.number
            if self.choices:
                kwargs["choices"] = self.choices
            elif self.metavar:
                kwargs["metavar"] = self.metavar
            parser.add_argument(self.flag, **kwargs)
            for old in self.deprecated:
                alias = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar")}
                add_deprecated_alias(parser, old, self.flag, dest=self.name, **alias)

    def cli_default(self, base: Any) -> Any:
        """The flag's default on `ddm-fleet coordinator`: the field's in `base`, in the flag's terms."""
        return self.to_cli(getattr(base, self.name))

    def to_cli(self, value: Any, config: Any = None) -> Any:
        """The flag's value for the field's `value` (`config`: the settings it belongs to)."""
        return 0 if self.zero_is_none and value is None else value

    def from_cli(self, value: Any) -> dict[str, Any]:
        """The fields (name -> value) a parsed flag value sets."""
        return {self.name: None if self.zero_is_none and value == 0 else value}

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give the flag `value`."""
        if self.kind == "switch":
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.kind == "flag":
            return [self.flag] if value else []
        return [self.flag, str(value)]


def option(
    default: Any,
    help: str = "",
    *,
    cls: type[Option] = Option,
    flag: str = "",
    deprecated: tuple[str, ...] = (),
    **how: Any,
) -> Any:
    """A dataclass field with its `Option` (`cls` for a flag read in its own way; `flag`: the flag when
    it is not the field's name with dashes; `deprecated`: older spellings, accepted with a warning)."""
    return dataclasses.field(
        default=default, metadata={_KEY: cls(help=help, spelled=flag, deprecated=tuple(deprecated), **how)}
    )


@functools.cache
def options_of(settings: type) -> dict[str, Option]:
    """The named `Option` of every field of a settings dataclass, in declaration order."""
    return {f.name: dataclasses.replace(f.metadata[_KEY], name=f.name) for f in dataclasses.fields(settings)}


class Settings:
    """A group of declared settings (a dataclass of `option` fields), checked once built."""

    def __post_init__(self) -> None:
        for name, opt in options_of(type(self)).items():
            setattr(self, name, opt.checked(getattr(self, name)))
