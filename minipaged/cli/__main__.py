"""`python -m minipaged.cli ...`: the same as the `minipaged` command."""
import sys

from minipaged.cli import main

sys.exit(main())
