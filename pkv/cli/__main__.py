import sys

from pkv.cli.main import main

sys.exit(main())
