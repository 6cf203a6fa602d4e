"""``python -m agent`` is the ``sustain`` command."""

import sys

from agent.cli import main

sys.exit(main())
