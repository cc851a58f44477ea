"""Layer 7, tools: around the engine, not in it. Benchmarks and timing, the roofline model, the
book's listings, the tiny model's corpus and training, random full-size checkpoints."""
