import sys

from bench.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
