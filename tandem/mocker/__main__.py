import sys

from tandem.mocker.main import main

sys.exit(main())
