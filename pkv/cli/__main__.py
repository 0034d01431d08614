import sys

from pkv.cli.worker import delegate

# Under the pipeline (PKV_WORKER=on) the warm worker runs the command; else, or when it is
# busy, this process does (pkv/cli/worker.py).
rc = delegate(sys.argv[1:])
if rc is None:
    from pkv.cli.main import main

    rc = main()
sys.exit(rc)
