import sys

from rlmix.cli import main

sys.exit(main())
