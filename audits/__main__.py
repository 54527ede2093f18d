"""``python -m audits`` runs the ``fa4-audit`` command line."""

import sys

from audits.cli import main

sys.exit(main())
