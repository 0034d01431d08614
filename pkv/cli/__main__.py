import sys

from pkv.cli.gpu_pool import take
from pkv.cli.worker import delegate

# On a multi-GPU host (the Snakefile's pool, pkv/config/gpus.py) a GPU command first takes a
# GPU of its own (pkv/cli/gpu_pool.py); without a pool nothing changes.
try:
    take(sys.argv[1:])
except OSError as e:
    print(f"pkv: error: {e}", file=sys.stderr)
    sys.exit(2)
# Under the pipeline (PKV_WORKER=on) the warm worker runs the command; else, or when it is
# busy, this process does (pkv/cli/worker.py).
rc = delegate(sys.argv[1:])
if rc is None:
    from pkv.cli.main import main

    rc = main()
sys.exit(rc)
