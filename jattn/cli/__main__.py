"""`python -m jattn.cli ...` is the `jattn` command."""

import sys

from jattn.cli import main

sys.exit(main())
