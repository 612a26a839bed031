"""Serving benchmarks: SGLang servers, upstream beside SGLang + vskipper, measured by SGLang's own client."""
