"""Step benchmarks: one engine step or one routed layer, in process, systems side by side in paired rounds."""
