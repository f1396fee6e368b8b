"""facecast's version, from the installed distribution's metadata (pyproject.toml is the source)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("facecast")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
