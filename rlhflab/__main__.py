import sys

from rlhflab.cli import main

sys.exit(main())
