"""`python -m worker.deploy` = `kvservice deploy`."""

import sys

from worker.deploy import main

sys.exit(main())
