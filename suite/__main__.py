import sys

from fp8rl.cli import main

sys.exit(main())
