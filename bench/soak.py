"""Soak: SGLang + vskipper at 2x its capacity, no request lost (see vskipper/bench/soak.py)."""
from vskipper.bench.soak import main

if __name__ == "__main__":
    main()
