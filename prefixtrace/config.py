"""Where a command's option values come from: flag > environment > config file > default.

The config file is TOML, one table per command (`[serve]`, `[replay]`,
`[db.info]`...), keys spelt like the flags without their dashes
(`cache-memory-gb = 4`, `upstream = ["http://a:8000", "http://b:8000"]`).
It is looked up as `--config FILE` (or `$PREFIXTRACE_CONFIG`), else
`./prefixtrace.toml`, else `$XDG_CONFIG_HOME/prefixtrace/prefixtrace.toml`
(`~/.config/...` when unset). `load_default_map` turns it into click's
`default_map`, checking every table and key against the command tree, so a
typo is an error rather than a silently ignored setting.

Every option also reads an environment variable, `PREFIXTRACE_<COMMAND>_<FLAG>`
(`PREFIXTRACE_REPLAY_TARGET`, `PREFIXTRACE_DB_INFO_JSON`); `serve`'s options
(and `import --db`) also answer to the short `PREFIXTRACE_<FLAG>`
(`PREFIXTRACE_PORT`, `PREFIXTRACE_UPSTREAM`, `PREFIXTRACE_DB`). `mirror_env`
sets these on the command tree.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import click

from prefixtrace.common.errors import InvalidRequest

ENV_PREFIX = "PREFIXTRACE"
CONFIG_NAME = "prefixtrace.toml"
CONFIG_ENV = f"{ENV_PREFIX}_CONFIG"
# Options that also read the short PREFIXTRACE_<FLAG>: all of serve's, and
# import's --db (one PREFIXTRACE_DB for the server and what is imported into it).
SHORT_ENV = {("serve",): None, ("import",): {"db"}}
# Variables that already mean something else, so no option reads them: the
# model cache root (engine/default_model.py), the CPU BLAS switches
# (engine/cpu_runtime.py), the CUDA skinny-GEMM switch (engine/kernels/skinny_gemm.py)
# and the config file itself. `serve --cache-dir` is
# therefore PREFIXTRACE_SERVE_CACHE_DIR only.
RESERVED_ENV = {"PREFIXTRACE_CACHE_DIR", "PREFIXTRACE_OPENBLAS", "PREFIXTRACE_NO_OPENBLAS",
                "PREFIXTRACE_OPENBLAS_PRELOADED", "PREFIXTRACE_SKINNY_GEMM", CONFIG_ENV}


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "prefixtrace" / CONFIG_NAME


def find_config(explicit: str | Path | None = None, cwd: str | Path | None = None) -> Path | None:
    """The config file in effect: `explicit` (which must exist), else
    ./prefixtrace.toml, else the user's; None when there is none."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise InvalidRequest(f"config file {path} does not exist")
        return path.resolve()
    for path in (Path(cwd or ".") / CONFIG_NAME, user_config_path()):
        if path.is_file():
            return path.resolve()
    return None


def _flag_name(param: click.Parameter) -> str:
    """`--cache-memory-gb` -> `cache-memory-gb`; the param's name when it has no long flag."""
    longs = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    return longs[0][2:] if longs else param.name.replace("_", "-")


NOT_CONFIGURABLE = {"print_config"}  # options that only make sense typed on the command line


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.is_eager and not p.hidden
            and p.name not in NOT_CONFIGURABLE]


def _keys(command: click.Command) -> dict[str, click.Option]:
    """Every spelling a config key may take for `command`'s options -> the option."""
    keys: dict[str, click.Option] = {}
    for param in _options(command):
        for spelling in (_flag_name(param), param.name):
            keys[spelling] = keys[spelling.replace("-", "_")] = param
    return keys


# Options that take several values as one comma-separated flag: a TOML list is joined with commas.
COMMA_SEPARATED = {"kv_dense_layers", "allow"}


def _as_typed(param: click.Option, value: Any) -> Any:
    """A TOML scalar click would convert more leniently than the same value typed as a
    flag, turned into that flag's text so that click rejects it the same way:
    `port = 1.5` is refused like `--port 1.5` (click alone truncates it to 1), and
    `port = true` like `--port true` (click alone reads it as 1)."""
    if isinstance(value, bool):
        return value if isinstance(param.type, click.types.BoolParamType) else ("true" if value else "false")
    if isinstance(value, float) and isinstance(param.type, click.types.IntParamType):
        return str(value)
    if isinstance(value, (str, int, float)):
        return value
    return str(value)  # a TOML date or time: as it was written


def _value(param: click.Option, value: Any, where: str, key: str) -> Any:
    if isinstance(value, dict):
        raise InvalidRequest(f"[{where}] {key} takes a value, not a table")
    if param.multiple:
        # `upstream = "http://a"` means a list of one for a repeatable flag.
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) for v in items):
            raise InvalidRequest(f"[{where}] {key} takes a list of values, not nested lists or tables")
        return [_as_typed(param, v) for v in items]
    if isinstance(value, list):
        if param.name in COMMA_SEPARATED and not any(isinstance(v, (dict, list)) for v in value):
            return ",".join(str(v) for v in value)
        raise InvalidRequest(f"[{where}] {key} takes one value, not a list")
    return _as_typed(param, value)


def _convert(table: dict, command: click.Command, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    subcommands = getattr(command, "commands", {})
    # The root's own options (--config) cannot be set in the file: only command tables belong there.
    keys = _keys(command) if where else {}
    for key, value in table.items():
        if key in subcommands:
            name = f"{where}.{key}" if where else key
            if not isinstance(value, dict):
                raise InvalidRequest(f"{key!r} must be a table, [{name}], not a value")
            out[key] = _convert(value, subcommands[key], name)
        elif key in keys:
            param = keys[key]
            out[param.name] = _value(param, value, where, key)
        else:
            known = sorted(f"[{where}.{name}]" if where else name for name in subcommands)
            known += sorted({_flag_name(p) for p in _options(command)}) if where else []
            what = f"[{where}] has no option" if where else "no command"
            raise InvalidRequest(f"{what} {key!r}; expected one of: {', '.join(known) or 'nothing'}")
    return out


def load_default_map(path: str | Path, root: click.Group) -> dict[str, Any]:
    """Reads the TOML config at `path` into a click default_map for `root`;
    an unknown table or key is an InvalidRequest naming the file."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequest(f"config file {path}: {exc}") from exc
    try:
        return _convert(data, root, "")
    except InvalidRequest as exc:
        raise InvalidRequest(f"config file {path}: {exc.message}") from exc


def env_names(path: tuple[str, ...], param: click.Parameter) -> list[str]:
    """The environment variables an option of the command at `path` reads, first wins."""
    flag = _flag_name(param).replace("-", "_").upper()
    names = ["_".join([ENV_PREFIX, *(p.upper() for p in path), flag])]
    if path in SHORT_ENV and (SHORT_ENV[path] is None or param.name in SHORT_ENV[path]):
        names.append(f"{ENV_PREFIX}_{flag}")
    return [n for n in names if n not in RESERVED_ENV]


def mirror_env(group: click.Group, path: tuple[str, ...] = ()) -> None:
    """Gives every option under `group` its environment variables (unless it
    already names its own) and shows them in --help."""
    for name, command in group.commands.items():
        for param in _options(command):
            if param.envvar is None:
                param.envvar = env_names((*path, name), param)
                param.show_envvar = True
        if isinstance(command, click.Group):
            mirror_env(command, (*path, name))


def resolved(ctx: click.Context, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Each parameter of `ctx`'s command: its value and where it came from
    (commandline, environment, config file, default)."""
    names = {"COMMANDLINE": "flag", "ENVIRONMENT": "env", "DEFAULT_MAP": "config", "DEFAULT": "default"}
    out = {}
    for name, value in ctx.params.items():
        if name in skip:
            continue
        source = ctx.get_parameter_source(name)
        out[name] = {"value": _jsonable(value), "source": names.get(source.name, source.name.lower()) if source else None}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value

