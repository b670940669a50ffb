import sys

from vllm_ling.cli.main import main

sys.exit(main())
