"""Layer 6, lessons: code that exists to be taught, never on the engine's path. Versions a chapter
builds and measures but the engine does not run (the tiled GEMM), and the "Build it" exercises with
their autograders."""
