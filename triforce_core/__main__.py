"""`python -m triforce_core` and the installed `triforce` command (see `--help`): the command
line itself is `triforce_core.cli`, one module per subcommand."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
