import sys

from tandem.planner.main import main

sys.exit(main())
