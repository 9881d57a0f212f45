"""Field-driven settings: one frozen dataclass -> TOML keys, env vars and flags.

Each dataclass field declared with :func:`setting` names its kind (how text and
TOML values become a typed value, and what a valid one is), its help, its env
var and its flag. :class:`Schema` layers values with the precedence

    defaults < TOML file < environment < command line

and turns every coercion failure into the caller's package error, quoting the
bad value and where it came from (``$VAR``, ``--flag`` or ``key in file``).
Construction errors get the origins of the values they name appended. Both the
daemon (``rendezvousd.config``) and the trainer (``rendezvousd.trainer.config``)
are built on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from rendezvousd.common.address import AddressError, parse_address

T = TypeVar("T")
_DEFAULT: Any = object()


class Invalid(ValueError):
    """What is wrong with a value ("must be ..."), without saying where it came from."""


class Kind:
    """How one field's values are checked (strictly, for Python callers), parsed from
    text (env and flags) and written back as text (the defaults in the docs' table)."""

    def check(self, value: Any) -> Any:
        return value

    def from_text(self, text: str) -> Any:
        return text

    def parse(self, raw: object) -> Any:
        if isinstance(raw, str):
            return self.check(self.from_text(raw.strip()))
        return self.check(raw)

    def render(self, value: Any) -> str | None:
        return None if value is None else str(value)


#: The largest value of a C int, which gRPC's channel arguments are.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Int(Kind):
    minimum: int | None = None
    optional: bool = False
    maximum: int | None = None

    def _wants(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"an integer from {self.minimum} to {self.maximum}"
        if self.maximum is not None:
            return f"an integer <= {self.maximum}"
        return "an integer" + (f" >= {self.minimum}" if self.minimum is not None else "")

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise Invalid(f"must be {self._wants()}")
        if self.minimum is not None and value < self.minimum:
            raise Invalid(f"must be {self._wants()}")
        if self.maximum is not None and value > self.maximum:
            raise Invalid(f"must be {self._wants()}")
        return value

    def from_text(self, text: str) -> Any:
        try:
            return int(text)
        except ValueError:
            raise Invalid(f"must be {self._wants()}") from None


@dataclass(frozen=True)
class Float(Kind):
    """A finite number, > 0 (``positive``) or >= 0, and at most ``maximum`` when one is
    given; integers become floats."""

    positive: bool = True
    maximum: float | None = None

    def check(self, value: Any) -> Any:
        wants = "a positive finite number" if self.positive else "a finite number >= 0"
        if self.maximum is not None:
            top = self.maximum
            wants += f" <= {int(top) if float(top).is_integer() else top}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Invalid(f"must be {wants}")
        try:
            value = float(value)
        except OverflowError:  # an integer past any float's range (10**400 in TOML)
            raise Invalid(f"must be {wants}") from None
        if not math.isfinite(value) or value < 0 or (self.positive and value == 0):
            raise Invalid(f"must be {wants}")
        if self.maximum is not None and value > self.maximum:
            raise Invalid(f"must be {wants}")
        return value

    def from_text(self, text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            raise Invalid("must be a number") from None

    def render(self, value: Any) -> str | None:
        return repr(value)


@dataclass(frozen=True)
class Bool(Kind):
    def check(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise Invalid("must be true or false")
        return value

    def from_text(self, text: str) -> Any:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise Invalid("must be true or false (or 1/0, yes/no, on/off)")

    def render(self, value: Any) -> str | None:
        return "true" if value else "false"


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...]
    upper: bool = False

    def check(self, value: Any) -> Any:
        if isinstance(value, str) and self.upper:
            value = value.upper()
        if value not in self.choices:
            raise Invalid(f"is unknown; expected one of {self.choices}")
        return value


@dataclass(frozen=True)
class Text(Kind):
    """A non-empty string (or None when ``optional``)."""

    optional: bool = False

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not isinstance(value, str) or not value.strip():
            raise Invalid("must be a non-empty string")
        return value


#: Why an empty path is refused, for every optional path setting.
EMPTY_PATH = (
    "must be a path, not empty or blank; give the file or directory, or leave the "
    "setting out altogether to leave it unset"
)


@dataclass(frozen=True)
class PathText(Text):
    """A path kept as text, for settings handed on as a string (the trainer's to the SDK
    and its workers): refused when empty or blank in the words ``OptionalPath`` uses."""

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not isinstance(value, str):
            raise Invalid("must be a path")
        if not value.strip():
            raise Invalid(EMPTY_PATH)
        return value


@dataclass(frozen=True)
class OptionalPath(Kind):
    """A filesystem path, or None when the setting is left out.

    Empty or blank text is refused rather than read as unset: an unset ``$CA`` in a
    unit file (``--tls-client-ca "$CA"``) expanded to "" and quietly dropped mTLS, or
    persistence for ``--state-dir``, while the operator believed both were on.
    """

    def check(self, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | Path):
            # Path("") is Path("."), so a Path cannot show an empty string any more.
            if not str(value).strip():
                raise Invalid(EMPTY_PATH)
            return value if isinstance(value, Path) else Path(value)
        raise Invalid("must be a path")


@dataclass(frozen=True)
class AddressText(Kind):
    """A ``host:port`` string, validated by the one address parser and kept as written."""

    what: str
    optional: bool = False
    allow_port_zero: bool = False
    allow_unix: bool = False

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        parse_address(
            value,
            what=self.what,
            allow_port_zero=self.allow_port_zero,
            allow_unix=self.allow_unix,
        )
        return value


def setting(
    default: Any,
    help: str,
    kind: Kind,
    *,
    env: str | None = _DEFAULT,
    flag: str | None = _DEFAULT,
    implies: Mapping[str, Any] | None = None,
    unprefixed: bool = False,
) -> Any:
    """A dataclass field that is also a TOML key, an env var and a flag.

    ``env``/``flag`` default to ``PREFIX_KEY`` and ``--key``; None means none.
    ``unprefixed``: in a sub-table, those defaults come from the field's name alone
    (``PREFIX_NAME``, ``--name``), not from its dotted key.
    ``implies``: sibling values an env var or flag sets along with this one (a
    TOML file states them itself).
    """
    meta = {
        "help": help,
        "kind": kind,
        "env": env,
        "flag": flag,
        "implies": implies or {},
        "unprefixed": unprefixed,
    }
    return field(default=default, metadata=meta)


def table(cls: type[Any], help: str) -> Any:
    """A field holding a nested settings dataclass (defaults: ``cls()``): a TOML sub-table."""
    return field(default_factory=cls, metadata={"help": help, "table": cls})


@dataclass(frozen=True)
class Option:
    key: str  # dotted TOML path below the section, e.g. "rendezvous.endpoint"
    kind: Kind
    default: Any
    help: str
    env: str | None
    flag: str | None
    implies: Mapping[str, Any]


@dataclass(frozen=True)
class Value:
    value: Any
    origin: str


Layer = dict[str, Value]
#: option key -> extra flag names (e.g. torchrun's ``--nnodes`` for ``num_nodes``).
Aliases = Mapping[str, Sequence[str]]


def _dest(flags: Sequence[str]) -> str:
    """Name in an argparse Namespace or a CLI override mapping: from the first flag."""
    return flags[0][2:].replace("-", "_")


def validate(instance: Any, error: type[Exception], prefix: str = "") -> None:
    """Check every plain field of a settings dataclass strictly; call from __post_init__.

    Values are normalised in place (e.g. TOML integers to floats for float fields).
    """
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        wanted = f.metadata.get("table")
        if wanted is not None:
            if not isinstance(value, wanted):
                raise error(f"{prefix}{f.name}={value!r} must be a {wanted.__name__}")
            continue
        kind: Kind | None = f.metadata.get("kind")
        if kind is None:
            continue
        try:
            checked = kind.check(value)
        except ValueError as exc:
            raise error(f"{prefix}{f.name}={value!r} {_reason(exc)}") from None
        if checked is not value:
            # Frozen dataclasses (with or without slots) are set through object.
            object.__setattr__(instance, f.name, checked)


def _reason(exc: ValueError) -> str:
    return str(exc) if isinstance(exc, Invalid) else f"is invalid: {exc}"


class Schema(Generic[T]):
    """The options of a settings dataclass and the layers that fill them."""

    def __init__(
        self,
        cls: type[T],
        error: type[Exception],
        *,
        env_prefix: str = "RENDEZVOUSD_",
        section: str | None = None,
    ) -> None:
        self.cls = cls
        self.error = error
        self.section = section
        self.env_prefix = env_prefix
        self.options: dict[str, Option] = {}
        self.tables: dict[str, type[Any]] = {}
        self._collect(cls, "")

    def _collect(self, cls: type[Any], prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if f.metadata.get("table") is not None:
                self.tables[key] = f.metadata["table"]
                self._collect(self.tables[key], key + ".")
                continue
            meta = f.metadata
            env = meta["env"]
            flag = meta["flag"]
            name = f.name if meta["unprefixed"] else key
            self.options[key] = Option(
                key=key,
                kind=meta["kind"],
                default=f.default,
                help=meta["help"],
                env=self.env_prefix + name.replace(".", "_").upper() if env is _DEFAULT else env,
                flag="--" + name.replace(".", "-").replace("_", "-") if flag is _DEFAULT else flag,
                implies={prefix + k: v for k, v in meta["implies"].items()},
            )

    # ---- layers

    def _coerce(self, option: Option, raw: object, origin: str) -> Value:
        try:
            return Value(option.kind.parse(raw), origin)
        except Invalid as exc:
            raise self.error(f"{origin}={raw!r} is invalid: {option.key} {exc}") from None
        except AddressError as exc:
            raise self.error(_address_refusal(origin, raw, str(exc))) from None
        except ValueError as exc:
            raise self.error(f"{origin}={raw!r} is invalid: {exc}") from None

    def from_toml(self, path: Path, allow_sections: Collection[str] = ()) -> Layer:
        # Here, not at the top: a worker started by the node agent (handed a resolved
        # config) and the launcher without --config read no TOML.
        import tomllib

        try:
            with path.open("rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError:
            raise self.error(f"config file {path} does not exist") from None
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise self.error(f"config file {path} could not be read as TOML: {exc}") from exc
        if self.section is None:
            return self._walk(doc, "", path)
        for key in doc:
            if key != self.section and key not in allow_sections:
                also = f" or one of {sorted(allow_sections)}" if allow_sections else ""
                raise self.error(
                    f"unknown top-level key {key!r} in {path}; expected [{self.section}]{also}"
                )
        return self._walk(doc.get(self.section, {}), "", path)

    def _walk(self, data: object, prefix: str, path: Path) -> Layer:
        where = ".".join(p for p in (self.section, prefix.rstrip(".")) if p) or "top level"
        if not isinstance(data, dict):
            raise self.error(f"{where} in {path} must be a table")
        layer: Layer = {}
        for name, raw in data.items():
            key = prefix + name
            shown = f"{self.section}.{key}" if self.section else key
            if key in self.tables:
                layer.update(self._walk(raw, key + ".", path))
            elif key in self.options:
                layer[key] = self._coerce(self.options[key], raw, f"{shown} in {path}")
            else:
                known = sorted(
                    k[len(prefix) :] for k in [*self.options, *self.tables] if k.startswith(prefix)
                )
                known = [k for k in known if "." not in k]
                # A file written for a newer release reads as a typo otherwise (found by
                # an upgrade review): both causes are named.
                raise self.error(
                    f"unknown key {shown} in {path}; expected one of {known} (a misspelling, "
                    "or a key of a newer rendezvousd: --version says which this is)"
                )
        return layer

    def from_mapping(self, values: Mapping[str, object], origin: str) -> Layer:
        """Values keyed by option key from somewhere else (torchrun's ``--rdzv-conf``);
        an error names ``origin`` and the key."""
        layer: Layer = {}
        for key, raw in values.items():
            if key not in self.options:
                raise self.error(
                    f"unknown key {key!r} in {origin}; expected one of {sorted(self.options)}"
                )
            layer[key] = self._coerce(self.options[key], raw, f"{origin} {key}")
        return self._imply(layer)

    def from_env(self, env: Mapping[str, str]) -> Layer:
        layer: Layer = {}
        for option in self.options.values():
            if option.env is not None and option.env in env:
                layer[option.key] = self._coerce(option, env[option.env], f"${option.env}")
        return self._imply(layer)

    def from_cli(
        self, values: argparse.Namespace | Mapping[str, object], aliases: Aliases | None = None
    ) -> Layer:
        """Flags that were given (None = not given). A Namespace may carry other flags;
        a mapping is meant for us, so an unknown key is an error. ``aliases``: as
        given to :meth:`add_arguments`."""
        strict = not isinstance(values, argparse.Namespace)
        items = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
        by_dest = {_dest(self._flags(o, aliases)): o for o in self.options.values() if o.flag}
        layer: Layer = {}
        for dest, raw in items.items():
            option = by_dest.get(dest)
            if option is None:
                if strict:
                    raise self.error(
                        f"unknown override {dest!r}; expected one of {sorted(by_dest)}"
                    )
                continue
            if raw is not None:
                layer[option.key] = self._coerce(option, raw, self._flags(option, aliases)[0])
        return self._imply(layer)

    @staticmethod
    def _flags(option: Option, aliases: Aliases | None) -> list[str]:
        """An option's flags; aliases come first, so the first alias names the dest."""
        assert option.flag is not None
        return [*(aliases or {}).get(option.key, ()), option.flag]

    def _imply(self, layer: Layer) -> Layer:
        implied: Layer = {}
        for key, value in layer.items():
            for other, setting_ in self.options[key].implies.items():
                implied.setdefault(other, Value(setting_, f"{value.origin} (implied)"))
        return {**implied, **layer}

    # ---- building

    def merge(self, layers: Iterable[Layer]) -> Layer:
        merged: Layer = {}
        for layer in layers:
            merged.update(layer)
        return merged

    def build(self, layers: Iterable[Layer]) -> T:
        merged = self.merge(layers)
        try:
            built: T = self._construct(self.cls, "", merged)
        except self.error as exc:
            keys = getattr(exc, "keys", ())
            # A default refused names no origin, and "the configured node_rank=0" read
            # as a value somebody set: the refusal's advice for a setting never given.
            unset = getattr(exc, "if_unset", {})
            advice = "".join(f"; {said}" for key, said in unset.items() if key not in merged)
            raise self.error(f"{exc}{self._origins(str(exc), merged, keys)}{advice}") from None
        return built

    def _construct(self, cls: type[Any], prefix: str, merged: Layer) -> Any:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if key in self.tables:
                if any(k.startswith(key + ".") for k in merged):
                    kwargs[f.name] = self._construct(self.tables[key], key + ".", merged)
            elif key in merged:
                kwargs[f.name] = merged[key].value
        return cls(**kwargs)

    @staticmethod
    def _origins(message: str, merged: Layer, keys: Sequence[str] = ()) -> str:
        """Where the values a refusal names came from: its ``keys`` when it gave them,
        else the settings whose names its message mentions (a refusal of
        metrics_listen that says "listen on 127.0.0.1" named --listen, not it)."""
        named = [
            f"{key} from {value.origin}"
            for key, value in merged.items()
            if value.origin != "the given config"
            and (
                key in keys
                if keys
                else re.search(rf"(?<![\w.]){re.escape(key.rsplit('.', 1)[-1])}\b", message)
            )
        ]
        return f" ({'; '.join(named)})" if named else ""

    # ---- flags and env for others

    def add_arguments(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *,
        aliases: Aliases | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        """One flag per option; unset flags stay None so TOML and env can apply.

        A flag's argparse type is the option's own parser, so a bad value fails the
        same way as in env or TOML (a value that parses to None, like node_rank
        'auto', stays as text so that None keeps meaning "not given").
        """
        for option in self.options.values():
            if option.flag is None or option.key in exclude:
                continue
            names = self._flags(option, aliases)
            env = f" (env {option.env})" if option.env else ""
            # The field's own default, rendered as the docs' tables render it: --help
            # gave none, and the user had to find 0 or 600 in the docs (a review, h140 F3).
            default = self.rendered_default(option)
            said = f" (default: {default})" if default is not None else ""
            takes: dict[str, Any] = (
                {"action": argparse.BooleanOptionalAction}
                if isinstance(option.kind, Bool)
                else {
                    "type": self._arg_type(option),
                    "metavar": option.key.rsplit(".", 1)[-1].upper(),
                }
            )
            # argparse formats help with %: a literal one ("15 % less") must be doubled.
            text = (option.help + said + env).replace("%", "%%")
            parser.add_argument(*names, dest=_dest(names), default=None, help=text, **takes)

    @staticmethod
    def rendered_default(option: Option) -> str | None:
        """An option's default as the docs' tables and ``--help`` say it; None: unset."""
        return option.kind.render(option.default) if option.default is not None else None

    def _arg_type(self, option: Option) -> Callable[[str], Any]:
        def parse(text: str) -> Any:
            try:
                value = option.kind.parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{text!r} {_reason(exc)}") from None
            return text if value is None else value

        parse.__name__ = option.key
        return parse

    def markdown_table(self) -> str:
        """Every option's TOML key, env var, flag and default, for the docs."""
        rows = ["| TOML key | env var | flag | default | meaning |", "|---|---|---|---|---|"]
        for option in self.options.values():
            default = self.rendered_default(option)
            flag = option.flag or ""
            if flag and isinstance(option.kind, Bool):
                flag = "--[no-]" + flag[2:]
            cells = [
                f"`{option.key}`",
                f"`{option.env}`" if option.env else "",
                f"`{flag}`" if flag else "",
                f"`{default}`" if default is not None else "unset",
                option.help,
            ]
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join(rows) + "\n"


class VersionFlag(argparse.Action):
    """``--version``: ``PROG VERSION`` of the installed package (``version.py``), then
    exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="print the installed rendezvousd version and exit (every node of a job "
            "must run the same one)",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        import sys

        from rendezvousd.common.version import installed_version

        print(f"{parser.prog} {installed_version()}", file=sys.stdout)
        parser.exit()


def _address_refusal(origin: str, raw: object, said: str) -> str:
    """An AddressError's message, which starts ``what='value'``, with the value said
    once, after where it came from: ``$VAR='head' is malformed: …``."""
    head, found, rest = said.partition(f"={raw!r}")
    if found and re.fullmatch(r"[\w.\-]+", head):
        return f"{origin}={raw!r}{rest}"
    return f"{origin}={raw!r} is invalid: {said}"
