"""``python -m pipeopt`` runs the command line."""

import sys

from pipeopt.cli import main

sys.exit(main())
