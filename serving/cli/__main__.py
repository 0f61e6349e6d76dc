"""`python -m meshserve.serving.cli`: the `meshserve` command line."""

import sys

from meshserve.serving.cli.main import main

sys.exit(main())
