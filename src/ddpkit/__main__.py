import sys

from ddpkit.commands.cli import main

sys.exit(main())
