import sys

from tandem.frontend.main import main

sys.exit(main())
