import sys

from tandem.vllm.main import main

sys.exit(main())
