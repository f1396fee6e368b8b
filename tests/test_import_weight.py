"""Import weight, held by a test (issue 20): each process loads only what its work needs. A
worker that never runs a model must not pay for torch at every (re)start (the output worker
imported it through the gallery and restarted in 2.00 s against the 2 s promise), and the CLI's
quick verbs and config loading load neither torch nor pylsl. Each case runs in a fresh
interpreter, so what another test imported does not count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What is imported (a worker kind's entry module, as workers/__main__.py imports it by role, or a
# CLI verb's module), then what must not be loaded after it.
CASES = {
    "output worker": ("import facecast.workers.output.worker", ("torch",)),
    "console worker": ("import facecast.workers.console.worker", ("torch",)),
    "recorder worker": ("import facecast.workers.recorder.worker", ("torch",)),
    "capture worker (shm, CPU)": ("import facecast.workers.capture.worker", ("torch",)),
    "facecast command": ("import facecast.daemon.cli.main", ("torch", "pylsl")),
    "facecast status": ("import facecast.daemon.cli.status", ("torch", "pylsl")),
    "facecast streams": ("import facecast.daemon.cli.streams", ("torch", "pylsl")),
    "facecast check-config": ("from facecast.daemon.cli.main import main; "
                              "assert main(['check-config', 'config/default.toml']) == 0",
                              ("torch", "pylsl")),
    "config loading": ("from facecast.shared import config; "
                       "config.load('config/default.toml'); "
                       "config.load('config/example-lab.toml')", ("torch", "pylsl")),
}


@pytest.mark.parametrize("case", CASES)
def test_a_process_imports_only_what_it_needs(case):
    statement, forbidden = CASES[case]
    probe = (f"import sys; {statement}; "
             f"print('loaded:', *(m for m in {forbidden!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.splitlines()[-1].split()[1:]  # the probe's own last line
    assert not loaded, f"{case}: {statement} loaded {loaded}"
