import sys

from tandem.models.cli import main

sys.exit(main(sys.argv[1:]))
