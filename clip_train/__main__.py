import sys

from clip_train.cli import main

sys.exit(main())
