"""``python -m agent`` is the ``sustain`` command."""

import sys

from agent.cli.main import main

sys.exit(main())
