"""TextArena single-player games behind one adapter environment."""
