"""`facecast models install`: MediaPipe's models fetched, verified and unpacked into the model
cache (the work is facecast.models.assets's, shared with `facecast run`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="models_command", required=True)
    install = commands.add_parser("install", help="fetch and verify MediaPipe's models")
    from facecast.models import assets

    assets.add_install_arguments(install)
    install.set_defaults(handler=install_main)


def install_main(args: argparse.Namespace) -> int:
    from facecast.models import assets

    return assets.cli_install(args)
