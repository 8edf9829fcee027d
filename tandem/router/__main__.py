import sys

from tandem.router.main import main

sys.exit(main())
