"""Every note a comment, docstring or document refers to ("Note" and its name in brackets) is
written somewhere (STYLE §9): a note is defined by a line holding "Note" and its bracketed name
alone (in a docstring, or after "# "), and referred to by name only, never "in FILE", which goes
stale when code moves."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"Note\s+\[([^\]]+)\]", re.S)
DEFINITION = re.compile(r"^[ \t]*(?:#[ \t]*)?Note \[([^\]]+)\][ \t]*$", re.M)


def _tracked_text() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "*.sh"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    this_file = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its patterns are no notes
    return {name: (ROOT / name).read_text() for name in names
            if name != this_file and (ROOT / name).is_file()}


def _normalise(name: str) -> str:
    """A reference may wrap inside its brackets: in a comment (a "#" on the next line) or a
    string literal (two literals joined)."""
    return " ".join(re.sub(r'"\s*"|#', " ", name).split())


def test_every_note_referred_to_is_defined() -> None:
    texts = _tracked_text()
    defined = {_normalise(m) for text in texts.values() for m in DEFINITION.findall(text)}
    undefined = sorted({f"{path}: Note [{_normalise(m)}]" for path, text in texts.items()
                        for m in REFERENCE.findall(text) if _normalise(m) not in defined})
    assert defined, "no note definitions found: the pattern no longer matches how notes are written"
    assert not undefined, "notes referred to but defined nowhere:\n" + "\n".join(undefined)


def test_notes_are_referred_to_by_name_only() -> None:
    located = re.compile(r"Note\s+\[[^\]]+\]\)?\s+in\s+`?(?:facecast\.[a-z_.]*[a-z_]|[a-z_/]+\.py)`?")
    stale_prone = sorted(f"{path}: {m}" for path, text in _tracked_text().items()
                         for m in located.findall(text))
    assert not stale_prone, "Note references with a location (they go stale when code moves):\n" \
        + "\n".join(stale_prone)
