"""`python -m moe_verify.distributed`: the torchrun worker (one rank), moe_verify/distributed."""

import sys

from moe_verify.distributed.worker import main

sys.exit(main())
