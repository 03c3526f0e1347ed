import sys

from ranker.cli import main

sys.exit(main())
