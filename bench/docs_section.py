"""docs/benchmarks.md is written by the benchmarks themselves, a section each: this puts one
bench's section in place (from its `## ` title to the next `## ` heading, or the end), or adds it
at the end, and leaves every other section as it was."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, title: str, section: str) -> None:
    """`section` (beginning with its title line, `title`) in place of the file's section of that
    title; a blank line between it and the next one."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = section.rstrip("\n") + "\n"
    begin = text.find(title)
    if begin < 0:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = text.find("\n## ", begin + 1)
    rest = text[end + 1:] if end >= 0 else ""
    path.write_text(text[:begin] + section + ("\n" + rest if rest else ""))
