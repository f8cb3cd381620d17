"""Command-line flags shared by every ``python -m heygem`` command that takes generation options.

Each config option (heygem.config) becomes one flag, so ``--help`` always
matches configs/default.yaml. heygem.cli and heygem.batch both build their
parsers from here.
"""

from __future__ import annotations

import argparse

from heygem.config import iter_options


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config option; unset flags stay out of the namespace (the config decides)."""
    for section, leaf in iter_options():
        meta = leaf.metadata
        kwargs = {"dest": f"{section}.{leaf.name}", "default": argparse.SUPPRESS, "help": meta["help"],
                  "metavar": leaf.name.upper()}
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
            kwargs.pop("metavar")
        annotation = str(leaf.type)
        if annotation == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        elif annotation.startswith("list"):
            kwargs["nargs"] = 4
            kwargs["type"] = int
            kwargs["metavar"] = "N"
        elif "int" in annotation:
            kwargs["type"] = int
        elif "float" in annotation:
            kwargs["type"] = float
        parser.add_argument(meta["flag"], **kwargs)


def option_overrides(args: argparse.Namespace) -> dict:
    """The config overrides given on the command line, as {"section.name": value}."""
    return {key: value for key, value in vars(args).items() if "." in key}


def add_devices_flag(parser: argparse.ArgumentParser) -> None:
    """``--devices cuda:0,cuda:1``: one job worker per listed device (checked by heygem.jobs.parse_devices)."""
    parser.add_argument("--devices", metavar="LIST", default=None,
                        help="run one job worker per listed device, e.g. cuda:0,cuda:1 (cpu, cuda or cuda:N; "
                             "list a device twice for two workers on it); a job whose options name a device keeps it")
