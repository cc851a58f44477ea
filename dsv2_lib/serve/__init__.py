"""Layer 5, serve: the engine over HTTP. An OpenAI-compatible server whose requests share one
continuous batch (:class:`~dsv2_lib.engine.live_engine.LiveEngine`). Imports the engine and below."""
