"""`python -m pagedserve` = the `pagedserve` command."""

from __future__ import annotations

import sys

from pagedserve.entrypoints.cli import main

sys.exit(main())
