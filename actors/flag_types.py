"""argparse value types shared by the server's flag modules."""

from __future__ import annotations

import argparse
import os


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def auto_on_off(text: str) -> bool | None:
    """auto → None (the device's default), on → True, off → False."""
    choices: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
    if text not in choices:
        raise argparse.ArgumentTypeError("must be auto, on or off")
    return choices[text]


def port_number(text: str) -> int:
    """A TCP port; 0 asks the system for a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be a port from 0 to 65535")
    return value


def path_arg(text: str) -> str:
    """A path flag's value with a leading `~` expanded, as the shell would have done for an
    unquoted one (a quoted "~/x" would otherwise be a directory named `~` in the working one)."""
    return os.path.expanduser(text)
