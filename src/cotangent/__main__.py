"""``python -m cotangent``: the `cotangent` command (see `cotangent._entry`)."""

import sys

from cotangent._entry import main

sys.exit(main())
