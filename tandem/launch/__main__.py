import sys

from tandem.launch.main import main

sys.exit(main())
