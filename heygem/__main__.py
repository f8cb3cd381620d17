"""``python -m heygem``: see heygem.cli."""

import sys

from heygem.cli import main

sys.exit(main())
