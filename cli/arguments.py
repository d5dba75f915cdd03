"""What every fedmed command shares on its command line: one-line refusals, paths the file system can take,
positive numbers and ``key=value`` overrides."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import tomllib


def parse_overrides(text: str, what: str = "--run-config") -> dict[str, Any]:
    """``"a=1 b='x y'"`` -> ``{"a": 1, "b": "x y"}`` (values are TOML; bare words are strings)."""
    from common.settings import ConfigError

    values: dict[str, Any] = {}
    try:
        items = shlex.split(text or "")
    except ValueError as error:  # e.g. "No closing quotation"
        raise ConfigError(f"{what}: {text!r} cannot be split into key=value items ({error})") from None
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{what}: {item!r} is not key=value")
        key, raw = item.split("=", 1)
        try:
            values[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = raw
    return values


def usable_path(what: str, value: str | Path) -> Path:
    """``value`` made absolute; ConfigError naming ``what`` (a run-config key, a command-line option) when the file
    system cannot take it at all: a name too long, a symbolic link loop, a folder that cannot be searched. A path
    that merely does not exist (yet) is fine here: what needs it says so."""
    from common.settings import ConfigError

    try:
        path = Path(value).resolve()
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return path
    except OSError as error:  # ENAMETOOLONG, ELOOP (Python 3.13's resolve), EACCES, ...
        raise ConfigError(f"{what}: {str(value)!r} cannot be used as a path: {error.strerror or error}") from None
    except RuntimeError:  # Python 3.11's resolve() on a symbolic link loop
        raise ConfigError(f"{what}: {str(value)!r} cannot be used as a path: it leads into a symbolic link "
                          "loop") from None
    return path


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line naming the option and value (no usage block: --help has it)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


def positive(kind: type, least: float = 1):
    """An argparse type: a number of ``kind`` of at least ``least`` (the error names the value)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value >= least or value != value:
            raise argparse.ArgumentTypeError(f"{text!r}: it must be at least {least:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def is_path_key(key: str) -> bool:
    return key.endswith(("-dir", "-file", "-path")) or key in ("resume-from", "hospital-keys")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """Relative paths are relative to where the user stands, not to where Flower runs the apps (ConfigError naming
    the key for a path the file system cannot take)."""
    return {k: (str(usable_path(k, v)) if is_path_key(k) and isinstance(v, str) and v else v)
            for k, v in values.items()}
