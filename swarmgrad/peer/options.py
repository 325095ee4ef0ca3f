"""The leaves of a command's config models as flat options: one flag, one ``SWARMGRAD_*`` variable
and one config-file key per leaf field, and the merge of what was given into the models.

How a leaf becomes an option: its key is the field's name with dashes (``inner-steps``), or the
``flag`` of its ``json_schema_extra`` (``identity_path`` -> ``identity``); its flag is ``--KEY``
(``argument`` makes it a positional one), its variable ``SWARMGRAD_KEY`` in capitals with
underscores, its file key KEY. Its help is the field's ``description`` with the default; its check
is the model's own. Nested models are walked (their fields keep their own names: ``--host``, not
``--network-host``). A discriminated union (``strategy: DiLoCo | SyncSGD | GossipSGD``) is one
option naming the member (``--strategy sync``) plus the fields of every member (``--inner-steps``
belongs to diloco). A ``dict`` field is a table: its flag takes one ``KEY=VALUE`` per use
(``--task-option context=256``), its file key and variable (the field's name: ``task-options``)
the whole table; ``json_schema_extra={"keys": ...}`` gives some of its keys flags of their own
(``--lr`` for ``hparams.lr``).

Precedence: flags, then variables, then the config file, then the models' defaults. A model is
built from the values given and nothing else, so ``model_fields_set`` says what was chosen:
a run-level setting left unset is the run's manifest's (``RunConfig.explicit``).

Why our own walker rather than pydantic-settings' CLI: it makes nested flags (``--network.host``)
and has no notion of a union member's fields or of a flag that names a member; typer is the CLI
here (commands/flags.py turns these options into its parameters); and the flat names must stay
what users and scripts already type. It is a small walk over ``model_fields``.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Union

import pydantic
from pydantic_core import PydanticUndefined

from swarmgrad.dht.config import BootstrapConfig
from swarmgrad.errors import ConfigError
from swarmgrad.peer.config import RunConfig
from swarmgrad.peer.peer_config import PeerConfig
from swarmgrad.settings import SettingsError

ENV_PREFIX = "SWARMGRAD_"
Shape = Literal["value", "list", "bool", "table"]
_KEY_TYPES = {"number": float, "integer": int, "string": str, "boolean": bool}


@dataclass(frozen=True)
class Member:
    """The union member an option belongs to: its union's path, tag field and tag."""

    union: tuple[str, ...]
    tag_field: str
    tag: str


@dataclass(frozen=True, eq=False)
class Option:
    """One leaf of a config model, as the command line, the environment and a file name it."""

    key: str  # file key; also the variable's name
    flag_name: str  # the flag without --
    root: str  # which of the command's models it sits in
    path: tuple[str, ...]  # where in that model (a table key is the last part)
    annotation: Any
    shape: Shape
    description: str
    default: Any  # PydanticUndefined: required
    section: str | None  # the nested model it sits in (None: the root's own field)
    short: str | None = None
    argument: str | None = None  # positional, by this name
    member: Member | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    in_table: bool = False  # a key of a table (``hparams.lr``), typed here rather than by the model

    @property
    def flag(self) -> str:
        return self.argument or f"--{self.flag_name}"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper().replace("-", "_")

    @property
    def required(self) -> bool:
        return self.default is PydanticUndefined

    @property
    def help(self) -> str:
        """The description, with the member it belongs to and the default."""
        text = self.description
        if self.member is not None:
            text = f"{self.member.tag}: {text[:1].lower()}{text[1:]}"
        if self.choices is not None:  # a union's tag
            text = f"{text} One of {', '.join(self.choices)}."
        if not self.required and "default" not in text and _worth_showing(self.default):
            text = f"{text.rstrip('.')} (default {format_value(self.default)})."
        return text


def _worth_showing(default: Any) -> bool:
    return not (default is None or default is False or default == [] or default == {})


@dataclass(frozen=True)
class Given:
    """A value as given (a flag's or variable's string, a file's value) and where it came from."""

    value: Any
    origin: str  # "--inner-steps", "environment variable SWARMGRAD_INNER_STEPS", "FILE: key 'k'"


@dataclass
class OptionSet:
    """A command's options: the leaves of its models, in the models' field order."""

    command: str
    roots: dict[str, type[pydantic.BaseModel]]
    options: tuple[Option, ...] = field(init=False)

    def __post_init__(self) -> None:
        found: list[Option] = []
        for root, model in self.roots.items():
            _walk(model, root, (), None, None, found)
        self.options = tuple(found)
        for attribute in ("key", "flag"):
            names = [getattr(option, attribute) for option in found]
            twice = {name for name in names if names.count(name) > 1}
            if twice:
                raise TypeError(f"swarmgrad {self.command}: two fields want the {attribute} {sorted(twice)}")

    def by_key(self, key: str) -> Option | None:
        return next((option for option in self.options if option.key == key), None)

    def from_environment(self, environ: Mapping[str, str]) -> dict[Option, Given]:
        found = {}
        for option in self.options:
            raw = environ.get(option.env)
            if raw is not None and raw.strip():  # an empty variable is an unset one
                found[option] = Given(raw, f"environment variable {option.env}")
        return found

    def build(self, given: Mapping[Option, Given]) -> dict[str, pydantic.BaseModel]:
        """Each model from the values given (flags over variables over the file: merged by the
        caller); a problem is one ConfigError naming where the value came from."""
        return {root: self.build_model(root, given) for root in self.roots}

    def build_model(self, root: str, given: Mapping[Option, Given]) -> pydantic.BaseModel:
        """One of the models (``root``) from the values given for it."""
        return _Builder(self, root, given).build()

    def chosen(self, models: Mapping[str, pydantic.BaseModel]) -> dict[Option, Any]:
        """The options the models set (``model_fields_set`` all the way down), as plain values."""
        values = {}
        for option in self.options:
            value = _chosen_value(models[option.root], option, self.options)
            if value is not _UNSET:
                values[option] = value
        return values


# -- walking the models -------------------------------------------------------------------------


def _walk(model: type[pydantic.BaseModel], root: str, prefix: tuple[str, ...], section: str | None,
          member: Member | None, found: list[Option]) -> None:
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        annotation = _without_none(info.annotation)
        members = _union_members(annotation)
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            _walk(annotation, root, path, section or name, member, found)
        elif members:
            tag_field = _tag_field(members)
            tags = tuple(_tag_of(cls, tag_field) for cls in members)
            default = getattr(info.default, tag_field, None)
            found.append(_option(info, root, (*path, tag_field), annotation=str, section=name, default=default,
                                 choices=tags, metavar="|".join(tags)))
            for cls, tag in zip(members, tags):
                for leaf, leaf_info in cls.model_fields.items():
                    if leaf != tag_field:
                        found.append(_option(leaf_info, root, (*path, leaf), section=name,
                                             member=Member(path, tag_field, tag)))
        else:
            found.append(_option(info, root, path, section=section, member=member))
            for key, spec in _extra(info).get("keys", {}).items():
                found.append(Option(key=key.replace("_", "-"), flag_name=key.replace("_", "-"), root=root,
                                    path=(*path, key), annotation=_KEY_TYPES[spec["type"]], shape="value",
                                    description=spec["description"], default=None, section=section, in_table=True))


def _option(info: pydantic.fields.FieldInfo, root: str, path: tuple[str, ...], *, section: str | None,
            annotation: Any = None, default: Any = PydanticUndefined, member: Member | None = None,
            choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Option:
    extra = _extra(info)
    annotation = _without_none(info.annotation) if annotation is None else annotation
    shape = _shape(annotation)
    name = path[-1] if choices is None else path[-2]
    flag_name = extra.get("flag", name.replace("_", "-"))
    literal = _literal_choices(annotation)
    return Option(
        key=name.replace("_", "-") if shape == "table" else flag_name, flag_name=flag_name, root=root, path=path,
        annotation=annotation, shape=shape, description=info.description or "", section=section,
        default=info.default if default is PydanticUndefined else default, short=extra.get("short"),
        argument=extra.get("argument"), member=member, choices=choices,
        metavar=metavar or extra.get("metavar") or ("|".join(literal) if literal else None),
    )


def _extra(info: pydantic.fields.FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _without_none(annotation: Any) -> Any:
    """``X`` of ``Optional[X]`` (and of ``Annotated[X, ...]``)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return _without_none(rest[0])
    return annotation


def _union_members(annotation: Any) -> list[type[pydantic.BaseModel]]:
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return []
    args = [_without_none(arg) for arg in typing.get_args(annotation)]
    if all(isinstance(arg, type) and issubclass(arg, pydantic.BaseModel) for arg in args):
        return args
    return []


def _tag_field(members: list[type[pydantic.BaseModel]]) -> str:
    """The field every member fixes to a Literal of its own: the union's discriminator."""
    for name in members[0].model_fields:
        if all(name in cls.model_fields and _literal_choices(cls.model_fields[name].annotation) for cls in members):
            return name
    raise TypeError(f"{[cls.__name__ for cls in members]}: a union of models needs a Literal tag field")


def _tag_of(cls: type[pydantic.BaseModel], tag_field: str) -> str:
    return cls.model_fields[tag_field].default


def _literal_choices(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is Literal:
        return tuple(str(arg) for arg in typing.get_args(annotation))
    return ()


def _shape(annotation: Any) -> Shape:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return "bool"
    if origin in (list, tuple):
        return "list"
    if origin is dict:
        return "table"
    return "value"


# -- building the models ------------------------------------------------------------------------


class _Builder:
    """One model from the options given for it."""

    def __init__(self, options: OptionSet, root: str, given: Mapping[Option, Given]):
        self.model = options.roots[root]
        self.options = [option for option in options.options if option.root == root]
        self.given = [(option, given[option]) for option in self.options if option in given]
        self.tags: dict[tuple[str, ...], str] = {}

    def build(self) -> pydantic.BaseModel:
        data = self._data(self.given)
        self._settle_members(data)
        try:
            return self.model.model_validate(data)
        except pydantic.ValidationError as error:
            raise ConfigError(self._describe(_problems(error.errors()))) from None
        except SettingsError as error:
            raise ConfigError(self._describe(_problems(error.problems))) from None

    def _data(self, given: Iterable[tuple[Option, Given]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for option, value in given:
            parsed = parse_value(option, value)
            if option.shape == "table" and isinstance(parsed, dict):
                _get_or_make(data, option.path).update(parsed)
            else:
                _put(data, option.path, parsed)
        return data

    def _settle_members(self, data: dict[str, Any]) -> None:
        """A union member's option needs that member: the one chosen, else the union's default."""
        unions = {option.member.union: option.member for option, _ in self.given if option.member is not None}
        for union, member in unions.items():
            chosen = _get(data, (*union, member.tag_field))
            tag, how = chosen, ""
            if chosen is None:
                tag = self._default_tag(data, union, member.tag_field)
                others = [f"{path[-1]} {value}" for path, value in self._given_tags(data).items() if path != union]
                how = f" (the default for {', '.join(others)})" if others and self._derived(union) else " (the default)"
            for option, value in self.given:
                if option.member is not None and option.member.union == union and tag is not None \
                        and option.member.tag != tag:
                    raise ConfigError(f"{value.origin}: a setting of {union[-1]} {option.member.tag}, but the "
                                      f"{union[-1]} is {tag}{how}")
            if tag is not None:
                self.tags[union] = tag
                _get_or_make(data, union).setdefault(member.tag_field, tag)

    def _given_tags(self, data: dict[str, Any]) -> dict[tuple[str, ...], str]:
        return {option.path[:-1]: _get(data, option.path) for option, _ in self.given
                if option.choices is not None and option.member is None}

    def _derived(self, union: tuple[str, ...]) -> bool:
        """Whether the union's default depends on other settings (its field's default is None)."""
        return _model_field(self.model, union).default is None

    def _default_tag(self, data: dict[str, Any], union: tuple[str, ...], tag_field: str) -> str | None:
        default = _model_field(self.model, union).default
        if default is not None:
            return getattr(default, tag_field)
        try:  # left to the model (RunConfig picks the strategy's averaging)
            built = self.model.model_validate(_without(data, union))
        except (pydantic.ValidationError, ConfigError):
            return None  # said by the full validation
        return getattr(_get_attribute(built, union), tag_field, None)

    def _with_tags(self, data: dict[str, Any], given: list[tuple[Option, Given]]) -> dict[str, Any]:
        for union, tag in self.tags.items():
            if any(option.member is not None and option.member.union == union for option, _ in given):
                _get_or_make(data, union).setdefault(_tag_field_of(self.options, union), tag)
        return data

    # -- what went wrong, and where it came from ------------------------------------------------

    def _describe(self, problems: list[dict[str, Any]]) -> str:
        problem = sorted(problems, key=lambda problem: problem["type"] == "missing")[0]  # wrong values first
        location = self._path_of(tuple(problem["loc"]))
        option = self._option_at(location)
        origins = {option: value.origin for option, value in self.given}
        if problem["type"] == "missing" and option is not None and option not in origins:
            return self._missing(option)
        if option is not None:
            message = self._with_flags(problem_message(problem), option.path[:-1])
            return f"{origins.get(option, option.flag)}: {message}"
        message = self._with_flags(problem_message(problem), location)
        blamed = self._blame(location)
        if blamed is None or blamed[0].flag in message:
            return message
        return f"{blamed[1].origin}: {message}"

    def _missing(self, option: Option) -> str:
        beside = next((value for other, value in self.given if other.path[:-1] == option.path[:-1]), None)
        if len(option.path) > 1 and beside is not None:  # a section given in part
            return f"{beside.origin}: needs {option.flag} too"
        return (f"{option.flag} is required: pass {option.flag}, set {option.env}, or put {option.key} = ... "
                "in the --config file")

    def _path_of(self, location: tuple[Any, ...]) -> tuple[str, ...]:
        """A pydantic location without the tags a union adds (``strategy.diloco.inner_steps``)."""
        path: list[str] = []
        for part in map(str, location):
            if part not in self._all_tags(tuple(path)):
                path.append(part)
        return tuple(path)

    def _all_tags(self, union: tuple[str, ...]) -> set[str]:
        return {option.member.tag for option in self.options if option.member is not None
                and option.member.union == union}

    def _option_at(self, path: tuple[str, ...]) -> Option | None:
        """The option at ``path`` or the longest one above it (a table and its keys)."""
        for length in range(len(path), 0, -1):
            matches = [option for option in self.options if option.path == path[:length]]
            if matches:
                return matches[0]
        return None

    def _blame(self, location: tuple[str, ...]) -> tuple[Option, Given] | None:
        """The given option under ``location`` that first makes the model fail, adding them in
        field order: an error of the model as a whole names the option that did not fit."""
        under = [(option, value) for option, value in self.given if option.path[:len(location)] == location]
        for count in range(1, len(under) + 1):
            try:
                self.model.model_validate(self._with_tags(self._data(under[:count]), under[:count]))
            except (pydantic.ValidationError, ConfigError):
                return under[count - 1]
        return under[-1] if under else None

    def _with_flags(self, message: str, section: tuple[str, ...]) -> str:
        """Field names a model's message uses (``noise_multiplier``) as the flags that set them."""
        for option in self.options:
            leaf = option.path[-1]
            if option.path[:-1] == section and "_" in leaf and option.argument is None:
                message = re.sub(rf"\b{re.escape(leaf)}\b", option.flag, message)
        return message


def _problems(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic's problems, those a nested settings model raised as one SettingsError unfolded
    (located from the outer model)."""
    unfolded = []
    for problem in problems:
        cause = problem.get("ctx", {}).get("error")
        if isinstance(cause, SettingsError):
            unfolded += [{**inner, "loc": (*problem["loc"], *inner["loc"])} for inner in _problems(cause.problems)]
        else:
            unfolded.append(problem)
    return unfolded


def _tag_field_of(options: list[Option], union: tuple[str, ...]) -> str:
    return next(option.member.tag_field for option in options if option.member is not None
                and option.member.union == union)


def _model_field(model: type[pydantic.BaseModel], path: tuple[str, ...]) -> pydantic.fields.FieldInfo:
    info = model.model_fields[path[0]]
    for part in path[1:]:
        info = _without_none(info.annotation).model_fields[part]
    return info


def problem_message(problem: Mapping[str, Any]) -> str:
    """One pydantic problem as words: the cause's message, or pydantic's with the value it got."""
    cause = problem.get("ctx", {}).get("error")
    if isinstance(cause, Exception):
        return str(cause)
    if problem["type"] == "union_tag_invalid":
        ctx = problem.get("ctx", {})
        return f"must be one of {ctx.get('expected_tags')} (got {ctx.get('tag')!r})"
    message = problem["msg"].removeprefix("Value error, ")
    got = problem.get("input")
    if problem["type"] not in ("value_error", "model_type") and not isinstance(got, (dict, list)):
        message += f" (got {got!r})"
    return message


# -- values -------------------------------------------------------------------------------------


def parse_value(option: Option, given: Given) -> Any:
    """A given value in the shape its field takes: lists and tables from strings split at commas
    and spaces (the form of a variable; a flag may be repeated), the rest left to the model."""
    value = given.value
    if option.in_table:  # the table's own type takes any scalar: read it as this key's
        try:
            return pydantic.TypeAdapter(option.annotation).validate_python(value)
        except pydantic.ValidationError as error:
            raise ConfigError(f"{given.origin}: {problem_message(error.errors()[0])}") from None
    if option.shape == "list":
        return _split(value)
    if option.shape == "table" and not isinstance(value, dict):
        table = {}
        for item in _split(value):
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"{given.origin}: expected KEY=VALUE, got {item!r}")
            table[key] = _scalar(text)
        return table
    return value


def _split(value: Any) -> Any:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return [part for item in value for part in re.split(r"[,\s]+", item) if part]
    return value  # the model says what is wrong with it


def _scalar(text: str) -> str | int | float | bool:
    """A table value written on the command line: a number or true/false where it reads as one."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def format_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_UNSET = object()


def _chosen_value(model: pydantic.BaseModel, option: Option, options: tuple[Option, ...]) -> Any:
    """The option's value in ``model`` if set there (each step of its path in ``model_fields_set``;
    a union's tag counts as set with its union), else _UNSET."""
    current: Any = model
    for index, part in enumerate(option.path):
        if isinstance(current, dict):  # a table's own key
            return current.get(part, _UNSET)
        if current is None:
            return _UNSET
        is_tag = option.choices is not None and index == len(option.path) - 1
        if part not in current.model_fields_set and not is_tag:
            return _UNSET
        current = getattr(current, part)
    if current is None:  # set to "none": what leaving it out says (a file has no null)
        return _UNSET
    if option.shape == "table":
        keys = {other.path[-1] for other in options if other.path[:-1] == option.path}
        current = {key: value for key, value in current.items() if key not in keys}
        if not current and keys:  # all of it under the keys' own options
            return _UNSET
    return _plain(current)


def _plain(value: Any) -> Any:
    return pydantic.TypeAdapter(Any).dump_python(value, mode="json")


# -- nested data --------------------------------------------------------------------------------


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _get_attribute(model: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        model = getattr(model, part, None)
    return model


def _get_or_make(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for part in path:
        data = data.setdefault(part, {})
    return data


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    _get_or_make(data, path[:-1])[path[-1]] = value


def _without(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    if len(path) == 1:
        return {key: value for key, value in data.items() if key != path[0]}
    return {**data, path[0]: _without(data.get(path[0], {}), path[1:])}


PEER_OPTIONS = OptionSet("peer", {"run": RunConfig, "peer": PeerConfig})
BOOTSTRAP_OPTIONS = OptionSet("bootstrap", {"bootstrap": BootstrapConfig})
