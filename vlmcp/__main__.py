"""`python -m vlmcp ...`: the same as the `vlmcp` console script."""

import sys

from vlmcp.cli import main

if __name__ == "__main__":
    sys.exit(main())
