import sys

from lssar.cli import main

sys.exit(main())
