"""Replay, trace show and the demo model: tools around the engine, free to import any package."""
