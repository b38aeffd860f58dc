"""``python -m s3capture.cli``: the ``s3capture`` command, as the installed entry point runs it."""

import sys

from s3capture.cli import main

if __name__ == "__main__":
    sys.exit(main())
