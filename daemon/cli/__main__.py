"""``python -m facecast.daemon.cli``: the `facecast` command (the installed script's entry)."""

import sys

from facecast.daemon.cli.main import main

sys.exit(main())
