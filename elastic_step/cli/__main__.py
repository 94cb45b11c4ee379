import sys

from elastic_step.cli import main

sys.exit(main())
