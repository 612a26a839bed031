"""Serving benchmark: upstream SGLang vs SGLang + vskipper (see vskipper/bench/serving.py)."""
from vskipper.bench.serving import main

if __name__ == "__main__":
    main()
