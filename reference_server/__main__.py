"""``python -m reference_server``: start the serving stack (see :mod:`reference_server.launcher`)."""

from __future__ import annotations

import sys

from reference_server.launcher import main

if __name__ == "__main__":
    sys.exit(main())
